"""Fine-tuning on transformers' `Trainer`: every registered task (tasks/) over any coreformer folder, each with an
offline default dataset.

    FinetuningArguments                every run setting (a CLI flag per field, plus run_glue / run_qa style aliases;
                                       declared in the torch-free coreformer_settings.finetuning)
    resolve_arguments(...)             dataclass defaults < --config file (YAML / JSON) < flags given
    TASKS                              task name -> Task (tasks/__init__.py: one file per task)
    embedded_dataset(task)             the offline default of a task, built from the Python standard library's source
    load_task_data(args)               train / validation splits: embedded default | Hub dataset | local files
    run_finetuning(args) -> dict       prepare (checks, resume, data, labels, model + LoRA), train (the engine,
                                       evaluate before, Trainer, evaluate after), finish (save the folder)
    run_engine(trainer, args, ...)     what runs: Accelerate's engine, or FSDP2 by fully_shard on CPU processes
                                       (engine.py, as pretraining; trainer_checkpoints.shard_with)
    evaluate_folder(folder, args)      reload a saved folder with its Auto class and evaluate it on the same split

Metrics come from the shipped offline `evaluate` modules through `coreformer.evaluation`'s builders; the model is
evaluated once before training too (`before_eval_*` beside `eval_*`), so a run shows what training bought.

An output folder, as a run leaves it (the final files are written into a hidden sibling folder, renamed into place
at the end, so a crash never leaves a half-written `output_dir`; only the checkpoints are written into it during
the run, each atomically: trainer_checkpoints.py):

    output_dir/
      config.json, model.safetensors, modeling code, tokenizer files [, generation_config.json]
      README.md                          model card (coreformer.model_card, kind "fine-tuned")
      eval_results.json, train_results.json, all_results.json, trainer_state.json, run_config.json
      eval_predictions.jsonl             one line per validation example (tasks that predict rows)
      adapter/                           --peft lora only: the LoRA adapter (the folder itself holds the merged model)
      checkpoints/step-N/                every --save-every steps and at the end, the last --save-total-limit kept:
                                         Trainer's checkpoint + fine_tuning_run.json (--resume-from-checkpoint latest)

QA and seq2seq folders carry coreformer's custom pipeline (`save_with_pipeline`), so
`pipeline(model=output_dir, trust_remote_code=True)` works where transformers 5 has no QA / text2text pipeline.
"""

import dataclasses
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import transformers
from transformers import AutoConfig, PreTrainedTokenizerBase

# the settings' torch-free declarations (beside the package, so that training/finetune.py --help imports no torch)
from coreformer_settings.finetuning import PEFT_CHOICES, REPORT_TO, FinetuningSettings
from coreformer_settings.tasks import task_settings

from ..folders import MissingTokenizerError, folder_tokenizer, link_into, staged_folder
from ..model_card import ModelCardInfo, inherited_license, is_hub_id, write_model_card
from ..pipelines import input_length_limit, save_with_pipeline
from .arguments import FinetuningError, RunStoppedError, export_run, load_config_file, write_json
from .checkpoints import CHECKPOINTS_DIR, check_unchanged, stopped_message
from .data import local_builder
from .engine import CpuFsdp2Engine, Engine, requested_engine, resolve_engine
from .families import family_of, longest_input
from .tasks import TASKS, Evaluation, Task
from .trainer_checkpoints import CHECKPOINTING_TRAINERS, resolve_resume, run_settings

RUN_CONFIG = "run_config.json"
PREDICTIONS = "eval_predictions.jsonl"
ADAPTER_DIR = "adapter"
# What a run leaves in its output folder: a folder holding any of these is a previous run (--overwrite replaces it).
_RUN_MARKERS = ("config.json", RUN_CONFIG, "all_results.json", ADAPTER_DIR, CHECKPOINTS_DIR)

__all__ = ["TASKS", "FinetuningArguments", "FinetuningError", "embedded_dataset", "evaluate_folder", "run_finetuning"]


# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------


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
        optional = ("max_steps", "max_train_examples", "max_eval_examples", "generation_max_length")
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


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------


def embedded_dataset(task: str) -> datasets.DatasetDict:
    """The task's offline default (its `embedded_description`), train / validation, with the task's default column
    names (`Task.columns`). Built from the running interpreter's standard library, the same on every run of one
    installation (not across Python versions). A few hundred examples, built in about half a second.
    """
    if task not in TASKS:
        raise FinetuningError(f"Unknown task {task!r}: --task must be one of {', '.join(TASKS)}.")
    return TASKS[task].embedded_data()


def _local_files(path: str, *, must_be_local: bool) -> tuple[str | None, list[str] | None]:
    """(builder, files) of a local data file, (None, None) for a Hub name (data.local_builder)."""
    try:
        builder, files = local_builder(path)
    except ValueError as error:
        raise FinetuningError(str(error)) from None
    if builder is None and must_be_local:
        raise FinetuningError(f"Data file {path!r} does not exist.")
    return builder, files


def load_task_data(args: FinetuningArguments) -> tuple[datasets.DatasetDict, str]:
    """(train / validation splits with the columns the task needs, a description of the data for the card).

    No source given: the embedded default, its columns renamed to what the arguments name. Otherwise a Hub dataset
    or local files; a missing validation split is `validation_fraction` of the training split (seeded).
    """
    if args.dataset is None and args.train_file is None:
        splits = embedded_dataset(args.task)
        renames = {column: args.setting(argument) for argument, column in args.spec.columns.items() if column}
        splits = splits.rename_columns({old: new for old, new in renames.items() if old != new})
        description = f"coreformer's embedded {args.task} default: {args.spec.embedded_description}"
    else:
        try:
            local = {"train": args.train_file or args.dataset}
            if args.validation_file is not None:
                local["validation"] = args.validation_file
            must_be_local = args.train_file is not None
            found = {split: _local_files(path, must_be_local=must_be_local) for split, path in local.items()}
            if all(builder is not None for builder, _ in found.values()):
                builders = {builder for builder, _ in found.values()}
                if len(builders) > 1:
                    raise FinetuningError("--train-file and --validation-file must be the same kind of file.")
                files = {split: paths for split, (_, paths) in found.items()}
                loaded = datasets.load_dataset(builders.pop(), data_files=files)
                description = ", ".join(f"{split} `{Path(path).name}`" for split, path in local.items())
            else:
                loaded = datasets.load_dataset(args.dataset, args.dataset_config)
                description = f"`{args.dataset}`" + (f" ({args.dataset_config})" if args.dataset_config else "")
        except FinetuningError:
            raise
        except Exception as error:  # DatasetNotFoundError, ConnectionError offline, parse errors of a file, ...
            raise FinetuningError(
                f"Cannot load the data ({args.dataset or args.train_file!r}): {type(error).__name__}: {error}. Pass a "
                f"datasets Hub name, a local .csv/.json/.jsonl/.parquet file, or neither for the embedded default."
            ) from error
        if "train" not in loaded:
            raise FinetuningError(f"The data has no 'train' split; it has {sorted(loaded)}.")
        if "validation" not in loaded:
            held_out = loaded["train"].train_test_split(test_size=args.validation_fraction, seed=args.seed)
            loaded = datasets.DatasetDict({"train": held_out["train"], "validation": held_out["test"]})
        splits = datasets.DatasetDict({"train": loaded["train"], "validation": loaded["validation"]})
    check_columns(splits, args)
    if args.max_train_examples is not None:
        splits["train"] = splits["train"].select(range(min(args.max_train_examples, len(splits["train"]))))
    if args.max_eval_examples is not None:
        splits["validation"] = splits["validation"].select(
            range(min(args.max_eval_examples, len(splits["validation"])))
        )
    for name, split in splits.items():
        if len(split) == 0:
            raise FinetuningError(f"The {name} split is empty.")
    return splits, description


def check_columns(splits: datasets.DatasetDict, args: FinetuningArguments) -> None:
    """Every column the task reads is in both splits, or one error naming all that are missing (each with what it
    holds and its flag) and the columns there are."""
    wanted = []
    for argument in args.spec.columns:
        column, what = args.setting(argument), args.setting_field(argument).metadata.get("column")
        if column is not None and what is not None:  # an optional column left unset, or one never required, is skipped
            wanted.append((column, "--" + argument.replace("_", "-"), what))
    for name, split in splits.items():
        missing = [entry for entry in wanted if entry[0] not in split.column_names]
        if missing:
            columns = ", ".join(f"{column!r} ({what})" for column, _, what in missing)
            flags = ", ".join(f"{flag} with the column that holds {what}" for _, flag, what in missing)
            raise FinetuningError(
                f"The {name} data has no column {columns} for {args.task}; its columns are {split.column_names}. "
                f"Pass {flags}."
            )


def read_label_names(splits: datasets.DatasetDict, column: str, *, per_token: bool) -> tuple[list[str], Callable]:
    """(label names, raw value -> name). ClassLabel names as they are; otherwise the sorted distinct values of both
    splits (strings, or integers shown as strings). `per_token`: the column holds one label per word."""
    feature = splits["train"].features[column]
    if per_token:
        feature = getattr(feature, "feature", None)
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names), lambda value: feature.names[value]
    values = set()
    for split in splits.values():
        for value in split[column]:
            values.update(value if per_token else [value])
    if None in values:
        raise FinetuningError(f"Column {column!r} has empty labels; every example needs one.")
    if any(isinstance(value, float) and not value.is_integer() for value in values):
        raise FinetuningError(
            f"Column {column!r} holds non-integer numbers: regression is not supported; labels must be classes."
        )
    if all(isinstance(value, int | float) for value in values):
        names = [str(int(value)) for value in sorted(values)]
        return names, lambda value: str(int(value))
    return sorted(str(value) for value in values), str


# ---------------------------------------------------------------------------------------------------------------------
# Model, tokenizer, labels
# ---------------------------------------------------------------------------------------------------------------------


def load_model_config(path: str, task: str):
    """The config of a coreformer folder, checked to be a family that has the task's head."""
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:
        raise FinetuningError(
            f"Cannot load --model {path!r}: {type(error).__name__}: {error}. Pass a coreformer folder (from "
            f"`coreformer pretrain`, `coreformer finetune`, or `coreformer convert`)."
        ) from error
    family = family_of(config)
    if family is None:
        raise FinetuningError(
            f"--model {path!r} is a {config.model_type!r} checkpoint, not a coreformer one; convert it first with "
            f"`coreformer convert {path} OUT`."
        )
    spec = TASKS[task]
    if family not in spec.families:
        raise FinetuningError(
            f"--task {task} needs a {' or '.join(spec.families)} model; {path!r} is a coreformer {family}."
        )
    return config, family


def load_finetuning_tokenizer(args: FinetuningArguments, model_path: str) -> PreTrainedTokenizerBase:
    source = args.tokenizer or model_path
    try:
        tokenizer = folder_tokenizer(source)
    except MissingTokenizerError as error:
        raise FinetuningError(f"{error} (--tokenizer FOLDER names another tokenizer.)") from None
    except Exception as error:
        raise FinetuningError(
            f"Cannot load a tokenizer from {source!r}: {type(error).__name__}: {error}. Pass --tokenizer FOLDER."
        ) from error
    if tokenizer.pad_token is None and args.spec.pads_batches:
        if tokenizer.eos_token is None:
            raise FinetuningError(f"The tokenizer of {source!r} has no pad or eos token to pad batches with.")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_labels(args: FinetuningArguments, config, names: list[str]) -> list[str]:
    """The label order the fine-tuned head uses; refuses a checkpoint head of another size.

    A checkpoint that already has this task's head with the same label names keeps its order (so a second
    fine-tuning does not shuffle the ids); otherwise the data's order.
    """
    has_head = any(name.endswith(args.spec.head_suffix) for name in config.architectures or [])
    if not has_head:
        return names
    existing = [config.id2label[index] for index in sorted(config.id2label)]
    if len(existing) != len(names):
        if args.ignore_mismatched_sizes:
            return names
        raise FinetuningError(
            f"--model {args.model!r} has a {config.architectures[0]} head for {len(existing)} labels ({existing}), but "
            f"the data has {len(names)} labels ({names}). Pass --ignore-mismatched-sizes to re-initialise the head "
            f"for {len(names)} labels, or fine-tune from the checkpoint without this head."
        )
    return existing if sorted(existing) == sorted(names) else names


def _attach_lora(model, args: FinetuningArguments):
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=getattr(TaskType, args.spec.peft_task_type),
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_modules,
    )
    try:
        with warnings.catch_warnings():  # PEFT reads transformers' deprecated alias; a FutureWarning on every run
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as error:  # target modules that do not exist
        raise FinetuningError(f"--lora-target-modules {args.lora_target_modules!r}: {error}") from error


# ---------------------------------------------------------------------------------------------------------------------
# Trainer wiring
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Prepared:
    """A task's data in model form, with the collator and metrics that go with it."""

    train: datasets.Dataset | None
    evaluation: Evaluation
    collator: Any
    compute_metrics: Callable
    preprocess_logits_for_metrics: Callable | None
    label_names: list[str] | None

    @property
    def eval(self) -> datasets.Dataset:
        return self.evaluation.features


def _max_length(args: FinetuningArguments, model, tokenizer: PreTrainedTokenizerBase) -> int:
    """--max-length capped by the tokenizer and by the model's learned / sinusoidal positions."""
    limits = (args.max_length, input_length_limit(model, tokenizer), longest_input(model.config))
    return min(limit for limit in limits if limit is not None)


def prepare_task(
    args: FinetuningArguments,
    splits: datasets.DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    model,
    label_names: list[str] | None,
    label_of: Callable | None,
    *,
    with_train: bool = True,
) -> _Prepared:
    """Features of both splits, the collator, and compute_metrics of `args.task`."""
    task, max_length = args.spec, _max_length(args, model, tokenizer)
    label2id = {name: index for index, name in enumerate(label_names or [])}

    def to_id(value) -> int:
        name = label_of(value)
        if name not in label2id:
            raise FinetuningError(f"Label {name!r} is not one of the model's labels {label_names}.")
        return label2id[name]

    if task.pads_right:
        tokenizer.padding_side = "right"
    features = {
        name: task.features(splits[name], tokenizer, args, max_length, to_id if label_names is not None else None)
        for name in (("train", "validation") if with_train else ("validation",))
    }
    for name, split in features.items():
        if len(split) == 0:
            raise FinetuningError(
                f"The {'training' if name == 'train' else name} split gives no {args.task} example of --max-length "
                f"{max_length} tokens; use more text or a smaller --max-length."
            )
    evaluation = Evaluation(examples=splits["validation"], features=features["validation"])
    compute_metrics, preprocess = task.metrics(args, evaluation, tokenizer, label_names)
    return _Prepared(
        features.get("train"), evaluation, task.collator(tokenizer), compute_metrics, preprocess, label_names
    )


def _training_arguments(args: FinetuningArguments, output_dir: Path, evaluate_first: bool):
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type=args.lr_scheduler_type,
        num_train_epochs=args.num_train_epochs,
        max_steps=args.max_steps if args.max_steps is not None else -1,
        bf16=args.bf16,
        torch_compile=args.compile,
        seed=args.seed,
        logging_steps=args.logging_steps,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        eval_on_start=evaluate_first,  # inside train(), after the model is wrapped for DDP (MetricsBeforeTraining)
        # Checkpoints: Trainer's, made atomic by trainer_checkpoints (the final folder is written by this module)
        save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or None,
        save_total_limit=args.save_total_limit,
        report_to=args.report_to,
        label_names=list(args.spec.label_names),
        dataloader_num_workers=0,
        dataloader_pin_memory=_has_accelerator(),
        disable_tqdm=False,
    )
    if args.spec.generates:
        return transformers.Seq2SeqTrainingArguments(
            **settings,
            predict_with_generate=True,
            generation_max_length=args.generation_max_length or args.max_target_length,
            generation_num_beams=args.num_beams,
        )
    return transformers.TrainingArguments(**settings)


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def build_trainer(
    args: FinetuningArguments,
    model,
    tokenizer,
    prepared: _Prepared,
    output_dir: Path,
    *,
    resume: Path | None = None,
    run_record: dict | None = None,
    evaluate_first: bool = False,
):
    """Trainer (Seq2SeqTrainer for seq2seq) over the prepared data; it writes only its checkpoints (into
    args.output_dir/checkpoints, atomically: trainer_checkpoints), the caller saves the rest."""
    trainer = CHECKPOINTING_TRAINERS[args.spec.generates](
        model=model,
        args=_training_arguments(args, output_dir, evaluate_first),
        train_dataset=prepared.train,
        eval_dataset=prepared.eval,
        processing_class=tokenizer,
        data_collator=prepared.collator,
        compute_metrics=prepared.compute_metrics,
        preprocess_logits_for_metrics=prepared.preprocess_logits_for_metrics,
    )
    trainer.checkpoint_root = Path(args.output_dir).expanduser().resolve() / CHECKPOINTS_DIR
    trainer.fresh_start, trainer.run_record = resume is None, run_record or {}
    return trainer


def _predict(trainer, args: FinetuningArguments, prepared: _Prepared, tokenizer) -> tuple[dict[str, float], list]:
    output = trainer.predict(prepared.eval, metric_key_prefix="eval")
    metrics = args.spec.final_metrics({key: float(value) for key, value in output.metrics.items()})
    metrics["eval_samples"] = len(prepared.evaluation.examples)
    rows = args.spec.prediction_rows(output, args, prepared.evaluation, tokenizer, prepared.label_names)
    return metrics, with_examples(rows, args, prepared.evaluation.examples)


def _readable(examples: datasets.Dataset, column: str) -> list:
    """A column's values, class ids as their names (ClassLabel, or a sequence of ClassLabel)."""
    feature, values = examples.features[column], examples[column]
    if isinstance(feature, datasets.ClassLabel):
        return [feature.int2str(value) for value in values]
    inner = getattr(feature, "feature", None)
    if isinstance(inner, datasets.ClassLabel):
        return [[inner.int2str(value) for value in row] for row in values]
    return list(values)


def with_examples(rows: list[dict], args: FinetuningArguments, examples: datasets.Dataset) -> list[dict]:
    """Prediction rows with the input and the gold answer of their validation example (the task's `shown` columns)
    before the prediction. Rows with an "id" (question answering: one per question) find their example by id."""
    if not rows:
        return rows
    columns = {key: args.setting(name) for key, name in args.spec.shown if args.setting(name)}
    values = {key: _readable(examples, column) for key, column in columns.items() if column in examples.column_names}
    if "id" in rows[0]:
        id_column = args.setting("id_column")  # rows with an id: the task that gives them has an id column
        ids = examples[id_column] if id_column in examples.column_names else range(len(examples))
        first = {}
        for index, qid in enumerate(ids):
            first.setdefault(str(qid), index)
        positions = [first[row["id"]] for row in rows]
    else:
        positions = range(len(rows))
        if len(rows) != len(examples):
            raise ValueError(f"{len(rows)} prediction rows for {len(examples)} validation examples")
    return [
        {**({"id": row["id"]} if "id" in row else {}), **{key: value[i] for key, value in values.items()}, **row}
        for i, row in zip(positions, rows)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------------------------


def _card_info(args: FinetuningArguments, family: str, num_parameters: int, metrics: dict, data: str, adapter: bool):
    """What a fine-tuned folder's (or its adapter's) card says: the task, the data, the settings, the eval numbers."""
    hub_dataset = args.dataset if args.dataset and is_hub_id(args.dataset) else None
    # A fine-tuned model is a derivative of its base: it carries the base's license, "other" when none is recorded.
    base_license = inherited_license(args.model) if Path(args.model).is_dir() else None
    limitations = "A small model fine-tuned briefly; the evaluation numbers above are its only measurement."
    if base_license is None:
        limitations += (
            f" The base model's license is not recorded here (`license: other`): the terms of {args.model} apply."
        )
    eval_results = {
        key.removeprefix("eval_"): value
        for key, value in metrics.items()
        if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second", "_time", "_samples"))
    }
    hyperparameters = [
        ("task", args.task),
        ("base model", args.model),
        ("steps", int(metrics.get("train_steps", 0))),
        ("epochs", round(float(metrics.get("epoch", 0.0)), 3)),
        ("batch size x accumulation", f"{args.batch_size} x {args.grad_accum}"),
        ("learning rate", f"{args.lr:g}, {args.lr_scheduler_type} schedule, {args.warmup_steps} warmup steps"),
        ("weight decay", args.weight_decay),
        ("max length", args.max_length),
        ("bf16", args.bf16),
        ("seed", args.seed),
    ]
    if args.peft == "lora":
        hyperparameters.append(
            (
                "LoRA",
                f"r {args.lora_r}, alpha {args.lora_alpha}, dropout {args.lora_dropout}, on {args.lora_target_modules}",
            )
        )
    what = "A LoRA adapter" if adapter else "A coreformer " + family + " model"
    summary = f"{what} fine-tuned for {args.task} with `coreformer finetune` (transformers Trainer)"
    if args.peft == "lora" and not adapter:
        summary += "; LoRA adapters merged into the weights (the adapter alone is in `adapter/`)"
    return ModelCardInfo(
        kind="fine-tuned",
        title=f"coreformer {family} fine-tuned for {args.task}" + (" (LoRA adapter)" if adapter else ""),
        family=family,
        auto_class=args.spec.auto_class,
        summary=summary + ".",
        num_parameters=num_parameters,
        base_model=args.model,
        datasets=[hub_dataset] if hub_dataset else [],
        dataset_description=data,
        pipeline_tag=args.spec.pipeline_tag,
        task_type=args.spec.card_task_type,
        task_name=args.spec.card_task_name,
        eval_results=eval_results,
        eval_dataset=_eval_dataset_name(args),
        hyperparameters=hyperparameters,
        usage=args.spec.usage,
        intended_use=f"{args.task} on text like the fine-tuning data; a starting point for experiments.",
        limitations=limitations,
        tags=[args.task] + (["lora", "peft"] if args.peft == "lora" else []),
        license=base_license or "other",
    )


def _eval_dataset_name(args: FinetuningArguments) -> str:
    """What the model-index names the evaluation data: the Hub id, the validation file, or the embedded default."""
    if args.dataset is not None:
        return args.dataset if is_hub_id(args.dataset) else Path(args.dataset).name + " (held-out share)"
    if args.validation_file is not None:
        return Path(args.validation_file).name
    if args.train_file is not None:
        return Path(args.train_file).name + " (held-out share)"
    return f"coreformer embedded {args.task} data (validation split)"


# ---------------------------------------------------------------------------------------------------------------------
# The run: prepare, train, finish
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What `prepare` hands to training and to the save: everything checked, nothing written."""

    args: FinetuningArguments
    family: str
    tokenizer: PreTrainedTokenizerBase
    model: Any
    prepared: _Prepared
    data_description: str
    num_parameters: int
    world_size: int
    resume: Path | None  # the checkpoint to continue from (--resume-from-checkpoint), None for a fresh start
    resume_record: dict[str, Any] | None  # the checkpoint's RUN_RECORD (its metrics before training, its engine)


def _labels_for(args: FinetuningArguments, splits: datasets.DatasetDict, config) -> tuple[list[str] | None, Callable]:
    if args.spec.labels is None:
        return None, None
    names, label_of = read_label_names(splits, args.label_column, per_token=args.spec.labels == "word")
    return resolve_labels(args, config, names), label_of


class _NoLoadReport(logging.Filter):
    """Drops transformers' LOAD REPORT table (a row per tensor); load_with_head says the same in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def _modules(keys: list) -> str:
    """lm_head.dense.weight, lm_head.dense.bias -> lm_head.dense (mismatched keys come as (key, shapes...))."""
    names = [key[0] if isinstance(key, tuple) else key for key in keys]
    return ", ".join(sorted({name.rsplit(".", 1)[0] for name in names}))  # transformers gives them as a set


def load_with_head(auto_class, path: str, **kwargs):
    """`auto_class.from_pretrained(path)` with transformers' load report replaced by one line: the modules newly
    initialised (the task's head), re-initialised for a new size, and left unused (the pretraining head)."""
    source = logging.getLogger("transformers.modeling_utils")
    quiet = _NoLoadReport()
    source.addFilter(quiet)
    try:
        model, info = auto_class.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        source.removeFilter(quiet)
    parts = [
        f"{what}: {_modules(info[key])}"
        for key, what in (
            ("missing_keys", "newly initialised"),
            ("mismatched_keys", "re-initialised for the new size"),
            ("unexpected_keys", "not used from the checkpoint"),
        )
        if info[key]
    ]
    if parts:
        print(f"loaded {path} into {type(model).__name__}; {'; '.join(parts)}")
    return model


def prepare(args: FinetuningArguments, world_size: int = 1) -> _Run:
    """Every check (output folder, resume checkpoint, model, task / family, data, columns, labels) and the model with
    its new head."""
    resume, record = resolve_resume(args, world_size, _RUN_MARKERS, RUN_CONFIG)
    config, family = load_model_config(args.model, args.task)
    tokenizer = load_finetuning_tokenizer(args, args.model)
    splits, data_description = load_task_data(args)
    label_names, label_of = _labels_for(args, splits, config)

    transformers.set_seed(args.seed)  # the new head's initialisation
    head_kwargs = {}
    if label_names is not None:
        head_kwargs = dict(
            num_labels=len(label_names),
            id2label=dict(enumerate(label_names)),
            label2id={name: index for index, name in enumerate(label_names)},
            ignore_mismatched_sizes=args.ignore_mismatched_sizes,
        )
    model = load_with_head(getattr(transformers, args.spec.auto_class), args.model, **head_kwargs)
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id  # a decoder classifier finds the last token by padding
    prepared = prepare_task(args, splits, tokenizer, model, label_names, label_of)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    if args.peft == "lora":
        model = _attach_lora(model, args)
    return _Run(args, family, tokenizer, model, prepared, data_description, num_parameters, world_size, resume, record)


BEFORE = "before_"  # the prefix of the metrics of the model before training: before_eval_accuracy, ...
_NOT_METRICS = ("_runtime", "_per_second", "_time", "_samples")


class MetricsBeforeTraining(transformers.TrainerCallback):
    """Keeps the metrics of Trainer's evaluation before the first step (`eval_on_start`) as `before_eval_*`, prints
    them in one line, and puts them in the run record every checkpoint carries (a resumed run reports them too).

    Trainer's own `eval_on_start`, not an evaluate() call before train(): under DDP that call prepares the model
    for evaluation, and Accelerate then never wraps the already-"prepared" model in DistributedDataParallel, so each
    process would train alone (checked with 2 gloo processes: no gradient all-reduce, different weights per rank).

    The evaluation leaves training as it would be without it: every DataLoader iterator draws its base seed from
    the global torch RNG, so the random states are taken when training begins and put back after the evaluation
    (the same per-step losses as a run without it, checked against the code before this evaluation existed)."""

    def __init__(self, task: Task, record: dict, announce: bool) -> None:
        self.task, self.record, self.announce = task, record, announce
        self.random_states = None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if "before" not in self.record:
            self.random_states = _random_states()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs) -> None:
        if state.global_step != 0 or "before" in self.record:
            return
        _set_random_states(self.random_states)
        values = self.task.final_metrics({k: float(v) for k, v in metrics.items() if k.startswith("eval_")})
        self.record["before"] = {BEFORE + key: value for key, value in values.items() if not key.endswith(_NOT_METRICS)}
        if self.announce:
            print(f"before training: {_shown(self.record['before'])}")


def _random_states() -> tuple:
    """Python's, NumPy's, torch's CPU and (where there is one) accelerator RNG states of this process."""
    import random

    import numpy as np
    import torch

    devices = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), devices


def _set_random_states(states: tuple) -> None:
    import random

    import numpy as np
    import torch

    python, numpy, cpu, devices = states
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if devices is not None:
        torch.cuda.set_rng_state_all(devices)


def _shown(metrics: dict[str, float]) -> str:
    return ", ".join(f"{key.removeprefix(BEFORE)} {value:.4g}" for key, value in metrics.items())


def run_engine(trainer, args: FinetuningArguments, resume_record: dict | None) -> Engine:
    """The engine that runs, decided as pretraining decides it (engine.py): what Accelerate set up under Trainer, or
    FSDP2 by `fully_shard` on CPU processes (an FSDP config that Accelerate 1.15 turns into DDP there), applied to
    the model here, before Trainer prepares it (trainer_checkpoints: `shard_with`). An engine asked for but not set
    up is refused with one FinetuningError, as is a checkpoint written in another engine's format. Printed in one
    line; recorded in train_results.json / all_results.json and every checkpoint."""
    engine = resolve_engine(
        trainer.accelerator, requested_engine(), "bf16" if args.bf16 else "no", error=FinetuningError
    )
    if resume_record is not None:
        check_unchanged(
            Path(args.resume_from_checkpoint),
            {"checkpoint format": resume_record.get("engine", {}).get("checkpoint_format", "accelerate")},
            {"checkpoint format": engine.checkpoint_format},
            what=f"another engine's checkpoint format (this run is {engine.distributed_type}, {engine.sharding})",
            fix="resume with the launcher config the run was started with",
            error=FinetuningError,
        )
    if isinstance(engine, CpuFsdp2Engine):
        if args.peft == "lora":
            raise FinetuningError(
                "--peft lora under FSDP2 on CPU processes is not supported (not built); launch with --multi_gpu for "
                "data parallelism, or drop --peft."
            )
        trainer.shard_with(engine)
    if trainer.is_world_process_zero():
        print(engine.line())
    return engine


def _stopped(run: _Run, trainer) -> str:
    """Ctrl-C's one line: the step reached and how to go on (from a checkpoint of this run, or from the start)."""
    step, output_dir = trainer.state.global_step, Path(run.args.output_dir)
    if trainer.saved_checkpoints or run.resume is not None:
        return stopped_message(output_dir, step, f"continue with --resume-from-checkpoint {run.resume}")
    why = "no checkpoints are kept (--save-every 0)" if not run.args.save_every else "before the first checkpoint"
    return f"stopped at step {step}, {why}; run the command again to start over ({output_dir} is as it was before)"


def train(run: _Run, staging: Path) -> tuple[Any, Engine, dict[str, float], dict[str, float], list[dict]]:
    """The engine, the evaluation before training, Trainer over the prepared data (from the resumed checkpoint, if
    any), then the evaluation of the trained model: (trainer, engine, train metrics, eval metrics with the `before_`
    ones, prediction rows)."""
    record = {"args": run_settings(run.args), "world_size": run.world_size}
    if run.resume_record is not None:  # resumed: the metrics before training come from the checkpoint
        record["before"] = run.resume_record["before"]
    trainer = build_trainer(
        run.args,
        run.model,
        run.tokenizer,
        run.prepared,
        staging,
        resume=run.resume,
        run_record=record,
        evaluate_first=run.resume is None,
    )
    engine = run_engine(trainer, run.args, run.resume_record)
    record["engine"] = engine.record()
    trainer.add_callback(MetricsBeforeTraining(run.args.spec, record, announce=trainer.is_world_process_zero()))
    try:
        train_output = trainer.train(resume_from_checkpoint=str(run.resume) if run.resume is not None else None)
    except KeyboardInterrupt:
        for callback in trainer.callback_handler.callbacks:  # end the progress bar's line before the message
            if isinstance(callback, transformers.ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.close()
        raise RunStoppedError(_stopped(run, trainer)) from None
    train_metrics = {key: float(value) for key, value in train_output.metrics.items()}
    train_metrics.update(train_steps=float(trainer.state.global_step), train_samples=float(len(run.prepared.train)))
    eval_metrics, rows = _predict(trainer, run.args, run.prepared, run.tokenizer)
    trainer.log(eval_metrics)
    return trainer, engine, train_metrics, {**eval_metrics, **record.get("before", {})}, rows


def trained_model(trainer, engine: Engine):
    """The trained model as the final folder saves it: Trainer's, or under FSDP2 on CPU processes an unsharded copy
    on the main process (None elsewhere) with the weights gathered from every rank's shards (a collective: every
    process calls it)."""
    if isinstance(engine, CpuFsdp2Engine):
        return engine.unsharded_copy(trainer.accelerator, trainer.model)
    return trainer.model


def finish(
    run: _Run, trainer, engine: Engine, trained, staging: Path, metrics: dict[str, dict[str, float]], rows: list[dict]
) -> None:
    """The model (merged, with its adapter beside it under LoRA), tokenizer, results (with the engine that ran),
    predictions and cards."""
    args, output_dir, everything = run.args, Path(run.args.output_dir), metrics["all"]
    adapter_parameters = sum(p.numel() for p in trained.parameters() if p.requires_grad)  # LoRA + copied heads
    if args.peft == "lora":
        trained.save_pretrained(staging / ADAPTER_DIR)
        run.tokenizer.save_pretrained(staging / ADAPTER_DIR)
        trained = trained.merge_and_unload()
    if args.spec.generates:  # the saved generation config generates as the evaluation did, not to transformers' 20
        trained.generation_config.max_length = args.generation_max_length or args.max_target_length
        trained.generation_config.num_beams = args.num_beams
    save_with_pipeline(trained, run.tokenizer, staging)
    for split, values in metrics.items():
        recorded = {**values, "engine": engine.record()}  # what ran, as in pretraining's metrics.json
        trainer.save_metrics(split, recorded, combined=split != "all")
    trainer.state.save_to_json(str(staging / "trainer_state.json"))
    checkpoints = Path(args.output_dir).expanduser().resolve() / CHECKPOINTS_DIR
    if checkpoints.is_dir() and (
        trainer.saved_checkpoints or (run.resume is not None and run.resume.parent.resolve() == checkpoints)
    ):
        link_into(checkpoints, staging / CHECKPOINTS_DIR)  # this run's checkpoints stay (hard links: nothing copied)
    write_json(staging / RUN_CONFIG, dataclasses.asdict(args))
    if rows:
        with open(staging / PREDICTIONS, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    info = _card_info(args, run.family, run.num_parameters, everything, run.data_description, False)
    write_model_card(staging, info, path_hint=str(output_dir))
    if args.peft == "lora":
        adapter_info = _card_info(args, run.family, adapter_parameters, everything, run.data_description, True)
        write_model_card(staging / ADAPTER_DIR, adapter_info, path_hint=str(output_dir / ADAPTER_DIR))
    export_run(args.export, staging)


def run_finetuning(args: FinetuningArguments) -> dict[str, Any]:
    """Fine-tune `args.model` on `args.task` and write the folder described in the module docstring.

    Every check runs before anything is written (`prepare`); the folder appears complete or not at all.

    Returns:
        The metrics also written to all_results.json (train_* and eval_* keys, as the example scripts write them).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    run = prepare(args, world_size)
    # Trainer writes into a hidden sibling that replaces output_dir in one step at the end (coreformer.folders):
    # a crash or a kill at any moment leaves the previous run intact.
    # Under torchrun / accelerate launch every process trains into one staged folder (named after the launcher);
    # the main process alone writes the results and swaps the folder in.
    multi_process = world_size > 1
    main_process = int(os.environ.get("RANK", "0")) == 0
    launcher_pid = os.getppid() if multi_process else None
    with staged_folder(Path(args.output_dir), main_process=main_process, launcher_pid=launcher_pid) as staging:
        trainer, engine, train_metrics, eval_metrics, rows = train(run, staging)
        everything = {**train_metrics, **eval_metrics, "epoch": float(trainer.state.epoch or 0.0)}
        trained = trained_model(trainer, engine)
        if trainer.is_world_process_zero():
            metrics = {"train": train_metrics, "eval": eval_metrics, "all": everything}
            finish(run, trainer, engine, trained, staging, metrics, rows)
        trainer.accelerator.wait_for_everyone()  # the main process swaps only when every process is done
    return everything


def evaluate_folder(folder: str | Path, args: FinetuningArguments) -> tuple[dict[str, float], list[dict]]:
    """Load a fine-tuned folder with the task's Auto class and its own tokenizer and labels, and evaluate it on the
    validation split `args` describes, exactly as `run_finetuning` does at the end of training.

    Returns:
        (eval metrics, prediction rows as in eval_predictions.jsonl). Nothing is written.
    """
    folder = str(folder)
    args = dataclasses.replace(args, model=folder, tokenizer=None, peft="none")
    config, _ = load_model_config(folder, args.task)
    tokenizer = load_finetuning_tokenizer(args, folder)
    splits, _ = load_task_data(args)
    label_names, label_of = None, None
    if args.spec.labels is not None:
        _, label_of = read_label_names(splits, args.label_column, per_token=args.spec.labels == "word")
        label_names = [config.id2label[index] for index in sorted(config.id2label)]
    model = getattr(transformers, args.spec.auto_class).from_pretrained(folder)
    prepared = prepare_task(args, splits, tokenizer, model, label_names, label_of, with_train=False)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = build_trainer(args, model, tokenizer, prepared, Path(scratch))
        return _predict(trainer, args, prepared, tokenizer)
