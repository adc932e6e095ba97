"""A pretraining run's arguments and its state, shared by the driver (__init__.py) and its steps
(inputs.py, run_folder.py, loop.py), which all import from here and never from the driver.

    PretrainingArguments     PretrainingSettings with the checks that need the registries
    resolve_arguments(...)   gathered settings -> typed, checked PretrainingArguments
    _Run                     what `prepare` settled: arguments, accelerator, tokenizer, data, engine
    _Training                the model and optimizer in training, where the run is, what it has measured
"""

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from coreformer_settings.objectives import OBJECTIVE_REGISTRY, objective_settings
from coreformer_settings.pretraining import (
    MIXED_PRECISION,
    REPORT_TO,
    PretrainingSettings,
    check_data_source,
    gather_settings,
)
from coreformer_settings.registries import FAMILY_NAMES

from ..arguments import PretrainingError
from ..engine import Engine
from ..families import TRAINING_FACTS
from ..objectives import OBJECTIVES, Objective
from ..optimizers import check_optimization_settings
from ..shard_examples import ShardTable

# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class PretrainingArguments(PretrainingSettings):
    """Every setting of a pretraining run (declared in coreformer_settings.pretraining, so that --help needs no
    torch), checked here against the registries: the objective's families, the family config's fields; the
    objective's own settings are typed and checked by its settings class (coreformer_settings.objectives)."""

    def __post_init__(self) -> None:
        self.check_choices(family=FAMILY_NAMES, mixed_precision=MIXED_PRECISION, report_to=REPORT_TO)
        if self.objective is None:
            self.objective = TRAINING_FACTS[self.family].default_objective
        self.check_choices(objective=tuple(OBJECTIVE_REGISTRY))
        if self.family not in self.spec.families:
            raise PretrainingError(
                f"The {self.objective} objective trains {' or '.join(self.spec.families)} models; --family is "
                f"{self.family}. Pass --family {self.spec.families[0]} or another --objective."
            )
        self.packing = self.spec.packing(self)
        positive = ("vocab_size", "pad_vocab_to_multiple_of", "block_size", "max_steps", "batch_size", "grad_accum")
        self.check_at_least(1, positive + ("keep_last", "eval_batches"))
        self.check_at_least(
            0, ("save_every", "eval_every", "warmup_steps", "num_workers", "zero_shot_pairs"), note=" (0 turns it off)"
        )
        self.check_at_least(1, ("threads",), unset_ok=True, note=" (or unset: chosen from the machine)")
        if self.max_documents is not None and self.max_documents < 2:
            raise PretrainingError(f"`max_documents` must be >= 2 (train + held out), got {self.max_documents}.")
        if self.lr <= 0:
            raise PretrainingError(f"`lr` must be > 0, got {self.lr}.")
        self.check_between("validation_fraction", 0.0, 1.0, low_open=False, high_open=True)
        check_optimization_settings(self)
        check_data_source(vars(self))
        self.objective_settings = objective_settings(self.objective, self.objective_settings)  # checked there
        if not isinstance(self.model, dict):
            raise PretrainingError(f"`model` must be a mapping of config fields, got {type(self.model).__name__}.")
        if "vocab_size" in self.model:
            raise PretrainingError(
                "`model.vocab_size` is set from the tokenizer (padded to `pad_vocab_to_multiple_of`); set the "
                "top-level `vocab_size` (the tokenizer's target) instead."
            )
        known = _config_fields(self.family)
        unknown = sorted(set(self.model) - known)
        if unknown:
            raise PretrainingError(
                f"Unknown {self.family} config field(s) under `model`: {', '.join(unknown)}. "
                f"See {TRAINING_FACTS[self.family].config_class.__name__} for the fields."
            )

    @property
    def spec(self) -> Objective:
        return OBJECTIVES[self.objective]


def _config_fields(family: str) -> set[str]:
    return {f.name for f in dataclasses.fields(TRAINING_FACTS[family].config_class)}


def resolve_arguments(
    *,
    family: str | None = None,
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    configs_dir: str | Path | None = None,
) -> PretrainingArguments:
    """Dataclass defaults, then the preset (`--preset`, default "tiny") or `--config` file, then `overrides`
    (the flags given on the command line). A `model:` mapping in `overrides` updates the file's field by field.
    """
    values, source = gather_settings(
        family=family, preset=preset, config_file=config_file, overrides=overrides, configs_dir=configs_dir
    )
    return PretrainingArguments.resolve(values, source=source)


# ---------------------------------------------------------------------------------------------------------------------
# The run: prepare, build, train, finish (the train and finish stages: loop.py)
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What `prepare` found: every input checked, nothing written yet."""

    args: PretrainingArguments
    accelerator: Any
    tracker: str | None
    resume: Path | None
    state: dict[str, Any] | None  # the resumed checkpoint's trainer_state.json
    tokenizer: PreTrainedTokenizerBase
    tokenizer_name: str
    config: Any
    # rows by index (GlobalBatches): text examples or shard tables; None when streamed (rows made as it is read)
    train_examples: datasets.Dataset | ShardTable | None
    eval_examples: datasets.Dataset | ShardTable
    engine: Engine  # what runs (engine.py): recorded in metrics.json and every checkpoint
    held_out: list[str]  # the held-out split's first documents as text, which the final zero-shot report scores
    corpus: Any  # inputs.Corpus: where the documents come from, which makes this process's training batches

    @property
    def output_dir(self) -> Path:
        return Path(self.args.output_dir)

    @property
    def objective(self) -> Objective:
        return self.args.spec


@dataclass
class _Training:
    """The model and optimizer in training, where the run is in its data, and what it has measured."""

    model: Any
    optimizer: Any
    scheduler: Any
    num_parameters: int
    data: Iterator[tuple[int, dict[str, torch.Tensor]]]
    eval_batches: list[dict[str, torch.Tensor]]
    step: int = 0
    consumed: int = 0  # global batches
    tokens_seen: int = 0
    history: dict[str, list[dict]] = field(default_factory=lambda: {"train": [], "eval": []})
    train_time: float = 0.0
    session_tokens: int = 0
