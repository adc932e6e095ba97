"""Sequence classification (transformers' run_glue): a text (or a pair) -> one class; accuracy and macro P/R/F1.

Embedded default: was this line of Python corrupted? Lines of the standard library's asyncio, email, logging and xml
packages, half as written ("original"), half with one corruption ("corrupted"): the zero-shot evaluation's
(zero_shot.CORRUPTIONS: two adjacent tokens swapped, a keyword or a name replaced by another), in turn. A swap keeps
every token of the line, so word identity alone cannot tell the classes apart: the task measures what an encoder
learned of Python's context, where a pretrained encoder beats an untrained one of the same shape
(benchmarks/results/default_finetuning.md). `package_docstrings` (a docstring's first paragraph -> its package) is
the lexical control: an untrained encoder does as well on it, since random features keep token identity.

    package_lines(rng)               the distinct lines of each file of the embedded packages, files in rng's order
    corrupted_lines(count, rng)      the default's rows, balanced: {"text": a line, "label": original | corrupted}
    package_docstrings(per_package)  the lexical control's rows: {"text": a docstring paragraph, "label": its package}
"""

import random
from collections.abc import Callable
from dataclasses import dataclass

import datasets

from ..corpora import (
    EMBEDDED_PACKAGES,
    EMBEDDED_SEED,
    first_paragraph,
    read_source,
    seeded_sample,
    split_rows,
    stdlib_definitions,
    stdlib_source_files,
)
from ..zero_shot import CORRUPTIONS, LEXEME, candidate_lines
from .base import Evaluation, Task, logits_of
from .metrics import classification_metrics

EMBEDDED_ROWS = 2000  # lines of the embedded default (half corrupted), before its train / validation split


def package_lines(rng: random.Random) -> list[list[str]]:
    """The distinct lines (three lexemes or more) of each file of the embedded packages that has more than two, the
    files in an order drawn from `rng`."""
    files = [path for package in EMBEDDED_PACKAGES for path in stdlib_source_files(package)]
    rng.shuffle(files)
    return [lines for path in files if len(lines := candidate_lines([read_source(path) or ""])) > 2]


def corrupted_lines(count: int | None, rng: random.Random, file_column: str | None = None) -> list[dict]:
    """`count` rows (None: as many as the lines make), alternately a line as written ({"text": line, "label":
    "original"}) and the next line with one corruption ("corrupted"), each of CORRUPTIONS in turn; a line that its
    turn's corruption cannot change is passed over. Lines come file by file (package_lines), each once.
    `file_column`: each row also holds the index of its line's file under that key (to split rows by file)."""
    placed = [(file, line) for file, lines in enumerate(package_lines(rng)) for line in lines]
    # the names a replacement draws from: every identifier of the lines, keywords too
    names = sorted({name for _, line in placed for name in LEXEME.findall(line) if name[0] == "_" or name[0].isalpha()})
    rows, kinds = [], list(CORRUPTIONS)
    for file, line in placed:
        if len(rows) == count:
            break
        row = {} if file_column is None else {file_column: file}
        if len(rows) % 2 == 0:
            rows.append({"text": line, "label": "original", **row})
            continue
        kind = kinds[(len(rows) // 2) % len(kinds)]
        candidates = CORRUPTIONS[kind](line, list(LEXEME.finditer(line)), rng, names)
        if candidates:
            rows.append({"text": candidates[0], "label": "corrupted", **row})
    return rows


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
    """EMBEDDED_ROWS rows drawn from every file's lines, each text once (a line some files share too), original and
    corrupted alternating, so that the validation split (the last rows) is balanced."""
    seen: set[str] = set()
    rows = [
        row
        for row in corrupted_lines(None, random.Random(EMBEDDED_SEED))
        if not (row["text"] in seen or seen.add(row["text"]))
    ]
    originals, corrupted = ([row for row in rows if row["label"] == label] for label in ("original", "corrupted"))
    drawn = zip(seeded_sample(originals, EMBEDDED_ROWS // 2), seeded_sample(corrupted, EMBEDDED_ROWS // 2), strict=True)
    return split_rows([row for pair in drawn for row in pair])


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
    embedded_description=f"{EMBEDDED_ROWS:,} lines of Python from the standard library's asyncio, email, logging and "
    "xml packages, half as written (original) and half with one corruption (two adjacent tokens swapped, a keyword "
    "or a name replaced: corrupted); it asks what the encoder learned of Python's context",
    usage='inputs = tokenizer("return self._headers[name]", return_tensors="pt")\n'
    "print(model.config.id2label[model(**inputs).logits.argmax(-1).item()])",
    labels="example",
    shown=(("input", "text_column"), ("input_pair", "text_pair_column"), ("gold", "label_column")),
    default_label_column="label",
    head_suffix="ForSequenceClassification",
    pads_right=True,
    padding_free_refusal="pools one vector per row, and a flattened row holds a whole batch of texts; drop "
    "--padding-free (classification trains on padded batches)",
)
