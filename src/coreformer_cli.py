"""The `coreformer` command line, importable without torch: every subcommand's arguments, checks and handler.

    coreformer --version | --help
    coreformer pretrain | finetune | evaluate | publish ...   the runs (the clone's training/*.py are the same)
    coreformer convert SRC DST [--check] [--overwrite] [--skip-tokenizer]
    coreformer export FOLDER OUT [--to native|onnx|gguf] [--check] [--overwrite] [--gguf-dtype f32|f16|bf16|q8_0]
    coreformer attention-map FOLDER "text" [--layer L] [--head H] [--stack S] [--target T] -o map.png
    coreformer tokenize SOURCE OUT --tokenizer T [--shard-tokens N] [--num-proc P] [--validation-fraction F]

    Command(name, help, add_arguments, handler, ...)   one subcommand: its parser, its torch-free checks (`prepare`),
                                                       and the handler in coreformer.commands that does the work
    COMMANDS                                           name -> Command, every subcommand
    Command.build_parser(prog), Command.main(argv, prog)
    main(argv) -> exit code                            what the console script calls
    after_imports()                                    what every command does once its heavy imports are done
    version() -> "0.1.0"                               the installed package's version (torch-free)

Importing the `coreformer` package registers every class with transformers and so imports torch and transformers (about
5 s on a 2-core CPU). This module sits beside the package, on the top floor: it parses the arguments and runs each
command's checks with the torch-free settings (coreformer_settings), so `--help`, `--version`, a bad flag or a mistyped
folder answer at once; only then does it import the handler (each command's `handler` function imports it from
coreformer.commands, which never imports this module). Exit codes: 0 done, 1 `--check` found a difference (or the Hub
refused an upload), 2 a bad input (one line on stderr, nothing written), 130 stopped by Ctrl-C.
"""

import argparse
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coreformer_settings import evaluation, finetuning, pretraining, tokenizing
from coreformer_settings.base import INTERRUPTED, FinetuningError, PretrainingError, load_config_file
from coreformer_settings.base import installed_version as version  # noqa: F401  (public: coreformer_cli.version())
from coreformer_settings.command_line import (
    USAGE_ERROR,
    NoSuchFolderError,
    SuggestingParser,
    add_version_argument,
    check_local_folder,
    check_model_location,
)
from coreformer_settings.data_sources import local_data
from coreformer_settings.pretraining import PRESETS, default_configs_dir, gather_settings, preset_defaults
from coreformer_settings.registries import native_list
from coreformer_settings.tasks import TASK_REGISTRY
from coreformer_settings.tools import add_attention_map_arguments, add_convert_arguments, add_export_arguments

PROGRAM = "coreformer"
INPUT_ERRORS = (NoSuchFolderError, PretrainingError, FinetuningError)  # what `prepare` raises: exit 2, one line


Handler = Callable[[Any, str], int]  # (what `prepare` returned, the program's name) -> exit code


@dataclass(frozen=True)
class Command:
    """One subcommand. `prepare` (torch-free) checks the parsed arguments and returns what the handler takes;
    `handler` imports the handler and returns it, and is called only after that."""

    name: str
    help: str  # one line, for `coreformer --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[], Handler]
    description: str | None = None  # the subcommand's `--help` text (default: `help`)
    prepare: Callable[[argparse.Namespace, argparse.ArgumentParser], Any] = lambda args, parser: args
    interrupted: str = "stopped by Ctrl-C before it finished; run the same command again (the output is written whole)"

    def build_parser(self, prog: str | None = None) -> argparse.ArgumentParser:
        parser = SuggestingParser(
            prog=prog or f"{PROGRAM} {self.name}",
            description=self.description or self.help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.add_arguments(parser)
        add_version_argument(parser)
        return parser

    def main(self, argv: list[str] | None = None, prog: str | None = None) -> int:
        """Parse (argparse exits 2 on a bad flag), check, then import the handler and run it."""
        parser = self.build_parser(prog)
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        try:
            prepared = self.prepare(args, parser)
            handler = self.handler()
            after_imports()
            return handler(prepared, parser.prog)
        except INPUT_ERRORS as error:
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return USAGE_ERROR
        except KeyboardInterrupt:  # one line, not a traceback through torch's import or the model's forward
            print(f"{parser.prog}: {self.interrupted}", file=sys.stderr)
            return INTERRUPTED


def after_imports() -> None:
    """What each command does once torch, transformers and the package are imported: the half a million objects those
    imports made live as long as the process, so they leave the garbage collector's sight (gc.freeze). Otherwise every
    full collection walks them all again: a tiny run makes several, and the interpreter's exit more
    (benchmarks/command_startup.py times both). Only the commands do this, never the package: a command owns its
    process, a user's Python session is not ours."""
    gc.freeze()


def _check(*, local_folders: tuple[str, ...] = (), model_locations: tuple[str, ...] = ()) -> Callable:
    """A `prepare` that checks the named arguments are existing local folders / local folders or Hub repo ids."""

    def prepare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
        for name in local_folders:
            check_local_folder(getattr(args, name))
        for name in model_locations:
            check_model_location(getattr(args, name))
        return args

    return prepare


# ---------------------------------------------------------------------------------------------------------------------
# pretrain
# ---------------------------------------------------------------------------------------------------------------------

PRETRAIN_DESCRIPTION = f"""\
Pretrain a coreformer encoder (MLM), decoder (causal LM) or seq2seq model (BART denoising) with Accelerate;
--objective picks another objective for the family.

    coreformer pretrain --family decoder --preset tiny --output-dir outputs/decoder-tiny
    accelerate launch -m coreformer_cli pretrain --family encoder --preset small --output-dir outputs/encoder-small
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m coreformer_cli pretrain --family decoder
    accelerate launch --config_file {default_configs_dir()}/accelerate/fsdp.yaml -m coreformer_cli pretrain ...

Settings come from the dataclass defaults, then the preset ({{family}}-{{preset}}.yaml, shipped with coreformer;
default tiny) or --config FILE (YAML/JSON: the same keys plus `model:`, the family config's fields), then the flags
given here. Rerun with --resume-from-checkpoint latest to continue a run from its newest checkpoint (bit-identical on
CPU). The run itself is coreformer.training.pretraining.run_pretraining.
"""


def _pretrain_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=PRESETS, help="model + run settings of a shipped preset (default: tiny)")
    source.add_argument("--config", metavar="FILE", help="a YAML/JSON file of model + run settings")
    # only flags given override the preset / config; the help shows what each preset sets
    pretraining.add_settings_flags(parser, default_text=preset_defaults())


def _prepare_pretrain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], str]:
    """The run's settings gathered once (defaults <- preset or --config <- the flags given), with the folders they
    name checked: a mistyped --tokenizer or --resume-from-checkpoint (given here, in the preset or in --config), or an
    --output-dir holding a run without --overwrite, is one line, before torch is imported or the Hub is asked."""
    given = vars(args)
    preset, config, family = given.pop("preset", None), given.pop("config", None), given.pop("family", None)
    values, source = gather_settings(family=family, preset=preset, config_file=config, overrides=given)
    pretraining.check_data_source(values)
    if values.get("dataset") is not None:  # a missing or empty local file, before `datasets` is imported
        local_data(values["dataset"], error=PretrainingError)
    if values.get("data_dir") is not None:  # not a shard folder, or one `coreformer tokenize` has not finished
        tokenizing.check_shard_folder(values["data_dir"])
    if values.get("tokenizer") is not None:
        check_model_location(values["tokenizer"])
    if values.get("resume_from_checkpoint") not in (None, "latest"):
        check_local_folder(values["resume_from_checkpoint"])
    else:  # resuming from a folder elsewhere, the run folder is checked with the checkpoint
        _check_run_folder(values, pretraining.PretrainingSettings, pretraining.check_run_folder)
    return values, source


def _check_run_folder(values: dict[str, Any], settings: type, check: Callable[[Path, bool], None]) -> None:
    """A run starting anew (no --resume-from-checkpoint) in a folder that holds something: refused now, as the run
    would refuse it after the heavy imports."""
    if values.get("resume_from_checkpoint") is None:
        check(Path(values.get("output_dir", settings.output_dir)).expanduser(), bool(values.get("overwrite", False)))


# ---------------------------------------------------------------------------------------------------------------------
# finetune
# ---------------------------------------------------------------------------------------------------------------------

FINETUNE_DESCRIPTION = """\
Fine-tune a coreformer folder with transformers' Trainer (Seq2SeqTrainer for seq2seq).

    coreformer finetune --task sequence-classification --model outputs/encoder-tiny --output-dir out/cls
    coreformer finetune --task token-classification --model M --dataset conll2003 --label-column ner_tags ...
    coreformer finetune --task question-answering --model M --train-file train.jsonl --validation-file dev.jsonl
    coreformer finetune --task causal-lm --model outputs/decoder-tiny --peft lora --output-dir out/clm-lora
    coreformer finetune --task seq2seq --model outputs/seq2seq-tiny --max-steps 500 --output-dir out/sum
    coreformer finetune --task multiple-choice --model outputs/electra-tiny --output-dir out/mc
    coreformer finetune --task seq2seq --model M --output-dir out/sum --resume-from-checkpoint latest

Checkpoints go to OUTPUT_DIR/checkpoints/step-N every --save-every steps (500) and at the end, each written whole
(Trainer's files renamed into place); --resume-from-checkpoint latest continues the newest one exactly, and starts
the run when there is none.

Tasks: sequence-classification (run_glue), token-classification (run_ner), question-answering (run_qa), causal-lm
(run_clm), seq2seq (run_summarization), multiple-choice (run_swag). Without --dataset / --train-file each task trains
on its embedded offline default, built from the Python standard library. Settings come from the dataclass defaults,
then --config FILE (YAML/JSON of the same keys), then the flags given here; the example scripts' flag names
(--model_name_or_path, --dataset_name, --max_seq_length, --per_device_train_batch_size, --learning_rate,
--overwrite_output_dir, ...) are accepted too. The run itself is coreformer.training.finetuning.run_finetuning.
"""


def _finetune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a YAML/JSON file of settings (the flags' names as keys)")
    # --field-name, --field_name and the example scripts' names; only flags given override the config file
    finetuning.add_settings_flags(parser)


def _prepare_finetune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The settings gathered once (--config file <- the flags given); a mistyped --model or --tokenizer folder, an
    unknown --task or a missing data file (given here or in --config) is one line, before torch or the Hub."""
    given = vars(args)
    config = given.pop("config", None)
    values = {**(load_config_file(config, error=FinetuningError) if config is not None else {}), **given}
    task = values.get("task")
    if task is not None and task not in TASK_REGISTRY:
        raise FinetuningError(f"Unknown task {task!r}: --task must be one of {', '.join(TASK_REGISTRY)}.")
    for key, must_be_local in (("dataset", False), ("train_file", True), ("validation_file", True)):
        if values.get(key) is not None:
            local_data(values[key], must_be_local=must_be_local, error=FinetuningError)
    for key in ("model", "tokenizer"):
        if values.get(key) is not None:
            check_model_location(values[key])
    _check_run_folder(values, finetuning.FinetuningSettings, finetuning.check_run_folder)
    return values


# ---------------------------------------------------------------------------------------------------------------------
# publish, evaluate
# ---------------------------------------------------------------------------------------------------------------------

PUBLISH_DESCRIPTION = """\
Publish a saved coreformer folder to a Hub model repository (a thin command line over coreformer.hub.publishing).

    coreformer publish outputs/decoder-tiny --repo-id me/coreformer-decoder-tiny [--private] [--revision dev]

Checks the folder first (config.json, safetensors weights, a valid model card) and stops with one message when
something is missing; then pushes config, safetensors weights, modeling code, tokenizer files and README.md in one
commit. The Hub is huggingface_hub's endpoint: set HF_ENDPOINT to use another. The token comes from --token, HF_TOKEN
or `hf auth login`. Exit codes: 0 pushed, 2 the folder cannot be published, 1 the Hub refused or failed, 130 stopped
by Ctrl-C.
"""


def _publish_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="the folder save_pretrained (or pretraining / coreformer convert) wrote")
    parser.add_argument("--repo-id", required=True, help="model repository, owner/name")
    parser.add_argument("--private", action="store_true", help="create the repository private (if it is new)")
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the stored login)")
    parser.add_argument("--revision", default=None, help="branch to commit to (created from main if missing)")
    parser.add_argument("--commit-message", default=None, help="the commit's summary line")


def _prepare_evaluate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> evaluation.EvaluationSettings:
    try:
        settings = evaluation.settings_from(args)
    except ValueError as error:
        parser.error(str(error))
    check_model_location(settings.folder)  # a mistyped folder: one line, before torch is imported
    return settings


# ---------------------------------------------------------------------------------------------------------------------
# The handlers, imported once a command's inputs passed their checks (importing the package imports torch)
# ---------------------------------------------------------------------------------------------------------------------


def _pretrain_handler() -> Handler:
    from coreformer.commands.runs import pretrain

    return pretrain


def _finetune_handler() -> Handler:
    from coreformer.commands.runs import finetune

    return finetune


def _evaluate_handler() -> Handler:
    from coreformer.commands.runs import evaluate

    return evaluate


def _publish_handler() -> Handler:
    from coreformer.commands.runs import publish

    return publish


def _convert_handler() -> Handler:
    from coreformer.commands.convert import convert

    return convert


def _export_handler() -> Handler:
    from coreformer.commands.export import export

    return export


def _attention_map_handler() -> Handler:
    from coreformer.commands.attention_map import attention_map

    return attention_map


def _tokenize_handler() -> Handler:
    from coreformer.commands.tokenize import tokenize

    return tokenize


COMMANDS: dict[str, Command] = {
    command.name: command
    for command in (
        Command(
            "pretrain",
            "pretrain an encoder, decoder or seq2seq model from scratch (a preset, a config file, your own text)",
            _pretrain_arguments,
            _pretrain_handler,
            description=PRETRAIN_DESCRIPTION,
            prepare=_prepare_pretrain,
            interrupted="stopped outside a training step; run the same command with --resume-from-checkpoint latest "
            "to go on from the newest checkpoint (or start, when there is none)",
        ),
        Command(
            "finetune",
            "fine-tune a coreformer folder on a task (classification, NER, QA, causal LM, seq2seq, multiple choice)",
            _finetune_arguments,
            _finetune_handler,
            description=FINETUNE_DESCRIPTION,
            prepare=_prepare_finetune,
            interrupted="stopped before or after the training steps; the final folder was not written. Run the "
            "command again (after training, --resume-from-checkpoint latest continues from its last checkpoint)",
        ),
        Command(
            "evaluate",
            "zero-shot evaluation of a pretrained folder: held-out loss, perplexity and minimal-pair accuracy",
            evaluation.add_arguments,
            _evaluate_handler,
            description=evaluation.DESCRIPTION,
            prepare=_prepare_evaluate,
            interrupted="stopped by Ctrl-C before it finished; nothing was written, run the same command again",
        ),
        Command(
            "publish",
            "push a saved folder (weights, code, tokenizer, card) to a Hub model repository in one commit",
            _publish_arguments,
            _publish_handler,
            description=PUBLISH_DESCRIPTION,
            prepare=lambda args, parser: vars(args),
            interrupted="stopped by Ctrl-C before it finished; the folder goes up in one commit, so the repository "
            "holds all of it or none of it; run the same command again",
        ),
        Command(
            "convert",
            f"convert a local transformers folder ({native_list()}) to coreformer",
            add_convert_arguments,
            _convert_handler,
            prepare=_check(local_folders=("src",)),
            interrupted="stopped by Ctrl-C before it finished; run the same command again (convert writes its output "
            "whole, at the end)",
        ),
        Command(
            "export",
            "export a coreformer (or native) folder to a native transformers architecture, ONNX or GGUF (to serve "
            "without coreformer)",
            add_export_arguments,
            _export_handler,
            prepare=_check(local_folders=("folder",)),
            interrupted="stopped by Ctrl-C before it finished; run the same command again (export writes its output "
            "whole, at the end)",
        ),
        Command(
            "attention-map",
            "plot a saved model's attention probabilities for a text",
            add_attention_map_arguments,
            _attention_map_handler,
            prepare=_check(model_locations=("folder",)),
        ),
        Command(
            "tokenize",
            "tokenize text once into shards of token ids for pretraining (in parallel, resumable)",
            tokenizing.add_arguments,
            _tokenize_handler,
            description=tokenizing.DESCRIPTION,
            prepare=tokenizing.prepare,
            interrupted="stopped by Ctrl-C; the shards written so far are kept (manifest.json lists them): run the "
            "same command again to go on from the last one",
        ),
    )
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: `--help` lists the subcommands, `--version`; each subcommand parses with its own."""
    parser = SuggestingParser(prog=PROGRAM, description="coreformer command-line tools")
    add_version_argument(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        commands.add_parser(command.name, help=command.help, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`coreformer ARGS`: the subcommand parses, checks and runs its own arguments; anything else (no command, an
    unknown one, --help, --version) is answered by the top-level parser, which exits."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]].main(argv[1:])
    build_parser().parse_args(argv)
    return USAGE_ERROR  # not reached: argparse exits on every argv that names no command


if __name__ == "__main__":
    sys.exit(main())
