"""A pretraining run's tracker: which one logs its curves (--report-to), and the settings it records.

tracker_choice(report_to) -> (log_with, line)   TensorBoard when installed (or asked for), else none, and why
tracker_hparams(args) -> dict                   flat scalar settings for TensorBoard's hparams view
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..arguments import PretrainingError
from .run import PretrainingArguments


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
