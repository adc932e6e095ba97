"""Sequence-to-sequence (transformers' run_summarization): a text -> a target text, generated at evaluation;
ROUGE-1/2/L/Lsum and BLEU.

Embedded default: a standard-library function's source without its docstring -> the docstring's first line.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import transformers
from transformers import PreTrainedTokenizerBase

from ..corpora import seeded_sample, split_rows, stdlib_definitions
from .base import Evaluation, Task, logits_of
from .metrics import IGNORE_INDEX, generation_metrics


def _embedded_seq2seq() -> datasets.DatasetDict:
    rows = []
    for definition in stdlib_definitions():
        summary = definition.doc.strip().splitlines()[0].strip()
        code = definition.source_without_doc
        if definition.kind == "function" and 3 <= len(summary.split()) <= 20 and len(code) <= 800:
            if code.count("\n") >= 2:  # a body beyond `pass`
                rows.append({"text": code, "summary": summary})
    return split_rows(seeded_sample(rows, 400))


def _seq2seq_features(split, tokenizer, args, max_length: int) -> datasets.Dataset:
    def encode(batch: dict[str, list]) -> dict[str, list]:
        sources = [args.task_settings.source_prefix + text for text in batch[args.text_column]]
        encoded = tokenizer(sources, truncation=True, max_length=max_length)
        targets = tokenizer(
            text_target=batch[args.task_settings.summary_column], truncation=True, max_length=args.max_target_length
        )
        encoded["labels"] = targets["input_ids"]
        return encoded

    return split.map(encode, batched=True, remove_columns=split.column_names)


@dataclass(frozen=True)
class Seq2Seq(Task):
    def embedded_data(self) -> datasets.DatasetDict:
        return _embedded_seq2seq()

    def features(self, split, tokenizer, args, max_length: int, to_id: Callable | None) -> datasets.Dataset:
        return _seq2seq_features(split, tokenizer, args, max_length)

    def collator(self, tokenizer: PreTrainedTokenizerBase) -> Any:
        return transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)

    def metrics(self, args, evaluation: Evaluation, tokenizer, label_names) -> tuple[Callable, None]:
        return generation_metrics(tokenizer), None

    def prediction_rows(self, output, args, evaluation: Evaluation, tokenizer, label_names) -> list[dict]:
        generated = logits_of(output.predictions)
        generated = np.where(generated == IGNORE_INDEX, tokenizer.pad_token_id, generated)
        return [{"prediction": text.strip()} for text in tokenizer.batch_decode(generated, skip_special_tokens=True)]


SEQ2SEQ = Seq2Seq(
    name="seq2seq",
    auto_class="AutoModelForSeq2SeqLM",
    peft_task_type="SEQ_2_SEQ_LM",
    pipeline_tag="text2text-generation",  # the Hub tag of the head (coreformer.families); "summarization" named a
    # pipeline transformers 5 removed: the folder carries coreformer-text2text (pipeline(model=folder, ...))
    card_task_type="summarization",
    card_task_name="Summarization",
    label_names=("labels",),
    columns={"text_column": "text", "summary_column": "summary"},
    embedded_description="standard-library function source without its docstring -> the docstring's first line "
    "(code summarisation)",
    usage='inputs = tokenizer("def close(self):\\n    self.stream.close()", return_tensors="pt")\n'
    "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0], skip_special_tokens=True))",
    generates=True,
    padding_free_refusal="starts each target's decoder input from its own row (and generates from padded batches); "
    "drop --padding-free",
    shown=(("input", "text_column"), ("gold", "summary_column")),
)
