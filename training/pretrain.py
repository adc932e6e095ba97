"""`coreformer pretrain` as a script in the clone (the same parser, help and run: coreformer_cli).

    python training/pretrain.py --family decoder --preset tiny --output-dir outputs/decoder-tiny
    accelerate launch training/pretrain.py --family encoder --preset small --output-dir outputs/encoder-small
    accelerate launch --config_file training/configs/accelerate/fsdp.yaml training/pretrain.py --config FILE ...

The run lives in coreformer.training.pretraining; this file only hands over the command line.
"""

import sys

from coreformer_cli import COMMANDS

COMMAND = COMMANDS["pretrain"]


def build_parser():
    return COMMAND.build_parser("pretrain.py")


def main(argv: list[str] | None = None) -> int:
    return COMMAND.main(argv, "pretrain.py")


if __name__ == "__main__":
    sys.exit(main())
