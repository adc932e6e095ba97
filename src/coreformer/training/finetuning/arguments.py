"""A fine-tuning run's arguments, shared by the driver (__init__.py) and its steps (data.py,
trainer.py, card.py), which all import them from here and never from the driver.

    FinetuningArguments      FinetuningSettings with the checks that need the task registry
    resolve_arguments(...)   gathered settings -> typed, checked FinetuningArguments
"""

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the settings' torch-free declarations (beside the package, so that training/finetune.py --help imports no torch)
from coreformer_settings.finetuning import PEFT_CHOICES, REPORT_TO, FinetuningSettings
from coreformer_settings.tasks import task_settings

from ..arguments import FinetuningError, load_config_file
from ..tasks import TASKS, Task


@dataclass
class FinetuningArguments(FinetuningSettings):
    """Every setting of a fine-tuning run (declared in coreformer_settings.finetuning, so that --help needs no torch),
    checked here against the task registry; the task's own settings are typed and checked by its settings class
    (coreformer_settings.tasks)."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise FinetuningError(f"Unknown task {self.task!r}: --task must be one of {', '.join(TASKS)}.")
        self.task_settings = task_settings(self.task, self.task_settings)  # checked there
        self.check_choices(peft=PEFT_CHOICES, report_to=REPORT_TO)
        if not self.model:
            raise FinetuningError("Pass --model: a coreformer folder (pretrained, fine-tuned or converted).")
        positive = ("max_length", "max_target_length", "num_beams", "batch_size")
        self.check_at_least(1, positive + ("eval_batch_size", "grad_accum", "logging_steps", "lora_r", "lora_alpha"))
        self.check_at_least(1, ("save_total_limit",))
        optional = ("max_steps", "max_train_examples", "max_eval_examples", "generation_max_length", "threads")
        self.check_at_least(1, optional, unset_ok=True, note=" (or unset)")
        self.check_at_least(0, ("warmup_steps", "eval_steps", "save_every"))
        if self.max_steps is None and self.num_train_epochs <= 0:
            raise FinetuningError(f"`num_train_epochs` must be > 0, got {self.num_train_epochs}.")
        if self.lr <= 0:
            raise FinetuningError(f"`lr` must be > 0, got {self.lr}.")
        if not 0.0 < self.validation_fraction < 1.0:
            raise FinetuningError(f"`validation_fraction` must be in (0, 1), got {self.validation_fraction}.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise FinetuningError(f"`lora_dropout` must be in [0, 1), got {self.lora_dropout}.")
        if not self.target_modules:
            raise FinetuningError("`lora_target_modules` names no module; the default is q_proj,v_proj.")
        if self.dataset is not None and self.train_file is not None:
            raise FinetuningError("Pass either --dataset (Hub name or file) or --train-file, not both.")
        if self.validation_file is not None and self.train_file is None:
            raise FinetuningError("--validation-file needs --train-file.")
        if self.padding_free and self.spec.padding_free_refusal is not None:
            raise FinetuningError(f"--padding-free: {self.task} {self.spec.padding_free_refusal}.")
        if self.label_column is None:
            self.label_column = self.spec.default_label_column or "label"

    @property
    def target_modules(self) -> list[str]:
        return [name.strip() for name in self.lora_target_modules.split(",") if name.strip()]

    @property
    def spec(self) -> Task:
        return TASKS[self.task]


def resolve_arguments(
    *, config_file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> FinetuningArguments:
    """Dataclass defaults, then a YAML / JSON `--config` file of FinetuningArguments keys, then `overrides`."""
    values = load_config_file(config_file, error=FinetuningError) if config_file is not None else {}
    return FinetuningArguments.resolve({**values, **(overrides or {})})
