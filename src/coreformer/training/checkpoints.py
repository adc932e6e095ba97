"""Checkpoints of a run (pretraining's own, fine-tuning's through Trainer): atomic saves, the newest complete one,
leftovers of interrupted saves, and the checks and messages of `--resume-from-checkpoint` both runs share.

    save_checkpoint(accelerator, model, output_dir, step, trainer_state, tokenizer, keep_last)   write, rename, prune
    tied_parameter_names(model)                                          every name a tied weight goes by
    list_checkpoints(output_dir) / find_latest_checkpoint(output_dir)    complete `checkpoints/step-N`, oldest first
    read_trainer_state(checkpoint)                                       what the run recorded (step, data position)
    remove_stale_temporaries(output_dir)                                 folders a crash left mid-save
    requested_checkpoint(requested, output_dir, ...)                    'latest' or a folder -> a complete checkpoint
    check_unchanged(checkpoint, saved, current, ...)                     refuse a resume under other settings
    stopped_message(output_dir, step, start_over)                        Ctrl-C's one line: where to go on from

Checkpoints are written into `checkpoints/.tmp-step-N` and renamed to `step-N` once complete (a rename is atomic on
POSIX), so a crash during a save leaves the previous checkpoint as the latest; trainer_state.json is written last,
so its presence marks a checkpoint complete.
"""

import ast
import contextlib
import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from coreformer_settings.base import CHECKPOINTS_DIR

from ..hub.folders import remove_stale_saves, replace_folder
from .arguments import PretrainingError, write_json

TRAINER_STATE = "trainer_state.json"  # written last into a checkpoint: its presence marks the folder complete
_CHECKPOINT_NAME = re.compile(r"step-(\d+)")


def _checkpoint_step(path: Path) -> int | None:
    match = _CHECKPOINT_NAME.fullmatch(path.name)
    if match is None or not path.is_dir() or not (path / TRAINER_STATE).is_file():
        return None
    return int(match.group(1))


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first; `.tmp-*` folders of interrupted saves are ignored."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(step, path) for path in root.iterdir() if (step := _checkpoint_step(path)) is not None]
    return [path for _, path in sorted(found)]


def find_latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def read_trainer_state(checkpoint: str | Path, *, error: type[Exception] = PretrainingError) -> dict[str, Any]:
    path = Path(checkpoint) / TRAINER_STATE
    if not path.is_file():
        raise error(f"{str(checkpoint)!r} is not a complete checkpoint folder (no {TRAINER_STATE}).")
    return json.loads(path.read_text())


def requested_checkpoint(
    requested: str, output_dir: Path, *, holds_run: bool, error: type[Exception]
) -> tuple[Path | None, dict[str, Any] | None]:
    """(checkpoint, its trainer_state.json) that `--resume-from-checkpoint requested` names: 'latest' is the newest
    complete checkpoint in `output_dir`, anything else a checkpoint folder. (None, None) when 'latest' finds none in
    a folder that holds no run (`holds_run`): the same command then starts the run, and restarts it after a crash."""
    if requested == "latest":
        checkpoint = find_latest_checkpoint(output_dir)
        if checkpoint is None:
            if holds_run:
                raise error(
                    f"--resume-from-checkpoint latest: {str(output_dir)!r} holds a run but no complete checkpoint "
                    f"under {CHECKPOINTS_DIR}/. Pass --overwrite without --resume-from-checkpoint to start over."
                )
            return None, None
    else:
        checkpoint = Path(requested)
        if not checkpoint.is_dir():
            raise error(f"--resume-from-checkpoint {str(checkpoint)!r} does not exist.")
    return checkpoint, read_trainer_state(checkpoint, error=error)


def check_unchanged(
    checkpoint: Path, saved: dict[str, Any], current: dict[str, Any], *, what: str, fix: str, error: type[Exception]
) -> None:
    """Refuse to resume `checkpoint` when the settings it was saved with (`saved`) differ from this run's; `what`
    names them with their article ("another model config", "other settings"), `fix` says what to do."""
    changed = sorted(key for key in set(saved) | set(current) if saved.get(key) != current.get(key))
    if changed:
        raise error(
            f"Checkpoint {str(checkpoint)!r} was trained with {what} (differs in: {', '.join(changed)}); {fix}."
        )


def stopped_message(output_dir: Path, step: int, start_over: str) -> str:
    """What Ctrl-C at `step` leaves: the newest checkpoint to resume from, or none (then `start_over` says how)."""
    checkpoint = find_latest_checkpoint(output_dir)
    if checkpoint is None:
        return f"stopped at step {step}, before the first checkpoint; {start_over}"
    saved = read_trainer_state(checkpoint)
    return (
        f"stopped at step {step}; continue with --resume-from-checkpoint latest (from its checkpoint at step "
        f"{saved.get('step', saved.get('global_step'))})"
    )


def remove_stale_temporaries(output_dir: Path) -> None:
    """Leftovers of saves that a crash interrupted: checkpoints being written (never complete, never read), and a
    checkpoint caught between replace_folder's fallback renames (put back)."""
    for folder in (output_dir / CHECKPOINTS_DIR, output_dir):
        if folder.is_dir():
            for path in folder.iterdir():
                if path.name.startswith((".tmp-", ".old-", ".final-tmp")):  # .old-, .final-tmp: before 0.1
                    shutil.rmtree(path, ignore_errors=True)
    remove_stale_saves(output_dir / CHECKPOINTS_DIR)


def tied_parameter_names(model) -> set[str]:
    """The names of `model`'s tied weights, both ends of each tie, prefixed as in its state dict (a DDP wrapper's
    `module.` included): transformers' `all_tied_weights_keys` ({target: source}) of every submodel."""
    names = set()
    for prefix, module in model.named_modules():
        for target, source in (getattr(module, "all_tied_weights_keys", None) or {}).items():
            names.update(f"{prefix}.{name}" if prefix else name for name in (target, source))
    return names


_SHARED_TENSORS = re.compile(r"Removed shared tensor (\{.*?\}) while saving")


class _KnownTiesFilter(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...} while saving ... check by verifying" when every tensor it
    removed is one end of a tie the model declares: the model re-ties it when the checkpoint is loaded (the exact
    resume test checks the weights), so the warning says nothing. Any other shared tensor still warns."""

    def __init__(self, tied: set[str]) -> None:
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        found = _SHARED_TENSORS.search(record.getMessage())  # after accelerate's "[RANK 0] "
        return found is None or not ast.literal_eval(found.group(1)) <= self.tied


@contextlib.contextmanager
def _quiet_about_ties(model) -> Iterator[None]:
    source = logging.getLogger("accelerate.utils.other")  # clean_state_dict_for_safetensors, under save_state
    known = _KnownTiesFilter(tied_parameter_names(model))
    source.addFilter(known)
    try:
        yield
    finally:
        source.removeFilter(known)


def save_checkpoint(
    accelerator,
    model,
    output_dir: Path,
    step: int,
    trainer_state: dict,
    tokenizer: PreTrainedTokenizerBase,
    keep_last: int,
    write_state: Callable[[Path], None] | None = None,
) -> Path:
    """The training state into checkpoints/.tmp-step-N, then rename to step-N; prune to the last `keep_last`.

    `write_state(folder)` writes model, optimizer, schedule and RNG states on every process (default:
    accelerator.save_state; the engine's DCP writer under coreformer's FSDP2, engine.py). Every process writes into
    the temporary folder (its RNG state; shards under FSDP / DeepSpeed), so its name is the same on every rank; all
    wait for the last one before rank 0 writes trainer_state.json (last) and renames, which makes the folder visible
    at once: a kill at any point leaves the previous checkpoint the latest.
    """
    root = output_dir / CHECKPOINTS_DIR
    staging, final = root / f".tmp-step-{step}", root / f"step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    with _quiet_about_ties(model):
        if write_state is None:
            accelerator.save_state(str(staging))
        else:
            write_state(staging)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tokenizer.save_pretrained(staging / "tokenizer")
        write_json(staging / TRAINER_STATE, trainer_state)
        replace_folder(staging, final)  # final exists when re-saving a step after resuming from an older checkpoint
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final
