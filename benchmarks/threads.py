"""Pretraining beside a busy process: torch's default threads against the threads a run now chooses
(coreformer.training.threads), the default decoder (`--family decoder --preset tiny`) for a few steps:

    torch's default    --threads N, N the machine's cores: what torch takes whatever else runs (the runs' behaviour
                       before they chose)
    chosen             no flag and no OMP_NUM_THREADS: the cores left by the busy process

One busy process (a Python loop) runs beside every run, as a laptop's other job does; the two settings alternate
(A B B A ...) so that a machine that slows down slows both, and each run's training tokens per second come from its
metrics.json (steps only: data, tokenizer and saving are not timed). The ratio of the medians is the row's result;
each run's losses are checked equal (threads change the speed, never what is computed... up to float reduction order,
so the largest loss difference is reported).

Writes results/threads.json and threads.md (machine, date and command at the top).

    python benchmarks/threads.py --note "nothing else running"
    python benchmarks/threads.py --steps 3 --pairs 1 --output-dir /tmp/threads    # a smoke run
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_files import report_head, results_header, write_results

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps of each run")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each setting (alternating A B B A ...)")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'nothing else running')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "benchmarks/threads.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def run(threads: int | None, steps: int, folder: Path) -> dict:
    """One pretraining run beside whatever runs now; its metrics.json and the engine line it printed."""
    command = [sys.executable, str(ROOT / "training" / "pretrain.py"), "--family", "decoder", "--preset", "tiny"]
    command += ["--max-steps", str(steps), "--eval-every", "0", "--save-every", "0", "--zero-shot-pairs", "0"]
    command += ["--output-dir", str(folder), "--overwrite"]
    if threads is not None:
        command += ["--threads", str(threads)]
    environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    environment["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
    engine = next(line for line in done.stdout.splitlines() if line.startswith("engine:"))
    metrics = json.loads((folder / "metrics.json").read_text())
    return {"tokens_per_second": metrics["tokens_per_second"], "engine": engine, "losses": train_losses(metrics)}


def train_losses(metrics: dict) -> list[float]:
    return [record["loss"] for record in metrics["history"]["train"]]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = {"torch's default": cores, "chosen": None}
    order = [name for pair in range(args.pairs) for name in (list(settings)[:: 1 if pair % 2 == 0 else -1])]
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with tempfile.TemporaryDirectory(prefix="coreformer-threads-") as scratch:
            for index, name in enumerate(order):
                runs[name].append(run(settings[name], args.steps, Path(scratch) / f"run-{index}"))
    finally:
        busy.kill()
        busy.wait()
    report = report_head(args) | {"cores": cores, "runs": runs}
    speed = {name: statistics.median(r["tokens_per_second"] for r in runs[name]) for name in settings}
    report["ratio"] = speed["chosen"] / speed["torch's default"]
    losses = [r["losses"] for name in settings for r in runs[name]]
    report["largest_loss_difference"] = max(abs(a - b) for other in losses for a, b in zip(losses[0], other))
    lines = results_header("Pretraining beside one busy process: torch's default threads against the chosen", report)
    lines += [
        "",
        f"The default decoder (`--preset tiny`), {args.steps} steps per run, {args.pairs} runs of each setting "
        f"alternating, beside one busy Python process on {cores} cores; training tokens per second from each run's "
        "metrics.json (medians).",
        "",
        "| threads | engine line | tokens/s (median) | runs |",
        "|---|---|---|---|",
    ]
    for name in settings:
        engine = runs[name][0]["engine"].split("mixed precision ", 1)[1].split(", ", 1)[1]  # the threads' words
        each = ", ".join(f"{r['tokens_per_second']:,.0f}" for r in runs[name])
        lines.append(f"| {name} | {engine} | {speed[name]:,.0f} | {each} |")
    lines += [
        "",
        f"Chosen against torch's default: **{report['ratio']:.2f}x** the tokens per second; the largest difference "
        f"between the runs' training losses is {report['largest_loss_difference']:.2g}.",
        "",
    ]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_results(args.output_dir, "threads", report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
