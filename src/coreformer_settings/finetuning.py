"""The settings of a fine-tuning run, importable without torch: what `training/finetune.py --help` shows.

    FinetuningSettings     every run setting (a CLI flag per field, plus run_glue / run_qa style aliases): the one
                           declaration of each; the task's own settings are declared by the task (tasks.py) and
                           gathered into `task_settings`
    add_settings_flags(parser)   a flag per run setting, then a group of flags per registered task

`coreformer.training.finetuning.FinetuningArguments` subclasses FinetuningSettings with the checks that need the task
registry, and its `resolve_arguments` reads a --config file and the flags into it.
"""

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import (
    CHECKPOINTS_DIR,
    RUN_CONFIG,
    FinetuningError,
    RunSettings,
    add_flags,
    arg,
    check_output_dir,
    export_arg,
    threads_arg,
)
from .components import add_owned_flags, gather_owned
from .tasks import TASK_REGISTRY, TaskSettings, task_fields

PEFT_CHOICES = ("none", "lora")
REPORT_TO = ("none", "tensorboard")
ADAPTER_DIR = "adapter"  # the LoRA adapter alone, in the run folder
# What a fine-tuning run writes into its folder: any of them there means the folder holds a run.
RUN_MARKERS = ("config.json", RUN_CONFIG, "all_results.json", ADAPTER_DIR, CHECKPOINTS_DIR)


def check_run_folder(output_dir: Path, overwrite: bool) -> None:
    """Refuse a folder that holds something, unless it is a previous run and `overwrite` is set."""
    check_output_dir(
        output_dir,
        overwrite,
        markers=RUN_MARKERS,
        error=FinetuningError,
        otherwise="--resume-from-checkpoint latest to continue it, or choose another folder",
    )


@dataclass
class FinetuningSettings(RunSettings):
    """Every setting of a fine-tuning run, declared once. The CLI exposes each field as `--field-name` (and
    `--field_name`), plus the `aliases` in its metadata: the names transformers' example scripts use
    (`--model_name_or_path`, ...). `coreformer.training.finetuning.FinetuningArguments` is this class with its checks.
    """

    error: typing.ClassVar[type[FinetuningError]] = FinetuningError

    task: str = arg("sequence-classification", f"what to fine-tune for: {', '.join(TASK_REGISTRY)}")
    model: str = arg(
        "",
        "a coreformer folder: pretrained (`coreformer pretrain`), fine-tuned, or converted (coreformer convert)",
        aliases=("--model_name_or_path", "--model-name-or-path"),
    )
    tokenizer: str | None = arg(
        None, "tokenizer folder or name; default: the one in --model", aliases=("--tokenizer_name",)
    )
    # data
    dataset: str | None = arg(
        None,
        "a datasets Hub name (downloaded only then) or a local .csv/.json/.jsonl/.parquet file; omit both this and "
        "--train-file for the task's embedded offline default (built from the Python standard library)",
        aliases=("--dataset_name",),
    )
    dataset_config: str | None = arg(None, "configuration of a Hub dataset", aliases=("--dataset_config_name",))
    train_file: str | None = arg(None, "local training file (.csv/.json/.jsonl/.parquet)")
    validation_file: str | None = arg(None, "local validation file; default: --validation-fraction of the training")
    validation_fraction: float = arg(0.1, "held-out share of the training data when there is no validation split")
    max_train_examples: int | None = arg(None, "use the first N training examples", aliases=("--max_train_samples",))
    max_eval_examples: int | None = arg(None, "use the first N validation examples", aliases=("--max_eval_samples",))
    # columns
    text_column: str = arg(
        "text",
        "text to classify / language-model / summarise (input side)",
        aliases=("--text_column_name",),
        column="the input text",
    )
    label_column: str | None = arg(
        None,
        "labels: sequence-classification 'label' (ClassLabel, strings or ints), token-classification 'ner_tags' "
        "(one tag per word; BIO names), multiple-choice 'label' (the index of the right choice)",
        aliases=("--label_column_name",),
        column="the labels",
    )
    # lengths
    max_length: int = arg(
        128,
        "input tokens per example (capped by the model): sequence length, QA window, causal-lm block, seq2seq source",
        aliases=("--max_seq_length", "--max_source_length", "--block_size"),
    )
    max_target_length: int = arg(64, "seq2seq: target tokens (also the default generation length)")
    generation_max_length: int | None = arg(None, "seq2seq: max new tokens at evaluation; default --max-target-length")
    num_beams: int = arg(1, "seq2seq: beams at evaluation")
    # optimisation
    num_train_epochs: float = arg(3.0, "epochs (ignored when --max-steps is set)")
    max_steps: int | None = arg(None, "optimizer steps; overrides --num-train-epochs")
    batch_size: int = arg(16, "training examples per device and step", aliases=("--per_device_train_batch_size",))
    eval_batch_size: int = arg(32, "evaluation examples per device", aliases=("--per_device_eval_batch_size",))
    grad_accum: int = arg(1, "micro-batches per optimizer step", aliases=("--gradient_accumulation_steps",))
    lr: float = arg(5e-5, "peak learning rate (AdamW)", aliases=("--learning_rate", "--learning-rate"))
    weight_decay: float = arg(0.0, "AdamW weight decay")
    warmup_steps: int = arg(0, "linear warmup steps")
    lr_scheduler_type: str = arg("linear", "transformers scheduler name (linear, cosine, constant, ...)")
    bf16: bool = arg(False, "bfloat16 mixed precision")
    padding_free: bool = arg(
        False,
        "lay each training batch's examples end to end in one row, without padding (token-classification: the same "
        "loss as padded batches; causal-lm: each document in a block attends only to itself); evaluation is unchanged",
    )
    compile: bool = arg(False, "torch.compile the model (the Trainer's torch_compile; saved weights keep their names)")
    threads: int | None = threads_arg()
    seed: int = arg(42, "seed of the head's initialisation, the data order and dropout")
    logging_steps: int = arg(10, "log the training loss every N steps")
    eval_steps: int = arg(0, "also evaluate every N steps (0: only at the end)")
    # model
    ignore_mismatched_sizes: bool = arg(
        False, "re-initialise a classification head whose label count differs from the data's"
    )
    peft: str = arg("none", "parameter-efficient fine-tuning: none or lora", choices=PEFT_CHOICES)
    lora_r: int = arg(8, "LoRA rank")
    lora_alpha: int = arg(16, "LoRA alpha (scale alpha / r)")
    lora_dropout: float = arg(0.05, "dropout on the LoRA branch")
    lora_target_modules: str = arg("q_proj,v_proj", "comma-separated module names that get adapters")
    # run
    output_dir: str = arg("outputs/finetune", "run folder: the fine-tuned model, its card, metrics, predictions")
    overwrite: bool = arg(
        False, "replace an output directory that holds another run", aliases=("--overwrite_output_dir",)
    )
    report_to: str = arg("none", "tracker: none or tensorboard (logs under output_dir/runs)", choices=REPORT_TO)
    export: str | None = export_arg()
    save_every: int = arg(
        500,
        "save a checkpoint (model, optimizer, schedule, RNG, data position) every N optimizer steps into "
        "output_dir/checkpoints/step-N (0: none)",
        aliases=("--save_steps",),
    )
    save_total_limit: int = arg(2, "keep the last K checkpoints")
    resume_from_checkpoint: str | None = arg(
        None,
        "'latest' (newest checkpoint in --output-dir; starts fresh when there is none) or a checkpoints/step-N folder",
    )
    task_settings: dict | TaskSettings = arg(
        {}, "the task's own settings (flags and config keys of their own: coreformer_settings.tasks)", cli=False
    )

    @classmethod
    def setting_names(cls) -> list[str]:
        """The run's settings and every registered task's, as flags and config keys name them."""
        return [*super().setting_names(), *task_fields()]

    @classmethod
    def resolve(cls, values: dict[str, Any], *, source: str | None = None) -> "FinetuningSettings":
        """As RunSettings.resolve, the tasks' settings (flat keys, or a `task_settings` mapping as run_config.json
        holds them) gathered into `task_settings`, which the run's task types and checks."""
        return super().resolve(gather_owned(values, TASK_REGISTRY, "task_settings", run=cls), source=source)

    def setting(self, name: str) -> Any:
        """The value of a run setting or of the task's own, by name (a column a task names as a setting)."""
        if name in self.task_settings_fields():
            return getattr(self.task_settings, name)
        return getattr(self, name)

    def setting_field(self, name: str) -> dataclasses.Field:
        """The declaration of a run setting or of the task's own, by name."""
        fields = {spec.name: spec for spec in dataclasses.fields(self)}
        return self.task_settings_fields().get(name) or fields[name]

    def task_settings_fields(self) -> dict[str, dataclasses.Field]:
        return {spec.name: spec for spec in dataclasses.fields(self.task_settings)}


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """`--field-name` and `--field_name` (and the example scripts' aliases) for every FinetuningSettings field, then,
    under a heading per registered task, the flags of the settings it owns."""
    add_flags(parser, FinetuningSettings, FinetuningSettings.cli_fields(), underscore_names=True)
    add_owned_flags(parser, TASK_REGISTRY, kind="task", underscore_names=True)
