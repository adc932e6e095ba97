"""Fine-tuning's data and labels: where the examples come from, the columns the task reads, the label names, and
the base model's config and tokenizer (the driver's `prepare` calls these before anything is written).

    embedded_dataset(task)             the offline default of a task, built from the Python standard library's source
    load_task_data(args)               train / validation splits: embedded default | Hub dataset | local files
    check_columns(splits, args)        every column the task reads is there, or one error naming the flags
    read_label_names / resolve_labels  the label names of the data; the order the fine-tuned head uses
    labels_for(args, splits, config)   both, for a task with labels: (label order, raw value -> name)
    load_model_config / load_finetuning_tokenizer    the base folder's config (checked for the task's head) and
                                                     tokenizer (given a pad token where batches are padded)

Each raises one FinetuningError naming the problem and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import datasets
from transformers import AutoConfig, PreTrainedTokenizerBase

from coreformer_settings.data_sources import local_data

from ...hub.folders import MissingTokenizerError, folder_tokenizer
from ..arguments import FinetuningError
from ..families import family_of
from ..tasks import TASKS
from .arguments import FinetuningArguments

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
    """(builder, files) of a local data file, (None, None) for a Hub name (coreformer_settings.data_sources)."""
    return local_data(path, must_be_local=must_be_local, error=FinetuningError)


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
# Model config, tokenizer, labels
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


def labels_for(args: FinetuningArguments, splits: datasets.DatasetDict, config) -> tuple[list[str] | None, Callable]:
    if args.spec.labels is None:
        return None, None
    names, label_of = read_label_names(splits, args.label_column, per_token=args.spec.labels == "word")
    return resolve_labels(args, config, names), label_of
