"""`coreformer export`: a coreformer (or native) folder -> a native transformers folder, ONNX or GGUF.

    export(args, prog) -> exit code    the handler (arguments: coreformer_settings.tools.add_export_arguments)
    print_check(check)                 what `--check` found, alike for every format

The work is coreformer.export.export_to. Exit codes: 0 written, 1 `--check` found a difference above tolerance
(nothing written), 2 a bad input (one line on stderr, nothing written).
"""

import argparse
import sys

from .base import CheckFailedError, CommandError, tool_command


@tool_command
def export(args: argparse.Namespace) -> int:
    """`coreformer export`: a coreformer folder -> a native transformers folder, ONNX or GGUF (coreformer.export)."""
    from ..export import ExportCheckError, export_to
    from ..hub.folders import DestinationExistsError

    try:
        summary = export_to(
            args.folder,
            args.out,
            to=args.to,
            check=args.check,
            overwrite=args.overwrite,
            gguf_dtype=args.gguf_dtype,
        )
    except ExportCheckError as error:
        print(str(error), file=sys.stderr)
        raise CheckFailedError from error
    except DestinationExistsError as error:
        raise CommandError(error.command_line_message()) from error
    except ValueError as error:
        raise CommandError(str(error)) from error
    if summary.get("check"):
        print_check(summary["check"])
    written = summary.get("out") or summary.get("file") or args.out
    print(f"exported {args.folder} -> {summary.get('native_class') or args.to}: wrote {written}")
    return 0


def print_check(check: dict) -> None:
    """What `export --check` found, alike for every format (coreformer.native.parity.check_summary)."""
    print(f"max abs difference: {check['max_abs_difference']:.3g} (tolerance {check['tolerance']:.3g})")
    for key, what in (("tokens_equal", "greedy tokens equal"), ("tokenizer_equal", "tokenizer ids equal")):
        if check.get(key) is not None:
            print(f"{what}: {check[key]}")
