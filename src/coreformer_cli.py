"""The `coreformer` command's front door, importable without torch: argument parsing, `--version`, path checks.

    coreformer --version | --help
    coreformer pretrain | finetune | publish ...   the runs (coreformer_commands; the same as training/*.py)
    coreformer convert SRC DST [--check] [--overwrite] [--skip-tokenizer]
    coreformer export FOLDER OUT [--to native|onnx|gguf] [--check] [--overwrite] [--gguf-dtype f32|f16|bf16|q8_0]
    coreformer attention-map FOLDER "text" [--layer L] [--head H] [--stack S] [--target T] -o map.png

Importing the `coreformer` package registers every class with transformers and so imports torch and transformers
(about 5 s on a 2-core CPU); this module sits beside the package, not in it, so `--help`, `--version` and a mistyped
folder answer before any of that. The work itself is in `coreformer.cli`, imported after the arguments are parsed.

    version() -> "0.1.0"                 the installed package's version (torch-free)
    add_version_argument(parser)         `--version` for any coreformer command line (training scripts too)
    check_model_location(name) -> name   a local folder, or a Hub repo id; NoSuchFolderError for a local-looking path
                                         that does not exist, or a Hub id while the Hub is offline or unreachable (in
                                         one connection attempt, before any Hub call and its retries)
    check_local_folder(name) -> name     an existing local folder; NoSuchFolderError otherwise
    COMMANDS                             the subcommands: arguments, checks, and the handler to import
    SuggestingParser                     argparse, naming the closest known flag to an unknown one
"""

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

import coreformer_commands
from coreformer_commands import RUN_COMMANDS
from coreformer_settings.base import INTERRUPTED
from coreformer_settings.base import installed_version as version  # noqa: F401  (public: coreformer_cli.version())
from coreformer_settings.command_line import (
    NoSuchFolderError,
    SuggestingParser,
    add_version_argument,
    check_local_folder,
    check_model_location,
)
from coreformer_settings.exports import CHECK_TOLERANCES, EXPORT_FORMATS, GGUF_DTYPES

PACKAGE = "coreformer"
USAGE_ERROR = 2  # argparse's exit code for a bad command line; a missing folder is one too
CHECK_TOLERANCE = CHECK_TOLERANCES["f32"]  # `convert --check` / `export --check`: the largest output difference


def _convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a local transformers checkpoint folder (config.json + weights)")
    parser.add_argument("dst", help="the folder to write the coreformer checkpoint to (created; see --overwrite)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="run both models on a padded sample batch and fail (exit 1, nothing written) if any output differs by "
        f"more than {CHECK_TOLERANCE}",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists and is not empty")
    parser.add_argument("--skip-tokenizer", action="store_true", help="convert the weights only; copy no tokenizer")


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder",
        help="a saved coreformer model folder (pretraining, fine-tuning or convert output), or a transformers folder "
        "of an architecture `coreformer convert` reads",
    )
    parser.add_argument(
        "out", help="the folder to write (for --to gguf: a .gguf file, or a folder receiving model-<dtype>.gguf)"
    )
    parser.add_argument(
        "--to",
        choices=EXPORT_FORMATS,
        default="native",
        help="native: the transformers architecture computing the same function (GPT-2, Llama, Mistral, Qwen2, "
        "GPT-NeoX, BERT, RoBERTa, ModernBERT, BART), loadable without coreformer; onnx; gguf (decoders exporting to "
        "Llama, GPT-2 or GPT-NeoX: the decoder presets)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="read OUT back (native: plain transformers in a fresh process without coreformer; onnx: onnxruntime; "
        "gguf: the file's weights and tokenizer), compare logits, greedy tokens and tokenizer ids with the source, "
        f"print the maximum difference and its tolerance; exit 1 and write nothing above it ({CHECK_TOLERANCE} in "
        "fp32)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    parser.add_argument("--gguf-dtype", choices=GGUF_DTYPES, default="f32", help="tensor type of --to gguf")


def add_attention_map_arguments(parser: argparse.ArgumentParser) -> None:
    """The `attention-map` arguments (also `python -m coreformer.attention_maps`)."""
    parser.add_argument("folder", help="a saved coreformer model folder (with its tokenizer), or a Hub repo id")
    parser.add_argument("text", help="the text to encode")
    parser.add_argument("--layer", type=int, default=-1, help="layer index, negative from the end (default: the last)")
    parser.add_argument("--head", type=int, default=None, help="one head (default: a grid of every head)")
    parser.add_argument(
        "--stack",
        choices=["encoder", "decoder", "cross"],
        default=None,
        help="which attention to draw: encoder or decoder self-attention, or seq2seq cross-attention (default: the "
        "model's own stack; a seq2seq model's encoder)",
    )
    parser.add_argument("--target", default=None, help="seq2seq only: the decoder-side text")
    parser.add_argument("-o", "--output", required=True, help="the image to write, e.g. map.png")


@dataclass(frozen=True)
class Command:
    """One subcommand: its arguments, which of them name folders, and the handler run after parsing."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: str  # "module:function", imported only after parsing: `(args) -> exit code`
    local_folders: tuple[str, ...] = ()  # arguments that must be existing local folders
    model_locations: tuple[str, ...] = ()  # arguments that are a local folder or a Hub repo id


COMMANDS = {
    command.name: command
    for command in (
        Command(
            "convert",
            "convert a local transformers BERT / RoBERTa / GPT-2 / BART / Llama / Mistral / Qwen2 folder to coreformer",
            _convert_arguments,
            "coreformer.cli:convert",
            local_folders=("src",),
        ),
        Command(
            "export",
            "export a coreformer (or native) folder to a native transformers architecture, ONNX or GGUF (to serve "
            "without coreformer)",
            _export_arguments,
            "coreformer.cli:export",
            local_folders=("folder",),
        ),
        Command(
            "attention-map",
            "plot a saved model's attention probabilities for a text",
            add_attention_map_arguments,
            "coreformer.cli:attention_map",
            model_locations=("folder",),
        ),
    )
}


def build_parser() -> argparse.ArgumentParser:

    parser = SuggestingParser(prog="coreformer", description="coreformer command-line tools")
    add_version_argument(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for run in RUN_COMMANDS.values():  # listed here; `main` hands their arguments to their own parser
        commands.add_parser(run.name, help=run.help, add_help=False)
    for command in COMMANDS.values():
        subparser = commands.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(subparser)
    return parser


def check_paths(args: argparse.Namespace) -> None:
    command = COMMANDS[args.command]
    for name in command.local_folders:
        check_local_folder(getattr(args, name))
    for name in command.model_locations:
        check_model_location(getattr(args, name))


def main(argv: list[str] | None = None) -> int:
    """Parse, check the folders, then import the handler and run it (exit codes: see coreformer.cli; 130 after
    Ctrl-C)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in RUN_COMMANDS:  # pretrain, finetune, publish: their own parser, help and exit codes
        return RUN_COMMANDS[argv[0]].main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's parser knows its flags, so it names the closest one
        subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        subparsers.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        check_paths(args)
    except NoSuchFolderError as error:
        print(f"coreformer {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    module, function = COMMANDS[args.command].handler.split(":")
    try:
        handler = getattr(import_module(module), function)
        coreformer_commands.after_imports()  # looked up here: one function to replace for every command
        return handler(args)
    except KeyboardInterrupt:  # one line, not a traceback through torch's import or the model's forward
        print(
            f"coreformer {args.command}: stopped by Ctrl-C before it finished; run the same command again (convert "
            f"and export write their output whole, at the end)",
            file=sys.stderr,
        )
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
