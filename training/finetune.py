"""`coreformer finetune` as a script in the clone (the same parser, help and run: coreformer_cli).

    python training/finetune.py --task sequence-classification --model outputs/encoder-tiny --output-dir out/cls
    accelerate launch --config_file training/configs/accelerate/fsdp.yaml training/finetune.py --task ...

The run lives in coreformer.training.finetuning; this file only hands over the command line.
"""

import sys

from coreformer_cli import COMMANDS

COMMAND = COMMANDS["finetune"]


def build_parser():
    return COMMAND.build_parser("finetune.py")


def main(argv: list[str] | None = None) -> int:
    return COMMAND.main(argv, "finetune.py")


if __name__ == "__main__":
    sys.exit(main())
