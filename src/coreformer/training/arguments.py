"""What both runs share (pretraining/, finetuning/ and their scripts training/pretrain.py and finetune.py): the
settings base, the error classes, flags and config files (all defined in the torch-free `coreformer_settings.base`
and re-exported here, so that the scripts parse their arguments before torch is imported), and the output folders.

    RunError / PretrainingError / FinetuningError, RunStoppedError, INTERRUPTED, RunSettings, arg,
    load_config_file, coerce, add_flags, export_arg, EXPORT_FOLDER     from coreformer_settings.base (see there)
    RUN_CONFIG                             "run_config.json": every run's resolved settings, written as it starts
    holds_run(folder, markers)             whether a folder holds a previous run (any of its marker files)
    check_output_dir(output_dir, ...)      refuse a non-empty output folder unless it is a run and --overwrite is set
    write_json(path, value)                indented JSON with a final newline
    export_run(kind, folder)               `--export native`: after training, OUTPUT_DIR/native (coreformer export)

Nothing here imports the modeling code or torch at module level.
"""

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coreformer_settings.base import (
    EXPORT_FOLDER,
    INTERRUPTED,
    RUN_EXPORT_FORMATS,
    FinetuningError,
    PretrainingError,
    RunError,
    RunSettings,
    RunStoppedError,
    add_flags,
    arg,
    coerce,
    export_arg,
    load_config_file,
)

__all__ = [
    "EXPORT_FOLDER",
    "RUN_EXPORT_FORMATS",
    "INTERRUPTED",
    "FinetuningError",
    "PretrainingError",
    "RunError",
    "RunSettings",
    "RunStoppedError",
    "add_flags",
    "arg",
    "check_output_dir",
    "coerce",
    "export_arg",
    "export_run",
    "holds_run",
    "load_config_file",
    "write_json",
]

RUN_CONFIG = "run_config.json"


def holds_run(folder: Path, markers: Sequence[str]) -> bool:
    """Whether `folder` holds a previous run: any of the files or folders a run writes (`markers`)."""
    return any((folder / marker).exists() for marker in markers)


def check_output_dir(
    output_dir: Path, overwrite: bool, *, markers: Sequence[str], error: type[Exception], otherwise: str
) -> None:
    """Refuse a folder that holds something, unless it is a previous run (see `holds_run`) and `overwrite` is set.
    `otherwise` ends the message for a run folder without `overwrite`: what else the user can do."""
    if output_dir.exists() and not output_dir.is_dir():
        raise error(f"--output-dir {str(output_dir)!r} is a file.")
    if not output_dir.is_dir() or not any(output_dir.iterdir()):
        return
    if not holds_run(output_dir, markers):
        raise error(
            f"--output-dir {str(output_dir)!r} is not empty and holds no previous run; choose an empty or new folder "
            f"(--overwrite only replaces a run folder)."
        )
    if not overwrite:
        raise error(
            f"--output-dir {str(output_dir)!r} already holds a run. Pass --overwrite to replace it, or {otherwise}."
        )


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def export_run(kind: str | None, folder: Path) -> dict[str, Any] | None:
    """`--export KIND`: export the finished model folder `folder` to `folder/native`. A configuration no native
    architecture reproduces is reported on stderr, not raised: the trained model itself is already saved."""
    if kind is None:
        return None
    from ..export import export_to  # torch and transformers: only when asked for

    try:
        summary = export_to(folder, Path(folder) / EXPORT_FOLDER, to=kind, overwrite=True)
    except ValueError as error:
        print(f"--export {kind} skipped: {error}", file=sys.stderr)
        return None
    print(f"exported the model as {summary['native_class']} to {Path(folder) / EXPORT_FOLDER}")
    return summary
