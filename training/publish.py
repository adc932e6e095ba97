"""`coreformer publish` as a script in the clone (the same parser, help and run: coreformer_cli).

    python training/publish.py outputs/decoder-tiny --repo-id me/coreformer-decoder-tiny [--private] [--revision dev]

The upload lives in coreformer.hub.publishing; this file only hands over the command line.
"""

import sys

from coreformer_cli import COMMANDS

COMMAND = COMMANDS["publish"]


def build_parser():
    return COMMAND.build_parser("publish.py")


def main(argv: list[str] | None = None) -> int:
    return COMMAND.main(argv, "publish.py")


if __name__ == "__main__":
    sys.exit(main())
