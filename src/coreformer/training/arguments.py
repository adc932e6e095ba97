"""What both runs share (pretraining/, finetuning/ and their scripts training/pretrain.py and finetune.py): the
settings base, the error classes, flags and config files (all defined in the torch-free `coreformer_settings.base`
and re-exported here, so that the scripts parse their arguments before torch is imported), and the output folders.

    RunError / PretrainingError / FinetuningError, RunStoppedError, INTERRUPTED, RunSettings, arg,
    load_config_file, coerce, add_flags, export_arg, EXPORT_FOLDER, RUN_CONFIG ("run_config.json": every run's
    resolved settings, written as it starts), holds_run, check_output_dir (refuse a non-empty output folder unless
    it is a run and --overwrite is set)    from coreformer_settings.base (see there)
    write_json(path, value)                indented JSON with a final newline
    export_run(kind, folder)               `--export native`: after training, OUTPUT_DIR/native (coreformer export)

Nothing here imports the modeling code or torch at module level.
"""

import json
import sys
from pathlib import Path
from typing import Any

from coreformer_settings.base import (
    EXPORT_FOLDER,
    INTERRUPTED,
    RUN_CONFIG,
    RUN_EXPORT_FORMATS,
    FinetuningError,
    PretrainingError,
    RunError,
    RunSettings,
    RunStoppedError,
    add_flags,
    arg,
    check_output_dir,
    coerce,
    export_arg,
    holds_run,
    load_config_file,
)

__all__ = [
    "EXPORT_FOLDER",
    "RUN_CONFIG",
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
