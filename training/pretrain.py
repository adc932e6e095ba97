"""Pretrain a coreformer encoder (MLM), decoder (causal LM) or seq2seq model (BART denoising) with Accelerate;
--objective picks another objective for the family.

    python training/pretrain.py --family decoder --preset tiny --output-dir outputs/decoder-tiny
    accelerate launch training/pretrain.py --family encoder --preset small --output-dir outputs/encoder-small
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 training/pretrain.py --family decoder ...
    accelerate launch --config_file training/configs/accelerate/fsdp.yaml training/pretrain.py --config FILE ...

Settings come from the dataclass defaults, then the preset (training/configs/{family}-{preset}.yaml; default tiny) or
--config FILE (YAML/JSON: the same keys plus `model:`, the family config's fields), then the flags given here. Rerun
with --resume-from-checkpoint latest to continue a run from its newest checkpoint (bit-identical on CPU).
Everything lives in coreformer.training.pretraining; this file only parses the command line.
"""

import argparse
import sys
from pathlib import Path

# torch-free imports only (the package's run module, which imports torch, comes in main after parsing)
from coreformer_cli import (
    USAGE_ERROR,
    NoSuchFolderError,
    add_version_argument,
    check_local_folder,
    check_model_location,
)
from coreformer_settings.base import INTERRUPTED, PretrainingError, RunStoppedError
from coreformer_settings.pretraining import PRESETS, add_settings_flags, gather_settings, preset_defaults

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=PRESETS, help="model + run settings from training/configs (default: tiny)")
    source.add_argument("--config", metavar="FILE", help="a YAML/JSON file of model + run settings")
    # only flags given override the preset / config; the help shows what each preset sets
    add_settings_flags(parser, default_text=preset_defaults(CONFIGS_DIR))
    add_version_argument(parser)
    return parser


def check_locations(values: dict) -> None:
    """A mistyped --tokenizer or --resume-from-checkpoint folder (given here, in the preset or in --config): one line,
    before torch is imported or the Hub is asked."""
    if values.get("tokenizer") is not None:
        check_model_location(values["tokenizer"])
    if values.get("resume_from_checkpoint") not in (None, "latest"):
        check_local_folder(values["resume_from_checkpoint"])


def main(argv: list[str] | None = None) -> int:
    given = vars(build_parser().parse_args(argv))
    preset, config = given.pop("preset", None), given.pop("config", None)
    family = given.pop("family", None)
    try:
        settings = dict(family=family, preset=preset, config_file=config, overrides=given, configs_dir=CONFIGS_DIR)
        check_locations(gather_settings(**settings)[0])
        from coreformer.training.pretraining import resolve_arguments, run_pretraining  # torch: after the checks

        run_pretraining(resolve_arguments(**settings))
    except (PretrainingError, NoSuchFolderError) as error:
        print(f"pretrain.py: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except RunStoppedError as stopped:
        print(f"pretrain.py: {stopped}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:  # before the first step or while the final folder is written (atomically)
        print(
            "pretrain.py: stopped outside a training step; run the same command with --resume-from-checkpoint latest "
            "to go on from the newest checkpoint (or start, when there is none)",
            file=sys.stderr,
        )
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
