"""What a small `coreformer` command costs besides its work: the imports, and the garbage collector walking what they
made. Each command runs in a fresh process, timed whole (wall and CPU seconds, the child's user + system time):

    imports            python -c "import coreformer.training.<module>", nothing run: the floor under every run
    pretrain           `coreformer pretrain --family decoder` at a few steps of a tiny model (--steps)
    finetune           `coreformer finetune --task causal-lm` of that folder, a few steps
    evaluate           `coreformer evaluate` of that folder, a few minimal pairs

each twice: as shipped (coreformer_cli.after_imports freezes what the imports made, so no full collection walks
it again), and with that call made a no-op, the collector as Python sets it. The rows alternate (one of each arm,
`--repeats` times), so a machine that slows down slows both; the table keeps the fastest of each (interference only
adds time) and the median.

Writes results/command_startup.json and command_startup.md (machine, date and command at the top).

    python benchmarks/command_startup.py                 # on a quiet machine
    python benchmarks/command_startup.py --repeats 1 --output-dir /tmp/startup   # a smoke run (the test)
"""

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_files import report_head, results_header, write_results

ROOT = Path(__file__).resolve().parents[1]
TINY_PRETRAIN = [
    "--max-steps", "4", "--warmup-steps", "1", "--eval-every", "4", "--eval-batches", "1", "--save-every", "2",
    "--report-to", "none", "--max-documents", "40", "--batch-size", "4", "--block-size", "32", "--vocab-size", "512",
]  # fmt: skip
TINY_FINETUNE = ["--max-steps", "2", "--max-train-examples", "16", "--max-eval-examples", "4", "--max-length", "32"]
# Each arm writes the same folders again: the pretrained one its fine-tunings read, and theirs.
AGAIN = ["--overwrite"]
# arm -> (the code a command runs under, the code that follows an import-only row's import)
ARMS = {
    "as shipped": ("", "import coreformer_cli; coreformer_cli.after_imports()"),
    "collector untouched": ("import coreformer_cli; coreformer_cli.after_imports = lambda: None\n", ""),
}
# One process per command and arm: `coreformer_cli.main` is what the console script runs.
RUN_CLI = "import sys, coreformer_cli\n{patch}sys.exit(coreformer_cli.main(sys.argv[1:]))"


def commands(folder: Path) -> dict[str, list[str] | str]:
    """name -> a coreformer command's arguments, or the module an import-only row imports."""
    pretrained = folder / "pretrained"
    return {
        "imports (pretraining)": "coreformer.training.pretraining",
        "imports (fine-tuning)": "coreformer.training.finetuning",
        "pretrain": ["pretrain", "--family", "decoder", "--output-dir", str(pretrained), *TINY_PRETRAIN, *AGAIN],
        "finetune": ["finetune", "--task", "causal-lm", "--model", str(pretrained), "--output-dir", str(folder / "ft")]
        + TINY_FINETUNE
        + AGAIN,
        "evaluate": ["evaluate", str(pretrained), "--pairs", "8", "--batches", "2"],
    }


def timed(code: str, arguments: list[str]) -> dict[str, float]:
    """One fresh process, `python -c code *arguments`: its wall and CPU seconds (it must succeed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", code, *arguments],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode != 0:
        raise SystemExit(f"{code} {shlex.join(arguments)} failed (exit {child.returncode}):\n{child.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def measure(args: argparse.Namespace, folder: Path) -> list[dict]:
    rows = []
    for name, what in commands(folder).items():
        times: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for _ in range(args.repeats):
            for arm, (patch, after_import) in ARMS.items():
                if isinstance(what, str):
                    times[arm].append(timed(f"import {what}\n{after_import}", []))
                else:
                    times[arm].append(timed(RUN_CLI.format(patch=patch), what))
        for arm, runs in times.items():
            rows.append(
                {
                    "command": name,
                    "arm": arm,
                    "runs": runs,
                    **{f"min_{key}": min(run[key] for run in runs) for key in ("wall_s", "cpu_s")},
                    **{f"median_{key}": statistics.median(run[key] for run in runs) for key in ("wall_s", "cpu_s")},
                }
            )
            print(f"  {name:22s} {arm:20s} wall {rows[-1]['min_wall_s']:6.2f} s  cpu {rows[-1]['min_cpu_s']:6.2f} s")
    return rows


def markdown(report: dict) -> str:
    lines = results_header("What a small coreformer command costs besides its work", report)
    lines += [
        "",
        "Each row: a fresh process, the fastest and the median of its runs (CPU = the process's user + system time).",
        "`collector untouched`: the same command with `coreformer_cli.after_imports` made a no-op (an imports "
        "row: the import alone; as shipped, the import then `after_imports()`).",
        "",
        "| command | arm | wall, fastest (s) | wall, median (s) | CPU, fastest (s) | CPU, median (s) |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['command']} | {row['arm']} | {row['min_wall_s']:.2f} | {row['median_wall_s']:.2f} | "
            f"{row['min_cpu_s']:.2f} | {row['median_cpu_s']:.2f} |"
        )
    lines += ["", "The commands' flags: `" + shlex.join(TINY_PRETRAIN) + "` (pretrain), `"]
    lines[-1] += shlex.join(TINY_FINETUNE) + "` (finetune), `--pairs 8 --batches 2` (evaluate).\n"
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command in each arm")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'under load from other jobs')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "benchmarks/command_startup.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = report_head(args)
    with tempfile.TemporaryDirectory() as scratch:
        report["results"] = measure(args, Path(scratch))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    table = markdown(report)
    write_results(args.output_dir, "command_startup", report, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
