"""The settings of `coreformer evaluate` (training/zero_shot.py), importable without torch: `--help` answers at once.

    EvaluationSettings               the folder, the held-out text and how much of it is scored
    DESCRIPTION, add_arguments(parser)   `--help`'s text and one flag per setting
    settings_from(namespace)         the parsed arguments -> EvaluationSettings; ValueError names a bad count

The command line (coreformer_cli) parses with these; `coreformer.commands.runs.evaluate` runs the evaluation
(coreformer.training.zero_shot).
"""

import argparse
from dataclasses import dataclass

DEFAULT_PAIRS = 200
HELD_OUT_DOCUMENTS = 400  # held-out documents read (a run's text, --data): enough lines and batches for the defaults
DEFAULT_BATCHES = 20
DEFAULT_BATCH_SIZE = 16
DEFAULT_SEED = 0


@dataclass(frozen=True)
class EvaluationSettings:
    """What `coreformer evaluate` scores."""

    folder: str  # a pretrained folder (config.json, weights, tokenizer)
    data: tuple[str, ...] = ()  # held-out text files; empty: the run's held-out split, or the embedded corpus'
    json: bool = False  # print the report as JSON instead of a table
    pairs: int = DEFAULT_PAIRS  # minimal pairs scored
    batches: int = DEFAULT_BATCHES  # held-out batches of the loss
    batch_size: int = DEFAULT_BATCH_SIZE
    seed: int = DEFAULT_SEED  # masking of the held-out loss, choice and corruption of the pairs


DESCRIPTION = (
    "Zero-shot evaluation of a pretrained folder, no fine-tuning: held-out loss and perplexity (masked LM at a fixed "
    "15% masking, causal LM, denoising at BART's 30%; encoders also their pseudo-perplexity) and minimal-pair accuracy "
    "(a held-out line against the same line corrupted, scored by log-likelihood or, for encoders, "
    "pseudo-log-likelihood; ties count as wrong)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="pretrained folder (a pretraining run's output directory, or any saved model)")
    parser.add_argument(
        "--data",
        nargs="+",
        default=(),
        metavar="FILE",
        help="held-out text files (.txt/.json/.jsonl/.csv/.parquet, globs allowed); default: the held-out split of "
        "the run's training text when the folder records it (run_config.json), else the embedded corpus'",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--pairs", type=int, default=DEFAULT_PAIRS, help="minimal pairs scored (default: %(default)s)")
    parser.add_argument(
        "--batches", type=int, default=DEFAULT_BATCHES, help="held-out batches of the loss (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="default: %(default)s")
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help="seed of the masking and the pairs (default: %(default)s)"
    )


def settings_from(namespace: argparse.Namespace) -> EvaluationSettings:
    for name in ("pairs", "batches", "batch_size"):
        if getattr(namespace, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(namespace, name)}")
    return EvaluationSettings(
        folder=namespace.folder,
        data=tuple(namespace.data),
        json=namespace.json,
        pairs=namespace.pairs,
        batches=namespace.batches,
        batch_size=namespace.batch_size,
        seed=namespace.seed,
    )
