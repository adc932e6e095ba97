"""The protocol every fine-tuning task follows: what the fine-tuning run asks of it, with shared defaults.

    Task.columns                              argument -> its column in the embedded data (renamed to the run's)
    Task.embedded_data()                      the offline default, built from the Python standard library
    Task.features(split, tokenizer, args, max_length, to_id)    examples -> model features
    Task.collator(tokenizer)                  features -> a padded batch
    Task.padding_free_collator(tokenizer)     features -> one flattened row (--padding-free; tasks that allow it)
    Task.metrics(args, evaluation, tokenizer, label_names)      (compute_metrics, preprocess_logits_for_metrics)
    Task.prediction_rows(output, args, evaluation, tokenizer, label_names)   eval_predictions.jsonl rows
    auto_class / peft_task_type / pipeline_tag / card_* / usage   the head, LoRA and the model card; `families`
                                              are those that register a head for `auto_class`

`evaluation` is an `Evaluation`: the validation examples and their features. A task with labels read from the data
sets `labels` ("example": one per example, "word": one per word) and `head_suffix` (a checkpoint head of that class
must have as many labels). The registry is tasks/__init__.py.

--padding-free lays a training batch's examples end to end in one row, as transformers' DataCollatorWithFlattening
does (position ids restarting at 0 for each example, no attention mask, no padding); the model keeps each example
to itself (docs/concepts/unpadding.md), so the loss is the padded batch's. A task allows it by setting
`padding_free_refusal` to None; otherwise that field is the refusal's reason and fix.

    padded (B=3, T=5)            flattened (1, 11)
    a a a . .                    input_ids     a a a b b b b b c c c
    b b b b b      ->            position_ids  0 1 2 0 1 2 3 4 0 1 2
    c c c . .                    labels        each example's own (`labels_shift`: its first one -100)
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
import transformers
from transformers import PreTrainedTokenizerBase

from ..arguments import FinetuningError  # noqa: F401  (tasks raise it; re-exported for them)
from ..families import families_with_head
from .metrics import IGNORE_INDEX


@dataclass
class Evaluation:
    """The validation split as examples (what the data holds) and as features (what the model reads)."""

    examples: datasets.Dataset
    features: datasets.Dataset


def logits_of(predictions: Any) -> np.ndarray:
    """Trainer hands back a tuple when the model returns more than logits."""
    return predictions[0] if isinstance(predictions, tuple) else predictions


@dataclass
class FlatteningCollator:
    """A batch of examples as one row (1, sum of lengths): transformers' DataCollatorWithFlattening (input_ids,
    position_ids restarting at 0, labels with each example's first one -100), with each example's labels kept as
    they are unless `labels_shift` (a token's own label is not the next token's: the first one counts)."""

    labels_shift: bool = False

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = transformers.DataCollatorWithFlattening(separator_id=IGNORE_INDEX, return_tensors="pt")(features)
        if not self.labels_shift and "labels" in features[0]:
            labels = [int(label) for feature in features for label in feature["labels"]]
            batch["labels"] = torch.tensor([labels], dtype=torch.long)  # (1, sum of lengths)
        return batch


@dataclass(frozen=True)
class Task(ABC):
    name: str
    auto_class: str  # name in transformers
    peft_task_type: str  # peft.TaskType member
    pipeline_tag: str | None
    card_task_type: str  # model-index task type
    card_task_name: str
    label_names: tuple[str, ...]  # Trainer label_names
    columns: dict[str, str]  # argument -> the embedded data's column
    embedded_description: str
    usage: str  # the card's example after `model = ...` and `tokenizer = ...`
    labels: str | None = None  # "example" | "word": class labels read from `label_column`
    default_label_column: str | None = None
    head_suffix: str | None = None  # class-name suffix of a head whose label count must match the data
    generates: bool = False  # Seq2SeqTrainer with predict_with_generate
    pads_right: bool = False  # features line up with offsets / words only when padding comes after the tokens
    pads_batches: bool = True  # batches are padded, so the tokenizer needs a pad token (eos serves when it has none)
    # --padding-free: None when a training batch may be one flattened row; otherwise why not and what to do instead
    padding_free_refusal: str | None = (
        "does not say that its batches may be flattened into one row (its Task allows it with "
        "padding_free_refusal=None); drop --padding-free"
    )
    labels_shift: bool = False  # the model shifts labels (causal LM): a flattened example's first label is -100
    # (row key, the settings field naming a column): what eval_predictions.jsonl copies from each validation example
    # beside the prediction, the input and the gold answer ("gold")
    shown: tuple[tuple[str, str], ...] = ()

    @property
    def families(self) -> tuple[str, ...]:
        """The families that have this task's head (coreformer.families)."""
        return families_with_head(self.auto_class)

    @abstractmethod
    def embedded_data(self) -> datasets.DatasetDict:
        """The offline train / validation splits this task trains on when no data is given."""

    @abstractmethod
    def features(
        self,
        split: datasets.Dataset,
        tokenizer: PreTrainedTokenizerBase,
        args: Any,
        max_length: int,
        to_id: Callable[[Any], int] | None,
    ) -> datasets.Dataset:
        """`split` tokenized into model inputs and labels, at most `max_length` tokens."""

    def collator(self, tokenizer: PreTrainedTokenizerBase) -> Any:
        return transformers.DataCollatorWithPadding(tokenizer)

    def padding_free_collator(self, tokenizer: PreTrainedTokenizerBase) -> Any:
        """The training collator under --padding-free (only asked of tasks whose `padding_free_refusal` is None)."""
        return FlatteningCollator(labels_shift=self.labels_shift)

    @abstractmethod
    def metrics(
        self, args: Any, evaluation: Evaluation, tokenizer: PreTrainedTokenizerBase, label_names: list[str] | None
    ) -> tuple[Callable, Callable | None]:
        """(compute_metrics, preprocess_logits_for_metrics or None) for the Trainer."""

    def prediction_rows(
        self,
        output: Any,
        args: Any,
        evaluation: Evaluation,
        tokenizer: PreTrainedTokenizerBase,
        label_names: list[str] | None,
    ) -> list[dict]:
        """One JSON-able row per validation example from `Trainer.predict`'s output (none by default)."""
        return []

    def final_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics derived from Trainer's after evaluation (none by default)."""
        return metrics
