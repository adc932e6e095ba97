"""Sequence classification (transformers' run_glue): a text (or a pair) -> one class; accuracy and macro P/R/F1.

Embedded default: first paragraphs of docstrings of four standard-library packages, labelled with the package.
"""

from collections.abc import Callable
from dataclasses import dataclass

import datasets

from ...evaluation import classification_metrics
from ..corpora import EMBEDDED_PACKAGES, first_paragraph, seeded_sample, split_rows, stdlib_definitions
from .base import Evaluation, Task, logits_of


def package_docstrings(per_package: int | None = 100) -> list[dict[str, str]]:
    """{"text": a docstring's first paragraph (4 words or more, each text once), "label": its package}, `per_package`
    of each package (None: as many as the smallest package has, so the classes stay balanced), in a seeded order."""
    by_package: dict[str, list[str]] = {package: [] for package in EMBEDDED_PACKAGES}
    seen = set()
    for definition in stdlib_definitions():
        text = first_paragraph(definition.doc)
        if len(text.split()) >= 4 and text not in seen:
            seen.add(text)
            by_package[definition.package].append(text)
    count = min(len(texts) for texts in by_package.values()) if per_package is None else per_package
    rows = [
        {"text": text, "label": package}
        for package, texts in by_package.items()
        for text in seeded_sample(texts, count)
    ]
    return seeded_sample(rows, len(rows))


def _embedded_sequence_classification() -> datasets.DatasetDict:
    return split_rows(package_docstrings(100))


def _classification_features(split, tokenizer, args, max_length: int, label_of: Callable) -> datasets.Dataset:
    def encode(batch: dict[str, list]) -> dict[str, list]:
        pairs = batch[args.task_settings.text_pair_column] if args.task_settings.text_pair_column else None
        encoded = tokenizer(batch[args.text_column], pairs, truncation=True, max_length=max_length)
        encoded["labels"] = [label_of(value) for value in batch[args.label_column]]
        return encoded

    return split.map(encode, batched=True, remove_columns=split.column_names)


@dataclass(frozen=True)
class SequenceClassification(Task):
    def embedded_data(self) -> datasets.DatasetDict:
        return _embedded_sequence_classification()

    def features(self, split, tokenizer, args, max_length: int, to_id: Callable | None) -> datasets.Dataset:
        return _classification_features(split, tokenizer, args, max_length, to_id)

    def metrics(self, args, evaluation: Evaluation, tokenizer, label_names) -> tuple[Callable, None]:
        return classification_metrics(average="macro"), None

    def prediction_rows(self, output, args, evaluation: Evaluation, tokenizer, label_names) -> list[dict]:
        return [{"prediction": label_names[int(i)]} for i in logits_of(output.predictions).argmax(-1)]


SEQUENCE_CLASSIFICATION = SequenceClassification(
    name="sequence-classification",
    auto_class="AutoModelForSequenceClassification",
    peft_task_type="SEQ_CLS",
    pipeline_tag="text-classification",
    card_task_type="text-classification",
    card_task_name="Text Classification",
    label_names=("labels",),
    columns={"text_column": "text", "text_pair_column": "", "label_column": "label"},
    embedded_description="first paragraphs of docstrings in the standard library's asyncio, email, logging "
    "and xml packages, labelled with the package they come from (100 per package)",
    usage='inputs = tokenizer("Return the header value.", return_tensors="pt")\n'
    "print(model.config.id2label[model(**inputs).logits.argmax(-1).item()])",
    labels="example",
    shown=(("input", "text_column"), ("input_pair", "text_pair_column"), ("gold", "label_column")),
    default_label_column="label",
    head_suffix="ForSequenceClassification",
    pads_right=True,
    padding_free_refusal="pools one vector per row, and a flattened row holds a whole batch of texts; drop "
    "--padding-free (classification trains on padded batches)",
)
