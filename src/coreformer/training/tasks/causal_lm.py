"""Causal language modelling (transformers' run_clm): texts joined by eos, cut into `--max-length` blocks;
perplexity (token-weighted).

The blocks hold no padding. Under --padding-free each document in a block attends only to itself, as TRL's packing
does: positions restart after every eos, and a document's first token is not predicted from the one before it.

Embedded default: the source of standard-library functions of at most 1,500 characters.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ..corpora import seeded_sample, split_rows, stdlib_definitions
from ..objectives.causal_lm import PackedCausalLMCollator, pack_into_blocks
from .base import IGNORE_INDEX, Evaluation, FinetuningError, Task
from .metrics import language_modeling_metrics


def _embedded_causal_lm() -> datasets.DatasetDict:
    functions = [d for d in stdlib_definitions() if d.kind == "function" and len(d.source) <= 1500]
    return split_rows([{"text": d.source} for d in seeded_sample(functions, 300)])


def _causal_lm_features(split, tokenizer, args, max_length: int) -> datasets.Dataset:
    """run_clm's grouping: the texts tokenized without special tokens, joined by eos, cut into full blocks."""
    if tokenizer.eos_token_id is None:
        raise FinetuningError("causal-lm joins documents with the eos token; the tokenizer has none.")
    tokenized = split.map(
        lambda batch: {"input_ids": tokenizer(batch[args.text_column], add_special_tokens=False)["input_ids"]},
        batched=True,
        remove_columns=split.column_names,
    )
    return pack_into_blocks(tokenized, max_length, eos_token_id=tokenizer.eos_token_id, batch_size=100_000)


@dataclass
class SeparateDocumentsCollator:
    """Full blocks with their documents kept apart: position ids restart after every eos (no attention mask, so the
    model keeps each document to itself) and the label of each document's first token is -100, as
    DataCollatorWithFlattening leaves it (the model shifts labels: it would be predicted from the document before)."""

    eos_token_id: int

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = PackedCausalLMCollator(eos_token_id=self.eos_token_id, return_position_ids=True)(examples)
        batch["labels"] = batch["labels"].masked_fill(batch["position_ids"] == 0, IGNORE_INDEX)  # (B, block)
        return batch


@dataclass(frozen=True)
class CausalLanguageModeling(Task):
    def embedded_data(self) -> datasets.DatasetDict:
        return _embedded_causal_lm()

    def features(self, split, tokenizer, args, max_length: int, to_id: Callable | None) -> datasets.Dataset:
        return _causal_lm_features(split, tokenizer, args, max_length)

    def collator(self, tokenizer: PreTrainedTokenizerBase) -> Any:
        return PackedCausalLMCollator(eos_token_id=tokenizer.eos_token_id)

    def padding_free_collator(self, tokenizer: PreTrainedTokenizerBase) -> Any:
        return SeparateDocumentsCollator(eos_token_id=tokenizer.eos_token_id)

    def metrics(self, args, evaluation: Evaluation, tokenizer, label_names) -> tuple[Callable, Callable]:
        return language_modeling_metrics(causal=True)

    def final_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        if "eval_loss" in metrics:
            metrics.setdefault("eval_perplexity", float(np.exp(min(metrics["eval_loss"], 700))))
        return metrics


CAUSAL_LM = CausalLanguageModeling(
    name="causal-lm",
    auto_class="AutoModelForCausalLM",
    peft_task_type="CAUSAL_LM",
    pipeline_tag="text-generation",
    card_task_type="text-generation",
    card_task_name="Causal Language Modeling",
    label_names=("labels",),
    columns={"text_column": "text"},
    pads_batches=False,  # packed blocks are all full
    padding_free_refusal=None,  # documents kept apart inside their blocks: each one's loss is its loss alone
    labels_shift=True,
    embedded_description="the source of standard-library functions (at most 1,500 characters each)",
    usage='inputs = tokenizer("def ", return_tensors="pt")\n'
    "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0]))",
)
