"""What the command handlers share: the errors a user can fix, and how each becomes one line and an exit code.

CommandError          a bad input found while working (exit 2, its message on stderr, nothing written)
CheckFailedError      a `--check` found a difference above tolerance (exit 1; what it found was printed)
tool_command(run)     a tool handler `(args, prog) -> int`: both errors become exit codes; no progress bars
stopped(prog, text)   the one line of a run stopped by Ctrl-C, and its exit code (130)
"""

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from coreformer_settings.base import INTERRUPTED
from coreformer_settings.command_line import USAGE_ERROR

CHECK_FAILED = 1


class CommandError(Exception):
    """An error the user can fix; the handler prints its message and exits with code 2."""


class CheckFailedError(Exception):
    """Unwinds a staging folder when --check finds a difference; the handler exits with code 1."""


def quiet_loading() -> None:
    """No progress bars for loading or writing weights (a command's own lines say what it did, and the work takes a
    moment), and no word from torch.onnx about the torchvision operators it skips (coreformer uses none)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def tool_command(run: Callable[[Any], int]) -> Callable[[Any, str], int]:
    """A tool's handler: a CommandError becomes one line on stderr and exit code 2, a failed --check 1."""

    @functools.wraps(run)
    def handler(args: Any, prog: str) -> int:
        quiet_loading()
        try:
            return run(args)
        except CommandError as error:
            print(f"{prog}: error: {error}", file=sys.stderr)
            return USAGE_ERROR
        except CheckFailedError:
            return CHECK_FAILED

    return handler


def stopped(prog: str, message: str) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return INTERRUPTED
