"""`coreformer evaluate` as a script in the clone (the same parser, help and run: coreformer_cli): zero-shot evaluation
of a pretrained folder, held-out loss and perplexity, minimal-pair accuracy.

    python training/zero_shot.py FOLDER [--data FILES] [--json]

The evaluation lives in coreformer.training.zero_shot; this file only hands over the command line. Not named
evaluate.py: a script's folder comes first on sys.path, and that name would shadow the `evaluate` package for the
scripts beside it.
"""

import sys

from coreformer_cli import COMMANDS

COMMAND = COMMANDS["evaluate"]


def build_parser():
    return COMMAND.build_parser("zero_shot.py")


def main(argv: list[str] | None = None) -> int:
    return COMMAND.main(argv, "zero_shot.py")


if __name__ == "__main__":
    sys.exit(main())
