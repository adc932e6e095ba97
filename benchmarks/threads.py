"""Pretraining beside a busy process: torch's default threads against the threads a run now chooses
(coreformer.training.threads), the default decoder (`--family decoder --preset tiny`) for a few steps:

    torch's default    --threads N, N the machine's cores: what torch takes whatever else runs (the runs' behaviour
                       before they chose)
    chosen             no flag and no OMP_NUM_THREADS: the cores left by the busy process

One busy process runs beside every run, as a laptop's other job does: a Python loop (one core), a torch job (matrix
products on torch's default threads), or an earlier pretraining run (the same default decoder, started on the idle
machine and so on every core, measured once it is training). The two settings alternate (A B B A ...) so
that a machine that slows down slows both, and each run's training tokens per second come from its metrics.json
(steps only: data, tokenizer and saving are not timed). The ratio of the medians is each row's result; the largest
difference between the runs' training losses is reported beside it (threads change the speed, and what is computed
only by the order of float sums).

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
import time
from pathlib import Path

from results_files import report_head, results_header, write_results

ROOT = Path(__file__).resolve().parents[1]
# what runs beside each pretraining run -> its program
BUSY = {
    "a Python loop": "while True: pass",
    "a torch job": "import torch\nx = torch.randn(512, 512)\nwhile True: x = torch.tanh(x @ x)",
    "an earlier pretraining run": None,  # pretrain_command(), on every core
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps of each run")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each setting (alternating A B B A ...)")
    parser.add_argument("--busy", nargs="+", default=list(BUSY), choices=list(BUSY), help="what runs beside")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'nothing else running')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "benchmarks/threads.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def pretrain_command(threads: int | None, steps: int, folder: Path) -> list[str]:
    """The default decoder's pretraining for `steps` steps into `folder`, on `threads` (None: the run chooses)."""
    command = [sys.executable, str(ROOT / "training" / "pretrain.py"), "--family", "decoder", "--preset", "tiny"]
    command += ["--max-steps", str(steps), "--eval-every", "0", "--save-every", "0", "--zero-shot-pairs", "0"]
    command += ["--output-dir", str(folder), "--overwrite"]
    return command + ([] if threads is None else ["--threads", str(threads)])


def run_environment() -> dict[str, str]:
    """This environment without OMP_NUM_THREADS (so that only the flag or the run's choice decides), offline."""
    return {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"} | {"HF_HUB_OFFLINE": "1"}


def run(threads: int | None, steps: int, folder: Path) -> dict:
    """One pretraining run beside whatever runs now; its metrics.json and the engine line it printed."""
    command = pretrain_command(threads, steps, folder)
    done = subprocess.run(command, capture_output=True, text=True, env=run_environment(), check=True)
    engine = next(line for line in done.stdout.splitlines() if line.startswith("engine:"))
    metrics = json.loads((folder / "metrics.json").read_text())
    return {"tokens_per_second": metrics["tokens_per_second"], "engine": engine, "losses": train_losses(metrics)}


def train_losses(metrics: dict) -> list[float]:
    return [record["loss"] for record in metrics["history"]["train"]]


def start_busy(program: str | None, cores: int, scratch: Path) -> subprocess.Popen:
    """The busy process: `program` under Python, or (None) a pretraining run on every core, returned once it trains
    (its progress bar has begun), so that its data preparation is not what the measured runs share the machine with."""
    if program is not None:
        return subprocess.Popen([sys.executable, "-c", program])
    log = scratch / "busy.log"
    command = pretrain_command(cores, 10**9, scratch / "busy")
    with log.open("w") as sink:
        busy = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=run_environment())
    while "pretraining:" not in log.read_text() and busy.poll() is None:
        time.sleep(1)
    if busy.poll() is not None:
        raise SystemExit(f"the busy pretraining run ended before it trained:\n{log.read_text()[-2000:]}")
    return busy


def beside(program: str | None, settings: dict[str, int | None], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Each setting's runs, alternating, beside one busy process (start_busy)."""
    order = [name for pair in range(args.pairs) for name in (list(settings)[:: 1 if pair % 2 == 0 else -1])]
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory(prefix="coreformer-threads-") as scratch:
        busy = start_busy(program, settings["torch's default"], Path(scratch))
        try:
            for index, name in enumerate(order):
                runs[name].append(run(settings[name], args.steps, Path(scratch) / f"run-{index}"))
        finally:
            busy.kill()
            busy.wait()
    return runs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = {"torch's default": cores, "chosen": None}
    report = report_head(args) | {"cores": cores, "beside": {}}
    for kind in args.busy:
        runs = beside(BUSY[kind], settings, args)
        speed = {name: statistics.median(r["tokens_per_second"] for r in runs[name]) for name in settings}
        losses = [r["losses"] for name in settings for r in runs[name]]
        report["beside"][kind] = {
            "runs": runs,
            "ratio": speed["chosen"] / speed["torch's default"],
            "largest_loss_difference": max(abs(a - b) for other in losses for a, b in zip(losses[0], other)),
        }
    lines = results_header("Pretraining beside one busy process: torch's default threads against the chosen", report)
    lines += [
        "",
        f"The default decoder (`--preset tiny`), {args.steps} steps per run, {args.pairs} runs of each setting "
        f"alternating, beside one busy process on {cores} cores; training tokens per second from each run's "
        "metrics.json (medians; each run's in the last column).",
        "",
        "| beside | threads | engine line | tokens/s | runs | chosen against torch's default |",
        "|---|---|---|---|---|---|",
    ]
    for kind, result in report["beside"].items():
        for name, runs in result["runs"].items():
            engine = runs[0]["engine"].split("mixed precision ", 1)[1].split(", ", 1)[1]  # the threads' words
            speed = statistics.median(r["tokens_per_second"] for r in runs)
            each = ", ".join(f"{r['tokens_per_second']:,.0f}" for r in runs)
            ratio = f"**{result['ratio']:.2f}x**" if name == "chosen" else ""
            lines.append(f"| {kind} | {name} | {engine} | {speed:,.0f} | {each} | {ratio} |")
    differences = max(result["largest_loss_difference"] for result in report["beside"].values())
    lines += ["", f"The largest difference between two runs' training losses: {differences:.2g}.", ""]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_results(args.output_dir, "threads", report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
