"""The run command lines, importable without torch (beside the package, as coreformer_cli is): `coreformer pretrain |
finetune | publish | evaluate`, and the clone's training/pretrain.py, finetune.py, publish.py, which call the same
functions (one parser and one help text each).

    RunCommand(name, help, description, add_arguments, run)   one command line
    RUN_COMMANDS                        name -> RunCommand (or DelegatedCommand: `evaluate`, parsed and run by
                                        coreformer_settings.evaluation and coreformer.training.zero_shot)
    RunCommand.build_parser(prog)       its argparse parser, `prog` naming the program in usage and errors
    RunCommand.main(argv, prog)         parse, check the folders it names (still torch-free), run; the exit code
    after_imports()                     what every command does once its heavy imports are done (gc.freeze)

Each `run` imports the package (and with it torch) only after its arguments are parsed and its folders checked, so
`--help`, `--version` and a mistyped folder answer at once. The work itself lives in the package:
coreformer.training.pretraining, coreformer.training.finetuning, coreformer.publishing. Exit codes: 0 done, 2 a bad
input (one line on stderr, nothing written), 1 the Hub refused an upload, 130 stopped by Ctrl-C.
"""

import argparse
import gc
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from coreformer_settings import command_line, finetuning, pretraining
from coreformer_settings.base import INTERRUPTED, FinetuningError, PretrainingError, RunStoppedError, load_config_file
from coreformer_settings.pretraining import PRESETS, default_configs_dir, gather_settings, preset_defaults

USAGE_ERROR = 2  # as coreformer_cli.USAGE_ERROR: argparse's exit code for a bad command line
HUB_FAILED = 1


@dataclass(frozen=True)
class RunCommand:
    """One run command line: its arguments and the function that runs it (`(parsed, prog) -> exit code`)."""

    name: str
    help: str  # one line, for `coreformer --help`
    description: str  # `--help`'s text
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[dict, str], int]

    def build_parser(self, prog: str | None = None) -> argparse.ArgumentParser:
        parser = command_line.SuggestingParser(
            prog=prog or f"coreformer {self.name}",
            description=self.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.add_arguments(parser)
        command_line.add_version_argument(parser)
        return parser

    def main(self, argv: list[str] | None = None, prog: str | None = None) -> int:
        prog = prog or f"coreformer {self.name}"
        return self.run(vars(self.build_parser(prog).parse_args(argv)), prog)


def after_imports() -> None:
    """What each command (and each of coreformer_cli's) does once torch, transformers and the package are imported:
    the half a million objects those imports made live as long as the process, so they leave the garbage
    collector's sight (gc.freeze). Otherwise every full collection walks them all again: a tiny run makes several,
    and the interpreter's exit more (benchmarks/command_startup.py times both). Only the commands do this, never the
    package: a command owns its process, a user's Python session is not ours."""
    gc.freeze()


def _stopped(prog: str, message: str) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return INTERRUPTED


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


def _pretrain(given: dict, prog: str) -> int:
    preset, config, family = given.pop("preset", None), given.pop("config", None), given.pop("family", None)
    try:
        settings = dict(family=family, preset=preset, config_file=config, overrides=given)
        values = gather_settings(**settings)[0]
        # a mistyped --tokenizer or --resume-from-checkpoint folder (given here, in the preset or in --config): one
        # line, before torch is imported or the Hub is asked
        if values.get("tokenizer") is not None:
            command_line.check_model_location(values["tokenizer"])
        if values.get("resume_from_checkpoint") not in (None, "latest"):
            command_line.check_local_folder(values["resume_from_checkpoint"])
        from coreformer.training.pretraining import resolve_arguments, run_pretraining  # torch: after the checks

        after_imports()
        run_pretraining(resolve_arguments(**settings))
    except (PretrainingError, command_line.NoSuchFolderError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except RunStoppedError as stopped:
        return _stopped(prog, str(stopped))
    except KeyboardInterrupt:  # before the first step or while the final folder is written (atomically)
        return _stopped(
            prog,
            "stopped outside a training step; run the same command with --resume-from-checkpoint latest to go on "
            "from the newest checkpoint (or start, when there is none)",
        )
    return 0


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


def _finetune(given: dict, prog: str) -> int:
    config = given.pop("config", None)
    try:
        # a mistyped --model or --tokenizer folder (given here or in --config): one line, before torch or the Hub
        values = {**(load_config_file(config, error=FinetuningError) if config is not None else {}), **given}
        for key in ("model", "tokenizer"):
            if values.get(key) is not None:
                command_line.check_model_location(values[key])
        from coreformer.training.finetuning import BEFORE, resolve_arguments, run_finetuning  # torch: after the checks

        after_imports()
        args = resolve_arguments(config_file=config, overrides=given)
        metrics = run_finetuning(args)
    except (FinetuningError, command_line.NoSuchFolderError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except RunStoppedError as stopped:
        return _stopped(prog, str(stopped))
    except KeyboardInterrupt:  # while loading, evaluating or saving: the output folder is only replaced complete
        return _stopped(
            prog,
            "stopped before or after the training steps; the final folder was not written. Run the command again "
            "(after training, --resume-from-checkpoint latest continues from its last checkpoint)",
        )
    shown = {key: round(value, 4) for key, value in metrics.items() if key.startswith("eval_")}
    before = {key: round(metrics[BEFORE + key], 4) for key in shown if BEFORE + key in metrics}
    print(f"done: {shown} (before training: {before})")
    if int(os.environ.get("RANK", "0")) == 0:  # once under a launcher, as pretraining prints its own
        from coreformer.training.reports import finetune_summary

        print(finetune_summary(args))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# publish
# ---------------------------------------------------------------------------------------------------------------------

PUBLISH_DESCRIPTION = """\
Publish a saved coreformer folder to a Hub model repository (a thin command line over coreformer.publishing).

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


def _publish(given: dict, prog: str) -> int:
    from coreformer.publishing import PublishError, publish_folder  # torch and transformers: only after parsing

    folder = given.pop("folder")
    try:
        url = publish_folder(folder, **given)
    except PublishError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return _stopped(
            prog,
            "stopped by Ctrl-C before it finished; the folder goes up in one commit, so the repository holds all of "
            "it or none of it; run the same command again",
        )
    except Exception as error:  # the Hub's answer (HfHubHTTPError, a refused token, no connection): say it once
        print(f"{prog}: the Hub did not take the upload: {type(error).__name__}: {error}", file=sys.stderr)
        return HUB_FAILED
    print(f"published {folder} -> {url}")
    return 0


RUN_COMMANDS = {
    command.name: command
    for command in (
        RunCommand(
            "pretrain",
            "pretrain an encoder, decoder or seq2seq model from scratch (a preset, a config file, your own text)",
            PRETRAIN_DESCRIPTION,
            _pretrain_arguments,
            _pretrain,
        ),
        RunCommand(
            "finetune",
            "fine-tune a coreformer folder on a task (classification, NER, QA, causal LM, seq2seq, multiple choice)",
            FINETUNE_DESCRIPTION,
            _finetune_arguments,
            _finetune,
        ),
        RunCommand(
            "publish",
            "push a saved folder (weights, code, tokenizer, card) to a Hub model repository in one commit",
            PUBLISH_DESCRIPTION,
            _publish_arguments,
            _publish,
        ),
    )
}


@dataclass(frozen=True)
class DelegatedCommand:
    """A command whose own modules parse and run its command line: a torch-free parser, then `main(argv)`."""

    name: str
    help: str
    parser: str  # "module:function", `(prog) -> ArgumentParser`, importable without torch
    run: str  # "module:function", `(argv) -> exit code`, parsing again with the same parser

    def available(self) -> bool:
        return importlib.util.find_spec(self.parser.split(":")[0]) is not None

    def build_parser(self, prog: str | None = None) -> argparse.ArgumentParser:
        module, function = self.parser.split(":")
        return getattr(importlib.import_module(module), function)(prog or f"coreformer {self.name}")

    def main(self, argv: list[str] | None = None, prog: str | None = None) -> int:
        argv = sys.argv[1:] if argv is None else argv
        self.build_parser(prog).parse_args(argv)  # --help and a bad flag answer before torch is imported
        module, function = self.run.split(":")
        run = getattr(importlib.import_module(module), function)
        after_imports()
        return run(argv)


EVALUATE = DelegatedCommand(
    "evaluate",
    "zero-shot evaluation of a pretrained folder: held-out loss, perplexity and minimal-pair accuracy",
    "coreformer_settings.evaluation:build_parser",
    "coreformer.training.zero_shot:main",
)
if EVALUATE.available():  # it ships with coreformer.training.zero_shot
    RUN_COMMANDS[EVALUATE.name] = EVALUATE
