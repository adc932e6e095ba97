"""A pretraining run's folder: what it holds, whether this run may write it, and the checkpoint it resumes from.

    resolve_resume                              the output folder and the checkpoint to resume from, refused when
                                                they belong to another run (the folder checked by the torch-free
                                                coreformer_settings.pretraining.check_run_folder, which the command
                                                line also runs before the heavy imports)
    check_world_size / check_checkpoint_engine  a launch that forms one run; a checkpoint the engine can read

Each raises one PretrainingError naming the problem and the fix; nothing here writes to the output folder.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

from coreformer_settings.pretraining import RUN_MARKERS, check_run_folder

from .. import arguments
from ..arguments import PretrainingError
from ..checkpoints import requested_checkpoint
from ..engine import Engine
from ..families import TRAINING_FACTS
from .run import PretrainingArguments


def resolve_resume(args: PretrainingArguments, output_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None to start fresh; refuses a checkpoint of another family, objective or
    model."""
    if args.resume_from_checkpoint is None:
        check_run_folder(output_dir, args.overwrite)
        return None
    holds_run = output_dir.is_dir() and arguments.holds_run(output_dir, RUN_MARKERS)
    checkpoint, state = requested_checkpoint(
        args.resume_from_checkpoint, output_dir, holds_run=holds_run, error=PretrainingError
    )
    if checkpoint is None:
        check_run_folder(output_dir, args.overwrite)
        return None  # nothing to resume yet: the same command starts the run and restarts it after a crash
    if output_dir.resolve() not in checkpoint.resolve().parents:
        check_run_folder(output_dir, args.overwrite)  # continuing another run's checkpoint in a new folder
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
