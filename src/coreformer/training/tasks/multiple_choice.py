"""Multiple choice (transformers' run_swag): a text and C candidate answers -> the index of the right one; accuracy.

Each candidate is encoded as its own pair `(text, candidate)`; the head scores every pair from its first token and
takes a softmax over the C scores (CoreformerEncoderForMultipleChoice). Every example of a dataset has the same
number of candidates (a batch is (B, C, T)).

Embedded default: the first paragraph of a standard-library function's docstring, and four signatures
`name(params)` from the same package, one of them the documented function's: which function does it describe?
"""

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import transformers
from transformers import PreTrainedTokenizerBase

from ..corpora import EMBEDDED_SEED, Definition, first_paragraph, seeded_sample, split_rows, stdlib_definitions
from .base import Evaluation, FinetuningError, Task, logits_of
from .metrics import load_metric

_CHOICES = 4  # candidates per embedded example


def _signature(definition: Definition) -> str:
    return f"{definition.name}({', '.join(name for name, _ in definition.params)})"


def _embedded_multiple_choice() -> datasets.DatasetDict:
    """400 docstrings, each with its function's signature and three others of its package, in a seeded order."""
    functions, seen = [], set()
    for definition in stdlib_definitions():
        text = first_paragraph(definition.doc)
        if definition.kind == "function" and len(text.split()) >= 4 and text not in seen:
            seen.add(text)
            functions.append(definition)
    order = random.Random(EMBEDDED_SEED)
    rows = []
    for definition in seeded_sample(functions, 400):
        others = sorted(
            {_signature(d) for d in functions if d.package == definition.package and d.name != definition.name}
        )
        choices = [_signature(definition), *order.sample(others, _CHOICES - 1)]
        order.shuffle(choices)
        rows.append(
            {
                "text": first_paragraph(definition.doc),
                "choices": choices,
                "label": choices.index(_signature(definition)),
            }
        )
    return split_rows(rows)


def _multiple_choice_features(split, tokenizer, args, max_length: int) -> datasets.Dataset:
    """(text, candidate) pairs, C per example, grouped back into lists of C; labels: the right candidate's index."""
    counts = {len(choices) for choices in split[args.task_settings.choices_column]}
    if len(counts) != 1 or min(counts) < 2:
        raise FinetuningError(
            f"Every example needs the same number (>= 2) of candidates in {args.task_settings.choices_column!r}; found "
            f"{sorted(counts)}."
        )
    (choices,) = counts

    def encode(batch: dict[str, list]) -> dict[str, list]:
        for label in batch[args.label_column]:
            if not isinstance(label, int) or not 0 <= label < choices:
                raise FinetuningError(
                    f"Column {args.label_column!r} must hold the index (0 to {choices - 1}) of the right candidate; "
                    f"got {label!r}."
                )
        texts = [text for text in batch[args.text_column] for _ in range(choices)]
        candidates = [candidate for row in batch[args.task_settings.choices_column] for candidate in row]
        encoded = tokenizer(texts, candidates, truncation=True, max_length=max_length)
        grouped = {
            key: [values[start : start + choices] for start in range(0, len(values), choices)]
            for key, values in encoded.items()
        }  # (B * C) rows -> B lists of C
        return {**grouped, "labels": list(batch[args.label_column])}

    return split.map(encode, batched=True, remove_columns=split.column_names)


def _accuracy() -> Callable[[transformers.EvalPrediction], dict[str, float]]:
    accuracy = load_metric("accuracy")

    def compute_metrics(prediction: transformers.EvalPrediction) -> dict[str, float]:
        return accuracy.compute(
            predictions=logits_of(prediction.predictions).argmax(-1), references=prediction.label_ids
        )

    return compute_metrics


@dataclass(frozen=True)
class MultipleChoice(Task):
    def embedded_data(self) -> datasets.DatasetDict:
        return _embedded_multiple_choice()

    def features(self, split, tokenizer, args, max_length: int, to_id: Callable | None) -> datasets.Dataset:
        return _multiple_choice_features(split, tokenizer, args, max_length)

    def collator(self, tokenizer: PreTrainedTokenizerBase) -> Any:
        return transformers.DataCollatorForMultipleChoice(tokenizer)

    def metrics(self, args, evaluation: Evaluation, tokenizer, label_names) -> tuple[Callable, None]:
        return _accuracy(), None

    def prediction_rows(self, output, args, evaluation: Evaluation, tokenizer, label_names) -> list[dict]:
        scores = logits_of(output.predictions)
        choices = evaluation.examples[args.task_settings.choices_column]
        return [
            {"prediction": int(index), "prediction_text": row[int(index)]}
            for index, row in zip(np.argmax(scores, axis=-1), choices, strict=True)
        ]


MULTIPLE_CHOICE = MultipleChoice(
    name="multiple-choice",
    auto_class="AutoModelForMultipleChoice",
    peft_task_type="SEQ_CLS",  # peft has no multiple-choice type; its classifier is saved with the adapter as well
    pipeline_tag=None,  # the Hub has no multiple-choice pipeline (coreformer.families)
    card_task_type="multiple-choice",
    card_task_name="Multiple Choice",
    label_names=("labels",),
    shown=(("input", "text_column"), ("choices", "choices_column"), ("gold", "label_column")),
    columns={"text_column": "text", "choices_column": "choices", "label_column": "label"},
    embedded_description="the first paragraph of a standard-library function's docstring (asyncio, email, logging, "
    "xml) and four signatures `name(params)` from the same package, one of them the documented function's; the "
    "label is its position",
    usage='question = "Return the event loop."\nchoices = ["get_event_loop()", "close(self)"]\n'
    'inputs = tokenizer([question] * len(choices), choices, return_tensors="pt", padding=True)\n'
    "scores = model(**{key: value[None] for key, value in inputs.items()}).logits\n"
    "print(choices[scores.argmax(-1).item()])",
    default_label_column="label",
    padding_free_refusal="scores each example's choices as the rows of a (B, choices, T) batch, which one flattened "
    "row cannot hold; drop --padding-free",
)
