"""Pretraining's inputs, checked before the run's first write (pretraining.py's `prepare` calls these).

    load_tokenizer / load_dataset_splits     a tokenizer or the text splits, their errors as one PretrainingError
    build_collator / build_model_config      the objective's collator; the family config, checked against
                                             --block-size and --packing (check_packing)
    input_token_count(batch, pad_token_id)   the real input tokens of a batch (throughput, MFU, token means)
    check_output_dir / resolve_resume        the output folder and the checkpoint to resume from, refused when they
                                             belong to another run
    check_world_size / check_checkpoint_engine    a launch that forms one run; a checkpoint the engine can read
    tracker_choice / tracker_hparams         the tracker (--report-to) and the settings it records
    shared_tokenizer                         a tokenizer trained once on the main process and handed to the others
    RUN_CONFIG, METRICS                      the names of the run's records in its output folder

Each raises one PretrainingError naming the problem and the fix; nothing here writes to the output folder.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import typing
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..hub.folders import MissingTokenizerError, folder_tokenizer
from ..layer_types import LAYER_TYPES
from . import arguments
from .arguments import PretrainingError
from .checkpoints import CHECKPOINTS_DIR, requested_checkpoint
from .data import load_text_dataset
from .engine import Engine
from .families import TRAINING_FACTS, longest_input
from .objectives import Objective
from .pretraining_run import PretrainingArguments
from .tokenizer_training import token_config_kwargs

RUN_CONFIG = "run_config.json"
METRICS = "metrics.json"
# What a run leaves in its output directory: a folder holding any of these is a previous run (--overwrite replaces it).
_RUN_MARKERS = (RUN_CONFIG, CHECKPOINTS_DIR, "config.json", "model.safetensors", "tokenizer.json", METRICS)


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer, data, model config
# ---------------------------------------------------------------------------------------------------------------------


def load_tokenizer(name_or_path: str, objective: Objective) -> PreTrainedTokenizerBase:
    """A tokenizer folder or Hub name, checked for the special tokens the objective needs."""
    try:
        tokenizer = folder_tokenizer(name_or_path)
    except MissingTokenizerError as error:
        raise PretrainingError(f"--tokenizer: {error} Or omit --tokenizer to train one.") from None
    except Exception as error:  # OSError for an unknown Hub name, ValueError for broken files
        raise PretrainingError(f"Cannot load tokenizer {name_or_path!r}: {error}") from error
    missing = [name for name in objective.required_tokens if getattr(tokenizer, name) is None]
    if missing:
        raise PretrainingError(
            f"Tokenizer {name_or_path!r} has no {', '.join(missing)}, which the {objective.name} objective needs; "
            f"omit --tokenizer to train one."
        )
    return tokenizer


def load_dataset_splits(args: PretrainingArguments) -> datasets.DatasetDict:
    """`load_text_dataset` with its errors (and the Hub's) turned into one PretrainingError."""
    try:
        return load_text_dataset(
            args.dataset,
            args.text_column,
            seed=args.seed,
            validation_fraction=args.validation_fraction,
            max_documents=args.max_documents,
            config_name=args.dataset_config,
        )
    except ValueError as error:
        raise PretrainingError(str(error)) from error
    except Exception as error:  # DatasetNotFoundError, ConnectionError offline, FileNotFoundError, ...
        raise PretrainingError(
            f"Cannot load dataset {args.dataset!r}: {type(error).__name__}: {error}. Pass a local file "
            f"(.txt/.json/.jsonl/.csv/.parquet), a datasets Hub name, or omit --dataset for the embedded corpus."
        ) from error


def build_collator(tokenizer: PreTrainedTokenizerBase, args: PretrainingArguments) -> Any:
    return args.spec.collator(tokenizer, args)


def build_model_config(args: PretrainingArguments, tokenizer: PreTrainedTokenizerBase):
    """The family config: token ids from the tokenizer, vocab padded to `pad_vocab_to_multiple_of`, then `model`."""
    fields = token_config_kwargs(tokenizer, args.family)
    multiple = args.pad_vocab_to_multiple_of
    fields["vocab_size"] = math.ceil(len(tokenizer) / multiple) * multiple
    fields.update(args.model)
    try:
        config = TRAINING_FACTS[args.family].config_class(**fields)
    except ValueError as error:
        raise PretrainingError(f"Bad model config: {error}") from error
    longest = longest_input(config)
    if longest is not None and args.block_size > longest:
        needed = args.block_size + config.position_offset
        raise PretrainingError(
            f"--block-size {args.block_size} needs max_position_embeddings >= {needed} with "
            f"{config.position_embedding_type} positions; the model has {config.max_position_embeddings}. "
            f"Lower --block-size or raise model.max_position_embeddings."
        )
    check_packing(args, tokenizer, config)
    return config


def check_packing(args: PretrainingArguments, tokenizer: PreTrainedTokenizerBase, config: Any) -> None:
    """--packing padded and packed fill rows with the pad token; packed rows also count their real tokens by it (so it
    must not be a token documents hold) and need layer types that keep the documents of a row apart."""
    if args.packing not in ("padded", "packed"):
        return
    held = {getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "cls", "sep", "unk", "mask")}
    pad = tokenizer.pad_token_id
    if pad is None or (args.packing == "packed" and pad in held):
        raise PretrainingError(
            f"--packing {args.packing} fills rows with the pad token, and this tokenizer has "
            f"{'none' if pad is None else f'one that documents also hold ({tokenizer.pad_token!r})'}; give it a "
            f"pad token of its own, or omit --tokenizer to train one."
        )
    if args.packing != "packed":
        return
    types = {kind for field in config.stack_layer_types() for kind in getattr(config, field)}
    unable = sorted(kind for kind in types if not LAYER_TYPES[kind].packed_rows)
    if unable:
        raise PretrainingError(
            f"--packing packed keeps the documents of a row apart, which {', '.join(map(repr, unable))} layers cannot "
            f"(they lay out the whole row at once); pass --packing padded, or other model.layer_types."
        )


def input_token_count(batch: dict[str, torch.Tensor], pad_token_id: int | None = None) -> int:
    """The real input tokens of a batch: its attention_mask's; in a packed batch (position_ids, no mask) those that
    are not the pad token of a row's tail (`check_packing` keeps the pad token out of documents); else every one."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    if "position_ids" in batch and pad_token_id is not None:
        return int((batch["input_ids"] != pad_token_id).sum())
    return batch["input_ids"].numel()


# ---------------------------------------------------------------------------------------------------------------------
# The output directory, resume, launch
# ---------------------------------------------------------------------------------------------------------------------


def check_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse a folder that holds something, unless it is a previous run and `overwrite` is set."""
    arguments.check_output_dir(
        output_dir,
        overwrite,
        markers=_RUN_MARKERS,
        error=PretrainingError,
        otherwise="--resume-from-checkpoint latest to continue it",
    )


def resolve_resume(args: PretrainingArguments, output_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None to start fresh; refuses a checkpoint of another family, objective or
    model."""
    if args.resume_from_checkpoint is None:
        check_output_dir(output_dir, args.overwrite)
        return None
    holds_run = output_dir.is_dir() and arguments.holds_run(output_dir, _RUN_MARKERS)
    checkpoint, state = requested_checkpoint(
        args.resume_from_checkpoint, output_dir, holds_run=holds_run, error=PretrainingError
    )
    if checkpoint is None:
        check_output_dir(output_dir, args.overwrite)
        return None  # nothing to resume yet: the same command starts the run and restarts it after a crash
    if output_dir.resolve() not in checkpoint.resolve().parents:
        check_output_dir(output_dir, args.overwrite)  # continuing another run's checkpoint in a new folder
    if state.get("family") != args.family:
        raise PretrainingError(
            f"Checkpoint {str(checkpoint)!r} belongs to a run of the {state.get('family')} family; this run trains the "
            f"{args.family} family. Pass --family {state.get('family')} with the same preset, or start a new "
            f"--output-dir."
        )
    saved_objective = state.get("args", {}).get("objective") or TRAINING_FACTS[args.family].default_objective
    if saved_objective != args.objective:
        raise PretrainingError(
            f"Checkpoint {str(checkpoint)!r} belongs to a run of the {saved_objective} objective; this run trains "
            f"{args.objective}. Pass --objective {saved_objective}, or start a new --output-dir."
        )
    saved_model = state.get("args", {}).get("model", {})
    if saved_model != args.model:
        changed = sorted(
            key for key in set(saved_model) | set(args.model) if saved_model.get(key) != args.model.get(key)
        )
        raise PretrainingError(
            f"Checkpoint {str(checkpoint)!r} was trained with another model config (differs in: {', '.join(changed)}); "
            f"resume with the preset or config file it was started with."
        )
    return checkpoint


def check_world_size(world: int, environ: typing.Mapping[str, str] = os.environ) -> None:
    """Refuse a launch whose processes do not form one run.

    On a machine without GPUs, `accelerate launch --multi_gpu` (or a MULTI_GPU config file) without
    ACCELERATE_USE_CPU=1 starts N processes that each set up a single-process run: N independent runs writing one
    folder. The launcher's WORLD_SIZE tells.
    """
    launched = int(environ.get("WORLD_SIZE", world))
    if launched != world:
        raise PretrainingError(
            f"The launcher started {launched} processes but Accelerate set up {world}. On CPU, launch with "
            f"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {launched} -m coreformer_cli "
            "pretrain ..."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Tracker, tokenizer sharing, the checkpoint's engine
# ---------------------------------------------------------------------------------------------------------------------


def tracker_choice(report_to: str) -> tuple[str | None, str]:
    """(log_with, a line saying what happens)."""
    try:
        import tensorboard  # noqa: F401

        available = True
    except ImportError:
        available = False
    if report_to == "none":
        return None, "tracker: none (--report-to none)"
    if available:
        return "tensorboard", "tracker: tensorboard"
    if report_to == "tensorboard":
        raise PretrainingError("--report-to tensorboard needs the tensorboard package: pip install tensorboard")
    return None, "tracker: none (tensorboard is not installed; pip install tensorboard to log curves)"


def tracker_hparams(args: PretrainingArguments) -> dict[str, Any]:
    """Flat scalar settings for TensorBoard's hparams view."""
    settings = dataclasses.asdict(args)
    settings.update({f"model.{key}": value for key, value in settings.pop("model").items()})
    settings.update(settings.pop("objective_settings"))
    return {
        key: value if isinstance(value, int | float | str | bool) else str(value) for key, value in settings.items()
    }


def shared_tokenizer(accelerator, train: typing.Callable[[], PreTrainedTokenizerBase]) -> PreTrainedTokenizerBase:
    """Train on the main process and hand the files to the others: training gives every process the same tokenizer
    (tokenizer_training makes WordPiece's numbering deterministic), but once is enough, and the other ranks are spared
    the time."""
    payload: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            tokenizer = train()
            with tempfile.TemporaryDirectory() as folder:
                tokenizer.save_pretrained(folder)
                payload = [{path.name: path.read_bytes() for path in Path(folder).iterdir()}]
        except Exception as error:  # let every process raise it, instead of waiting forever on the main one
            payload = [PretrainingError(f"Tokenizer training failed: {type(error).__name__}: {error}")]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(payload)
    if isinstance(payload[0], Exception):
        raise payload[0]
    if accelerator.is_main_process:
        return tokenizer
    with tempfile.TemporaryDirectory() as folder:
        for name, content in payload[0].items():
            Path(folder, name).write_bytes(content)
        return AutoTokenizer.from_pretrained(folder)


def check_checkpoint_engine(checkpoint: Path, state: dict[str, Any], engine: Engine) -> None:
    """A checkpoint is read by the engine that writes its format: Accelerate's save_state folders by Accelerate's
    engines, DCP shards by coreformer's FSDP2 on any number of processes from 2 (DCP reshards: tested 2 -> 4)."""
    recorded = state.get("engine", {})  # absent in checkpoints of runs before engines were recorded: Accelerate's
    saved, writer = recorded.get("checkpoint_format", "accelerate"), recorded.get("sharding", "DDP or single-process")
    if saved != engine.checkpoint_format:
        processes = f"saved by {state.get('world_size', '?')} process(es), this run has {engine.world_size}"
        raise PretrainingError(
            f"Checkpoint {str(checkpoint)!r} holds {saved} state (written by a {writer} run); "
            f"this run is {engine.distributed_type} ({engine.sharding}) and reads {engine.checkpoint_format} "
            f"checkpoints ({processes}). Resume with the launcher config the run was started with"
            + (" (FSDP2 shards of DCP checkpoints load on any number of processes from 2)." if saved == "dcp" else ".")
        )
