"""Token classification (transformers' run_ner): words -> one BIO tag each, the first sub-word carrying it;
seqeval entity P/R/F1 and token accuracy.

Embedded default: single lines of standard-library source as Python tokens, tagged by the `tokenize` module.
"""

import builtins
import io
import keyword
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import transformers
from transformers import PreTrainedTokenizerBase

from ..corpora import seeded_sample, split_rows, stdlib_definitions
from .base import Evaluation, FinetuningError, Task, logits_of
from .metrics import IGNORE_INDEX, token_classification_metrics

_BUILTIN_NAMES = frozenset(name for name in dir(builtins) if not name.startswith("_"))
_TOKEN_TYPES = {tokenize.NAME, tokenize.OP, tokenize.NUMBER, tokenize.STRING}
_SKIPPED_TOKEN_TYPES = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
_SKIPPED_TOKEN_TYPES.add(tokenize.COMMENT)


def python_token_tags(line: str) -> tuple[list[str], list[str]] | None:
    """One line of Python -> (words, BIO tags) from `tokenize`, or None for a line this tagging does not cover
    (continued or multi-line tokens, f-strings on Python >= 3.12, tokenizer errors).

    Keywords are B-KW, builtin names B-BUILTIN, numbers B-NUM; a string literal is split on whitespace into
    B-STR I-STR ...; other names and operators are O.
    """
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None
    words, tags = [], []
    for token in tokens:
        if token.type in _SKIPPED_TOKEN_TYPES:
            continue
        if token.type not in _TOKEN_TYPES or token.start[0] != token.end[0]:
            return None
        if token.type == tokenize.STRING:
            parts = token.string.split()
            words += parts
            tags += ["B-STR"] + ["I-STR"] * (len(parts) - 1)
            continue
        words.append(token.string)
        if token.type == tokenize.NUMBER:
            tags.append("B-NUM")
        elif token.type == tokenize.NAME and keyword.iskeyword(token.string):
            tags.append("B-KW")
        elif token.type == tokenize.NAME and token.string in _BUILTIN_NAMES:
            tags.append("B-BUILTIN")
        else:
            tags.append("O")
    return words, tags


def _embedded_token_classification() -> datasets.DatasetDict:
    candidates, seen = [], set()
    for definition in stdlib_definitions():
        if definition.kind != "function":
            continue
        for line in definition.source_without_doc.splitlines()[1:]:  # the body, not the def line
            line = line.strip()
            if not line or line in seen or line.endswith(("\\", ",", "(", "[", "{")):
                continue
            seen.add(line)
            tagged = python_token_tags(line)
            if tagged and 3 <= len(tagged[0]) <= 24 and any(tag != "O" for tag in tagged[1]):
                candidates.append({"tokens": tagged[0], "ner_tags": tagged[1]})
    return split_rows(seeded_sample(candidates, 500))


def _token_classification_features(split, tokenizer, args, max_length: int, label_of: Callable) -> datasets.Dataset:
    """run_ner's alignment: the first sub-word of a word carries its tag, the rest and special tokens -100."""

    words_column = args.task_settings.tokens_column

    def encode(batch: dict[str, list]) -> dict[str, list]:
        for words, tags in zip(batch[words_column], batch[args.label_column], strict=True):
            if len(words) != len(tags):
                raise FinetuningError(
                    f"An example has {len(words)} words in {words_column!r} but {len(tags)} tags in "
                    f"{args.label_column!r}: {words[:8]}..."
                )
        encoded = tokenizer(batch[words_column], is_split_into_words=True, truncation=True, max_length=max_length)
        encoded["labels"] = []
        for row, tags in enumerate(batch[args.label_column]):
            labels, previous = [], None
            for word in encoded.word_ids(row):
                labels.append(IGNORE_INDEX if word is None or word == previous else label_of(tags[word]))
                previous = word
            encoded["labels"].append(labels)
        return encoded

    return split.map(encode, batched=True, remove_columns=split.column_names)


@dataclass(frozen=True)
class TokenClassification(Task):
    def embedded_data(self) -> datasets.DatasetDict:
        return _embedded_token_classification()

    def features(self, split, tokenizer, args, max_length: int, to_id: Callable | None) -> datasets.Dataset:
        return _token_classification_features(split, tokenizer, args, max_length, to_id)

    def collator(self, tokenizer: PreTrainedTokenizerBase) -> Any:
        return transformers.DataCollatorForTokenClassification(tokenizer)

    def metrics(self, args, evaluation: Evaluation, tokenizer, label_names) -> tuple[Callable, None]:
        return token_classification_metrics(dict(enumerate(label_names))), None

    def prediction_rows(self, output, args, evaluation: Evaluation, tokenizer, label_names) -> list[dict]:
        rows = []
        for row_predictions, row_labels in zip(logits_of(output.predictions).argmax(-1), output.label_ids, strict=True):
            keep = row_labels != IGNORE_INDEX  # first sub-word of each word
            rows.append({"prediction": [label_names[int(i)] for i in row_predictions[keep]]})
        return rows


TOKEN_CLASSIFICATION = TokenClassification(
    name="token-classification",
    auto_class="AutoModelForTokenClassification",
    peft_task_type="TOKEN_CLS",
    pipeline_tag="token-classification",
    card_task_type="token-classification",
    card_task_name="Token Classification",
    label_names=("labels",),
    columns={"tokens_column": "tokens", "label_column": "ner_tags"},
    embedded_description="single lines of standard-library source split into Python tokens (string literals "
    "into their words), tagged by the `tokenize` module: B-KW keywords, B-BUILTIN builtin names, B-NUM numbers, "
    "B-STR/I-STR string literals, O everything else",
    usage='inputs = tokenizer(["return", "len", "(", "x", ")"], is_split_into_words=True, return_tensors="pt")\n'
    "print([model.config.id2label[i] for i in model(**inputs).logits.argmax(-1)[0].tolist()])",
    labels="word",
    shown=(("input", "tokens_column"), ("gold", "label_column")),
    default_label_column="ner_tags",
    head_suffix="ForTokenClassification",
    pads_right=True,
    padding_free_refusal=None,  # a label per token: the flattened row's loss is the padded batch's
)
