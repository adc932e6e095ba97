"""The protocol every fine-tuning task follows: what the fine-tuning run asks of it, with shared defaults.

    Task.columns                              argument -> its column in the embedded data (renamed to the run's)
    Task.embedded_data()                      the offline default, built from the Python standard library
    Task.features(split, tokenizer, args, max_length, to_id)    examples -> model features
    Task.collator(tokenizer)                  features -> a padded batch
    Task.metrics(args, evaluation, tokenizer, label_names)      (compute_metrics, preprocess_logits_for_metrics)
    Task.prediction_rows(output, args, evaluation, tokenizer, label_names)   eval_predictions.jsonl rows
    auto_class / peft_task_type / pipeline_tag / card_* / usage   the head, LoRA and the model card; `families`
                                              are those that register a head for `auto_class`

`evaluation` is an `Evaluation`: the validation examples and their features. A task with labels read from the data
sets `labels` ("example": one per example, "word": one per word) and `head_suffix` (a checkpoint head of that class
must have as many labels). The registry is tasks/__init__.py.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import transformers
from transformers import PreTrainedTokenizerBase

from ..arguments import FinetuningError  # noqa: F401  (tasks raise it; re-exported for them)
from ..families import families_with_head


@dataclass
class Evaluation:
    """The validation split as examples (what the data holds) and as features (what the model reads)."""

    examples: datasets.Dataset
    features: datasets.Dataset


def logits_of(predictions: Any) -> np.ndarray:
    """Trainer hands back a tuple when the model returns more than logits."""
    return predictions[0] if isinstance(predictions, tuple) else predictions


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
