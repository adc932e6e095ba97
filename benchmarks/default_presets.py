"""The default presets as a user runs them: `coreformer pretrain --family F` (preset `tiny`, nothing else set),
timed end to end on this machine (a fresh process: imports, data, tokenizer, steps, evaluations, saving, the final
zero-shot report), then its folder scored by `coreformer evaluate` at fixed settings with 200 minimal pairs:

    wall time          the whole command, as a user waits for it (compares only on a quiet machine)
    training time      the steps alone (metrics.json's train_time_s)
    held-out loss      the family's objective at fixed settings (masked LM at 15%, causal LM, denoising at 30%),
                       beside the unigram entropy of the held-out text (a loss well below it means context was learned)
    minimal pairs      a held-out line against its corruption, by (pseudo-)likelihood; chance 0.5

Writes results/default_presets.json and default_presets.md (machine, date and command at the top).

    python benchmarks/default_presets.py                       # every family, on a quiet machine
    python benchmarks/default_presets.py --families encoder
    python benchmarks/default_presets.py --tiny                # a smoke run: a few steps of tiny models (the test)
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_files import write_results

from coreformer.training.zero_shot import evaluate_folder

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("encoder", "decoder", "seq2seq")
TINY_FLAGS = [  # --tiny: a few steps of small models on a few documents
    "--max-steps", "3", "--max-documents", "12", "--vocab-size", "384", "--block-size", "32", "--batch-size", "4",
    "--eval-batches", "1", "--zero-shot-pairs", "4",
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--pairs", type=int, default=200, help="minimal pairs scored by coreformer evaluate")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'under load from other jobs')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="a few steps of tiny models: a smoke run")
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "benchmarks/default_presets.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def pretrain_and_evaluate(family: str, args: argparse.Namespace, work: Path) -> dict:
    """`coreformer pretrain --family FAMILY` in a fresh process, timed, and its folder scored."""
    folder = work / family
    command = [sys.executable, "-m", "coreformer_cli", "pretrain", "--family", family, "--output-dir", str(folder)]
    command += ["--report-to", "none", *(TINY_FLAGS if args.tiny else [])]
    started = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    metrics = json.loads((folder / "metrics.json").read_text())
    report = evaluate_folder(folder, pairs=4 if args.tiny else args.pairs, batches=2 if args.tiny else 20)
    held_out = report["held_out"]
    return {
        "family": family,
        "command": shlex.join(["coreformer", *command[3:]]).replace(str(folder), "DIR"),
        "steps": metrics["steps"],
        "threads": metrics["threads"],
        "wall_time_s": wall,
        "train_time_s": metrics["train_time_s"],
        "held_out_objective": held_out["objective"],
        "held_out_loss": held_out["loss"],
        "unigram_entropy": held_out["unigram_entropy"],
        "minimal_pair_accuracy": report["minimal_pairs"]["accuracy"],
        "minimal_pairs": report["minimal_pairs"]["pairs"],
        "parameters": report["parameters"],
    }


def markdown(report: dict) -> str:
    lines = [
        "# The default presets, as a user runs them",
        "",
        f"- machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs"
        + (f" ({report['note']})" if report["note"] else ""),
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        "",
        "| family | steps | threads | wall time (s) | training time (s) | held-out loss | unigram entropy | below it | "
        "minimal-pair accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['family']} | {row['steps']} | {row['threads']} | {row['wall_time_s']:.1f} | "
            f"{row['train_time_s']:.1f} | "
            f"{row['held_out_loss']:.4f} ({row['held_out_objective']}) | {row['unigram_entropy']:.4f} | "
            f"{row['unigram_entropy'] - row['held_out_loss']:.3f} | {row['minimal_pair_accuracy']:.3f} "
            f"({row['minimal_pairs']}) |"
        )
    lines += [
        "",
        "Each row's command: " + "; ".join(f"`{row['command']}`" for row in report["results"]) + ". A run gives a "
        "row's numbers to the last digit on the row's threads (`--threads N`); on another count its float sums run in "
        "another order, which moves them in the later digits (the runs choose their threads from the machine).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": args.command,
        "note": args.note,
        "results": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families:
            report["results"].append(pretrain_and_evaluate(family, args, Path(scratch)))
    name = "default_presets_tiny" if args.tiny else "default_presets"
    table = markdown(report)
    write_results(args.output_dir, name, report, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
