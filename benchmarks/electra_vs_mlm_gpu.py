"""ELECTRA vs masked LM on one GPU at 3e15-1e16 training FLOPs (where the paper's curves start), in one call of at
most 10 minutes.

The backbone is the modern encoder recipe (training/configs/encoder-tiny-modern.yaml: pre-norm, rotary, GeGLU, no
biases, no dropout) at GPU size (--hidden-size 512, --layers 8), bf16 autocast, batches of 128 x 128 tokens. Each run
spends the same training FLOPs (steps = budget / FLOPs per step, from the model's shapes: benchmarks/electra_vs_mlm.py's
`training_flops`):

    masked-lm            30% masking (Wettig et al. 2023)
    electra, 1/4 width   15% masking, RTD weight 50 (Clark et al. 2020: generators of 1/4-1/2 width work best)
    electra, 1/2 width

The text (--corpus): at these budgets a run reads tens of millions of tokens. The standard library alone (the CPU
benchmarks' corpus, about 2.5 million tokens) would be read over and over: the one run on it, at 1e16 FLOPs (some
twenty passes, lr 1e-3), ended with its held-out loss above the unigram entropy, where the same recipe reading each
text about once (lr 5e-4) ends far below it. `installed` (the default) adds the Python source of the installed
packages (site-packages, a seeded sample of files up to --corpus-mb megabytes) to the standard library, written as
one JSON-lines file that every run reads; `stdlib` is the CPU benchmarks' corpus. Each text goes in once and its
near-duplicates not at all (half its 5-line windows in a text already in: packages vendor each other, and
transformers generates its models from each other), so a held-out file has no copy in training. Each run's epochs
(passes over its training rows) stand in its row: past 1 it reads text again.

The gates stand beside each result (benchmarks/electra_vs_mlm.py's `held_out_gates`): held-out MLM loss at 15%
masking (for ELECTRA: its generator's) against the unigram entropy of the training text (a model at the unigram stage
has learned no context), and ELECTRA's discriminator on held-out replacements by its own generator: ROC AUC (0.5: no
signal), RTD loss and accuracy against the best constant answer's (not below it: it learned nothing). Each run's
held-out loss during training (its own objective's, at --eval-points steps) shows where it went. Each encoder and a
randomly initialised one are then fine-tuned on --tasks (benchmarks/recipes.py's tasks: context ones and the lexical
control) with --seeds seeds, paired by seed against random init and ELECTRA against masked LM.

On a GPU (--parallel) each run trains in a process of its own, one after the other, its batches built by --num-workers
loader workers while the GPU computes (the same batches as without: each is seeded by its number); the fine-tunings
then run at the same time, one process per encoder and task. --runs-together trains the runs side by side, as the
calls before this one did (their files say so): see Sizing. FLOPs are the budget. Each stage's GPU utilization, as
nvidia-smi samples it each second, goes into the report: its mean and how often the GPU was idle. A run whose loss
diverges is reported with its error and the others go on. Results are written after the pretraining
and after each encoder's fine-tuning on each task, so a call cut off at its time limit keeps what it finished:
results/NAME.json and .md (--name; machine, packages, date and command at the top).

Sizing. At 1.5e15 FLOPs a run (results/electra_vs_mlm_gpu.md, an H200) the text, the tokenizer and the two runs side
by side took about 3 minutes, and the fine-tunings (2 learning rates on dev and 3 seeds, every encoder and task at
the same time) about 2.7 more. At 1e16 (results/electra_vs_mlm_gpu_1e16.md, batches of 512 rows) the setup before the
runs took about 1.3 minutes and the two runs side by side about 6; compiled (the same settings and --compile:
results/electra_vs_mlm_gpu_1e16_compiled.md) a little less, and both left the fine-tunings to a second call.
During the compiled call nvidia-smi, run beside the script, found the GPU idle in most of its samples while the two
runs shared it, and ELECTRA's steps ran several times faster once masked LM's run had ended: the runs were bound by
the host's side of each step and by sharing the GPU, not by its arithmetic. Hence the defaults: one run after the
other, each building its batches in loader workers while the GPU computes, and each stage's utilization sampled by
the script. How long a call takes that way is not measured on a GPU yet; until it is, 1e16 at this size may need two
calls: --work-dir keeps the text, the runs and the fine-tunings in a folder, and a second call with the same folder
and settings does only what the first did not finish. A wider model (--plan: 768 x 12 reads about half the text at
1e16) does more arithmetic per element it moves and is untried.

A larger budget at the same model size reads the text more times: --plan, on any machine, builds the text and the
tokenizer, then prints each run's steps and epochs for the settings given and trains nothing, so a budget and a model
size can be matched to the text before a GPU call is spent (a larger model spends more FLOPs per token).

    python benchmarks/electra_vs_mlm_gpu.py                      # on the GPU machine (wall_time_s says how long)
    python benchmarks/electra_vs_mlm_gpu.py --plan --flops-budget 1e16 --hidden-size 768 --layers 12
    python benchmarks/electra_vs_mlm_gpu.py --tiny               # a CPU smoke run of the same code
    python benchmarks/electra_vs_mlm_gpu.py --flops-budget 1e16 --work-dir /tmp/evm   # twice, on the same machine
"""

import argparse
import concurrent.futures
import contextlib
import datetime
import importlib.metadata
import json
import multiprocessing
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import datasets
import torch
from results_files import sibling, write_results

from coreformer.training.arguments import PretrainingError
from coreformer.training.corpora import read_source, stdlib_source_files
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.run import PretrainingArguments, resolve_arguments

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "transformers", "tokenizers", "datasets", "accelerate")  # the versions a results file names


EVM, RECIPES = sibling("electra_vs_mlm"), sibling("recipes")
VARIANTS = EVM.VARIANTS  # name -> (objective, its settings): the CPU benchmark's, sources in its docstring
LARGEST_SOURCE_FILE = 1_000_000  # bytes: larger .py files in site-packages are generated tables, not code
# A text is a near-duplicate when at least this share of its SHINGLE_LINES-line windows (stripped, blank lines out)
# is in a text already kept: generated copies (transformers' modular models) and vendored libraries of another version.
NEAR_DUPLICATE_SHARE, SHINGLE_LINES = 0.5, 5
SKIPPED_PACKAGE_DIRS = frozenset({"__pycache__", "test", "tests", "testing"})  # test suites: repetitive fixtures
PROGRESS = "progress.json"  # in --work-dir: what the calls so far finished
# Settings a call may change and still continue another's work: they decide no result.
SETTINGS_NOT_DECIDING = frozenset(
    {"note", "name", "output_dir", "work_dir", "command", "plan", "parallel", "runs_together", "num_workers"}
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flops-budget", type=float, default=3e15, help="training FLOPs of every run")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS)[:2], help="which runs, in this order"
    )
    parser.add_argument("--corpus", choices=("installed", "stdlib"), default="installed", help="the training text")
    parser.add_argument("--corpus-mb", type=float, default=120.0, help="installed: megabytes of package source")
    parser.add_argument(
        "--parallel",
        action=argparse.BooleanOptionalAction,
        default=torch.cuda.is_available(),
        help="each run and each fine-tuning in a process of its own, the fine-tunings at the same time (default: on a "
        "GPU)",
    )
    parser.add_argument(
        "--runs-together",
        action="store_true",
        help="with --parallel: train the runs side by side too (sharing one GPU, they ran slower than one at a time)",
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=2 if torch.cuda.is_available() else 0,
        help="loader workers building each run's batches while it computes (default: 2 on a GPU); the same batches",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile each pretraining run's model")
    parser.add_argument("--eval-points", type=int, default=8, help="held-out evaluations during each run")
    parser.add_argument("--seeds", type=int, default=3, help="fine-tuning seeds per encoder and task")
    parser.add_argument(
        "--tasks", nargs="+", default=["corrupted", "next-line", "docstring"], choices=list(RECIPES.TASKS)
    )
    parser.add_argument("--finetune-steps", type=int, default=200)
    parser.add_argument(
        "--finetune-lrs", nargs="+", type=float, default=[1e-4, 3e-4], help="chosen per encoder and task on dev"
    )
    parser.add_argument("--note", default="")
    parser.add_argument("--name", default="electra_vs_mlm_gpu", help="the results files' name (--tiny adds _tiny)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="keep the text, the runs and the fine-tunings in this new or empty folder (default: a temporary one); a "
        "later call with the same folder and settings reads back what an earlier one finished and does only the rest",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU: a smoke run of the same code")
    parser.add_argument("--plan", action="store_true", help="print each run's steps and epochs; train nothing")
    args = parser.parse_args(argv)
    args.command = "python benchmarks/electra_vs_mlm_gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.few_shot = 32  # recipes.task_files writes a few-shot split too; only full-size runs here
    args.finetune_lr = args.finetune_lrs[0]  # what electra_vs_mlm.finetune reads when no lr is given
    if args.tiny:
        args.flops_budget, args.hidden_size, args.layers, args.batch_size = 3e8, 32, 2, 8
        args.seeds, args.finetune_steps, args.tasks, args.finetune_lrs = 1, 4, args.tasks[:1], args.finetune_lrs[:1]
        args.corpus_mb = min(args.corpus_mb, 0.2)
    return args


def installed_corpus(path: Path, megabytes: float, seed: int = 0, package_roots: list[Path] | None = None) -> dict:
    """Write the training text of --corpus installed to `path` (JSON lines, one source file per line): every
    standard-library file of the embedded corpus, then the .py files of `package_roots` (default: site-packages) in a
    seeded order until `megabytes` of them; each text once, its near-duplicates left out (`near_duplicate`). Returns
    what it holds and what it left out."""
    if package_roots is None:
        package_roots = sorted({Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")})
    package_files = []
    for root in package_roots:
        for directory, subdirectories, names in os.walk(root):
            subdirectories[:] = sorted(name for name in subdirectories if name not in SKIPPED_PACKAGE_DIRS)
            package_files.extend(Path(directory, name) for name in sorted(names) if name.endswith(".py"))
    random.Random(seed).shuffle(package_files)
    seen: set[int] = set()  # the shingles of the texts kept
    counts = {f"{kind}_{unit}": 0 for kind in ("stdlib", "package", "near_duplicate") for unit in ("files", "bytes")}
    with path.open("w") as corpus:
        for kind, files in (("stdlib", stdlib_source_files()), ("package", package_files)):
            for file in files:
                if kind == "package" and counts["package_bytes"] >= megabytes * 1e6:
                    break
                text = read_source(file) if file.stat().st_size <= LARGEST_SOURCE_FILE else None
                if not text or not text.strip():
                    continue
                encoded, windows = text.encode(), shingles(text)
                if near_duplicate(windows, seen):
                    counts["near_duplicate_files"] += 1
                    counts["near_duplicate_bytes"] += len(encoded)
                    continue
                seen |= windows
                corpus.write(json.dumps({"text": text}) + "\n")
                counts[f"{kind}_files"] += 1
                counts[f"{kind}_bytes"] += len(encoded)
    return {"package_roots": [str(root) for root in package_roots], **counts}


def shingles(text: str) -> set[int]:
    """Hashes of the text's windows of SHINGLE_LINES consecutive non-blank lines (stripped; one window when shorter).
    Python's string hash: only compared within one process."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return {hash("\n".join(lines[i : i + SHINGLE_LINES])) for i in range(max(1, len(lines) - SHINGLE_LINES + 1))}


def near_duplicate(windows: set[int], seen: set[int]) -> bool:
    """Whether at least NEAR_DUPLICATE_SHARE of a text's windows are among those `seen` (an exact copy: all)."""
    return len(windows & seen) >= NEAR_DUPLICATE_SHARE * len(windows)


def run_settings(variant: str, args, folder: Path, steps: int, tokenizer: Path | None):
    objective, extra = VARIANTS[variant]
    heads = max(4, args.hidden_size // 64)  # generators of 1/4 and 1/2 width differ in heads: 4 at least
    model = dict(hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=heads)
    model.update(intermediate_size=args.hidden_size * 8 // 3 // 16 * 16)  # gated: about 4x hidden in two matrices
    overrides = dict(objective=objective, model=model, output_dir=str(folder), overwrite=True, max_steps=steps)
    overrides.update(extra, batch_size=args.batch_size, lr=args.lr, warmup_steps=max(1, steps // 20))
    overrides.update(save_every=0, eval_every=max(1, steps // args.eval_points), report_to="none", zero_shot_pairs=0)
    overrides.update(mixed_precision="bf16" if torch.cuda.is_available() else "no", vocab_size=16384)
    overrides.update(compile=args.compile, num_workers=args.num_workers)
    if args.corpus == "installed":
        overrides["dataset"] = str(args.corpus_file)
    if tokenizer is not None:
        overrides["tokenizer"] = str(tokenizer)
    if args.tiny:
        overrides.update(max_documents=12, vocab_size=384, block_size=32, eval_batches=2)
    return resolve_arguments(family="encoder", preset="tiny-modern", overrides=overrides)


def pretrain(variant: str, args, work: Path, tokenizer: Path, tokens_per_step: float) -> dict:
    """One run spending --flops-budget: its held-out numbers, FLOPs and held-out loss during training; a run whose
    loss diverges is returned with its error (the others go on)."""
    objective = VARIANTS[variant][0]
    folder = work / re.sub(r"\W+", "-", variant)  # "electra-1-4-width"
    datasets.disable_progress_bars()
    try:
        steps, per_token, per_step = budget_steps(variant, args, folder, tokenizer, tokens_per_step)
        settings = run_settings(variant, args, folder, steps, tokenizer)
        metrics = run_pretraining(settings)
    except PretrainingError as error:  # a diverged run is a result: the comparison goes on without it
        return {"variant": variant, "error": str(error)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gates = EVM.held_out_gates(folder, objective, settings.block_size, batches=args_batches(args), device=device)
    return {
        "variant": variant,
        "steps": metrics["steps"],
        "epochs": metrics["epochs"],
        "tokens_seen": metrics["tokens_seen"],
        "train_time_s": metrics["train_time_s"],
        "pretraining_flops": per_token * metrics["tokens_seen"] + per_step * metrics["steps"],
        **gates,
        "curve": curve(metrics["history"]),
        "folder": str(folder),
    }


def budget_steps(variant: str, args, folder: Path, tokenizer: Path, tokens_per_step: float) -> tuple[int, float, float]:
    """(steps that spend --flops-budget, FLOPs per token, FLOPs per step) of the variant's run at these settings."""
    settings = run_settings(variant, args, folder, 1, tokenizer)
    per_token, per_step = EVM.training_flops(VARIANTS[variant][0], settings, tokenizer)
    return EVM.steps_for(args.flops_budget, per_token, per_step, tokens_per_step), per_token, per_step


def plan(args, work: Path, tokenizer: Path, tokens_per_step: float, training_rows: int) -> str:
    """--plan: each run's steps and epochs (passes over the training rows) at --flops-budget, as a table."""
    text = f"{training_rows:,.0f} training rows, {tokens_per_step:,.0f} tokens a step"
    lines = [
        f"{args.flops_budget:.3g} FLOPs a run; {text}",
        "",
        "| encoder | steps | epochs | FLOPs per token |",
        "|---|---|---|---|",
    ]
    for variant in args.variants:
        steps, per_token, _ = budget_steps(variant, args, work / "plan", tokenizer, tokens_per_step)
        lines.append(f"| {variant} | {steps} | {steps * args.batch_size / training_rows:.2f} | {per_token:.3g} |")
    return "\n".join(lines)


def curve(history: dict) -> list[dict]:
    """The run's held-out loss (its own objective's, at its training masking rate) at each evaluation, beside the
    mean training loss of the steps since the one before."""
    points, train = [], history["train"]
    for before, evaluation in zip([{"step": 0}] + history["eval"], history["eval"]):
        losses = [row["loss"] for row in train if before["step"] < row["step"] <= evaluation["step"]]
        mean = sum(losses) / len(losses) if losses else None
        points.append({"step": evaluation["step"], "held_out_loss": evaluation["loss"], "train_loss": mean})
    return points


class GpuUtilization:
    """While a stage runs, a thread asks nvidia-smi for the GPU's utilization every `interval` seconds (the share of
    its last sample period in which a kernel ran); at the stage's end its mean and the share of samples at 0 (the GPU
    idle) go into report["gpu_utilization"][stage]: whether the GPU or the host bounded the stage. Nothing where
    nvidia-smi is missing (a CPU machine) or the stage has no `work` (a continued call that finished it before)."""

    def __init__(self, report: dict, stage: str, work: Any, interval: float = 1.0, executable: str = "nvidia-smi"):
        self.report, self.stage, self.interval = report, stage, interval
        self.executable = shutil.which(executable) if work else None
        device = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0] or "0"  # the GPU this process uses
        self.query = [self.executable, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", device]
        self.samples: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while True:
            answer = subprocess.run(self.query, capture_output=True, text=True).stdout.strip()
            if answer.isdigit():
                self.samples.append(int(answer))
            if self.stop.wait(self.interval):
                return

    def __enter__(self) -> "GpuUtilization":
        if self.executable is not None:
            self.thread.start()
        return self

    def __exit__(self, *exception: object) -> None:
        if self.executable is None:
            return
        self.stop.set()
        self.thread.join()
        if self.samples:
            self.report.setdefault("gpu_utilization", {})[self.stage] = {
                "samples": len(self.samples),
                "mean_percent": sum(self.samples) / len(self.samples),
                "idle_share": self.samples.count(0) / len(self.samples),
            }


def in_processes(
    function: Callable, calls: dict[Hashable, tuple], parallel: bool, at_once: int | None = None
) -> Iterator[tuple[Hashable, Any]]:
    """(name, function(*arguments)) for each of `calls` (name -> arguments), as each finishes: in this process one
    after the other, or (`parallel`) each in a fresh process of its own, `at_once` at a time (default: all)."""
    if not parallel or not calls:  # none left: a pool of no processes is an error
        yield from ((name, function(*arguments)) for name, arguments in calls.items())
        return
    spawn = multiprocessing.get_context("spawn")  # CUDA in every worker: fork would share the parent's state
    names, size = list(calls), at_once or len(calls)
    # A pool per group of `size`, as many processes as calls: each call gets a fresh one. (One pool with
    # max_tasks_per_child=1 would say the same, but can stop replacing its workers: CPython gh-115634.)
    for group in (names[start : start + size] for start in range(0, len(names), size)):
        with concurrent.futures.ProcessPoolExecutor(len(group), mp_context=spawn) as pool:
            futures = {pool.submit(function, *calls[name]): name for name in group}
            yield from ((futures[done], done.result()) for done in concurrent.futures.as_completed(futures))


def args_batches(args) -> int:
    return 2 if args.tiny else 20


def finetuned(folder: Path, task: str, files: dict, args, work: Path) -> dict:
    """The task, full-size, at the encoder's learning rate chosen on the task's dev split (--finetune-lrs, seed 0):
    accuracy per seed (paired across encoders). A function of this script, as `pretrain` is, so that a spawned
    process finds it by name (the sibling modules are loaded by path)."""
    datasets.disable_progress_bars()
    return EVM.finetuned(folder, task, files, args, work)


def markdown(report: dict) -> str:
    corpus = report.get("corpus", {})
    lines = [
        "# ELECTRA vs masked LM on one GPU at equal training FLOPs",
        "",
        f"- machine: {report['machine']['device']}, {report['machine']['platform']}",
        *(
            [f"- packages: {', '.join(f'{name} {version}' for name, version in report['packages'].items())}"]
            if "packages" in report
            else []
        ),  # results from before the report had them
        *([f"- note: {report['note']}"] if report["note"] else []),
        *(
            [f"- calls: {report['calls']}, each continuing what the one before finished (--work-dir)"]
            if report.get("calls", 1) > 1
            else []
        ),
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- training text: {corpus_line(report['settings']['corpus'], corpus)}",
        f"- unigram entropy of the training text: {report['unigram_entropy']:.3f} nats per token",
        *([utilization_line(report["gpu_utilization"])] if "gpu_utilization" in report else []),
        "",
        "| encoder | steps | epochs | training FLOPs | time (s) | "
        "held-out MLM loss at the [MASK] tokens (ELECTRA: generator) | below unigram by | over all selected tokens | "
        "RTD AUC | RTD loss / constant's | RTD accuracy / base rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | failed: {row['error']} |" + " |" * 9)
            continue
        auc = f"{row['rtd_auc']:.4f}" if "rtd_auc" in row else "—"
        rtd = f"{row['rtd_loss']:.4f} / {row['rtd_constant_loss']:.4f}" if "rtd_loss" in row else "—"
        accuracy = f"{row['rtd_accuracy']:.4f} / {row['rtd_base_rate']:.4f}" if "rtd_accuracy" in row else "—"
        # The gate reads the [MASK] tokens (electra_vs_mlm.held_out_gates): at the visible and random-replaced ones the
        # loss depends on how each objective masked its own training input.
        at_masks = row["mlm_loss_at_masks"]
        epochs = f"{row['epochs']:.2f}" if "epochs" in row else "—"  # results from before metrics.json had them
        lines.append(
            f"| {row['variant']} | {row['steps']} | {epochs} | {row['pretraining_flops']:.3g} | "
            f"{row['train_time_s']:.1f} | {at_masks:.4f} | {report['unigram_entropy'] - at_masks:+.3f} | "
            f"{row['mlm_loss']:.4f} | {auc} | {rtd} | {accuracy} |"
        )
    settings = report["settings"]
    if settings.get("runs_together", settings["parallel"]):  # calls before --runs-together: --parallel did both
        lines += ["", "The runs trained at the same time on the one GPU: their times are not a speed comparison."]
    during = "Held-out loss during pretraining (each run's own objective; in brackets the mean training loss since the "
    lines += ["", during + "evaluation before):", ""] + [curve_line(row) for row in report["runs"] if "curve" in row]
    if report["comparisons"]:
        lrs = settings.get("finetune_lrs")
        listed = ", ".join(f"{lr:g}" for lr in lrs or [])
        how = f"chosen per encoder and task on dev from {listed}" if lrs else f"fixed at {settings['finetune_lr']:g}"
        lines += [
            "",
            f"Fine-tuned full-size, {settings['finetune_steps']} steps of 16 rows, {settings['seeds']} seeds paired; "
            f"learning rate {how}:",
            "",
            "| task | encoder | lr | accuracy (mean ± std) | paired difference | seeds > 0 |",
            "|---|---|---|---|---|---|",
        ]
    for comparison in report["comparisons"]:
        lines.append(
            f"| {comparison['task']} | {comparison['what']} | {comparison['lr']:g} | {comparison['accuracy_mean']:.3f} "
            f"± {comparison['accuracy_std']:.3f} | {comparison['mean']:+.3f} ± {comparison['std']:.3f} | "
            f"{comparison['wins']} / {comparison['seeds']} |"
        )
    return "\n".join(lines) + "\n"


def utilization_line(stages: dict[str, dict]) -> str:
    parts = [
        f"{stage} {row['mean_percent']:.0f}% on average, idle in {row['idle_share']:.0%} of {row['samples']} samples"
        for stage, row in stages.items()
    ]
    return "- GPU utilization (nvidia-smi, each second): " + "; ".join(parts)


def corpus_line(kind: str, corpus: dict) -> str:
    if kind == "stdlib":
        return "the standard library's source (the embedded corpus)"
    line = (
        f"the standard library's source ({corpus['stdlib_files']} files, {corpus['stdlib_bytes'] / 1e6:.1f} MB) and "
        f"installed packages' ({corpus['package_files']} files, {corpus['package_bytes'] / 1e6:.1f} MB), each text once"
    )
    if "near_duplicate_files" not in corpus:  # results from before the near-duplicates were left out
        return line
    left_out = f"{corpus['near_duplicate_files']} files, {corpus['near_duplicate_bytes'] / 1e6:.1f} MB"
    return f"{line}; near-duplicates left out ({left_out})"


def curve_line(row: dict) -> str:
    points = ", ".join(
        f"{point['step']}: {point['held_out_loss']:.3f}"
        + (f" ({point['train_loss']:.3f})" if point["train_loss"] is not None else "")
        for point in row["curve"]
    )
    return f"- {row['variant']}: {points}"


def comparisons(finetuning: dict[str, dict], tasks: list[str]) -> list[dict]:
    """Every encoder against random init, and each ELECTRA against masked LM, per task, paired by seed: the pairs
    fine-tuned on the task so far (they finish in any order), in the order of `tasks` and of the runs."""
    done = {name: set(results) for name, results in finetuning.items()}
    rows = []
    for task in tasks:
        for name in (name for name in VARIANTS if task in done.get(name, ())):
            against = ["random init"] + (["masked-lm"] if name.startswith("electra") else [])
            for reference in (other for other in against if task in done.get(other, ())):
                result = finetuning[name][task]
                rows.append(
                    {
                        "task": task,
                        "what": f"{name} - {reference}",
                        "lr": result.get("lr"),
                        "accuracy_mean": result["accuracy_mean"],
                        "accuracy_std": result["accuracy_std"],
                        **EVM.paired(result["accuracies"], finetuning[reference][task]["accuracies"]),
                    }
                )
    return rows


def write(report: dict, args) -> None:
    write_results(args.output_dir, args.name + ("_tiny" if args.tiny else ""), report, markdown(report))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        progress = open_work(work, args)
        report = progress["report"]
        tokenizer, first_settings = text_and_tokenizer(args, work, progress)
        if args.plan:
            print(plan(args, work, tokenizer, **progress["tokenizer_run"]))
            return 0
        if pretrain_every_variant(args, work, progress, tokenizer, first_settings):
            report["setup_and_pretraining_s"] = time.perf_counter() - started
        write(report, args)
        finetune_every_encoder(args, work, progress, tokenizer)
        report["wall_time_s"] = time.perf_counter() - started  # of the last call
        save_progress(work, progress)
    write(report, args)
    print(markdown(report))
    return 0


def open_work(work: Path, args) -> dict:
    """The progress of the comparison in `work`: what earlier calls with this --work-dir finished, or a new one; the
    folder is marked as this comparison's before anything is written into it."""
    work.mkdir(parents=True, exist_ok=True)
    progress = read_progress(work, args) or {"report": new_report(args), "encoders": {}}
    progress["report"]["calls"] = progress["report"].get("calls", 0) + 1
    save_progress(work, progress)
    return progress


def text_and_tokenizer(args, work: Path, progress: dict) -> tuple[Path, PretrainingArguments]:
    """The training text (--corpus installed) and a one-step run that trains the tokenizer every run reads: its folder
    and settings. Its tokens per step and training rows go into `progress`, which sizes the runs."""
    report = progress["report"]
    if args.corpus == "installed":
        args.corpus_file = work / "corpus.jsonl"
        if "corpus" not in report:
            report["corpus"] = installed_corpus(args.corpus_file, args.corpus_mb)
    tokenizer = work / "tokenizer-run"
    first_settings = run_settings("masked-lm", args, tokenizer, 1, None)
    if "tokenizer_run" not in progress:
        first = run_pretraining(first_settings)
        tokens_per_step = first["tokens_seen"] / first["steps"]
        progress["tokenizer_run"] = {"tokens_per_step": tokens_per_step, "training_rows": first["training_rows"]}
        save_progress(work, progress)
    return tokenizer, first_settings


def pretrain_every_variant(
    args, work: Path, progress: dict, tokenizer: Path, first_settings: PretrainingArguments
) -> bool:
    """Each of --variants not pretrained yet (a run that failed is a result too), saved to `progress` as it ends, and
    the unigram entropy of the text, computed on the CPU meanwhile. Whether any run trained."""
    report, encoders = progress["report"], progress["encoders"]
    pretrained = {row["variant"]: row for row in report["runs"]}
    tokens_per_step = progress["tokenizer_run"]["tokens_per_step"]
    to_train = {v: (v, args, work, tokenizer, tokens_per_step) for v in args.variants if v not in pretrained}
    with concurrent.futures.ThreadPoolExecutor(1) as beside, GpuUtilization(report, "pretraining", to_train):
        entropy = None if "unigram_entropy" in report else beside.submit(EVM.unigram_entropy, tokenizer, first_settings)
        at_once = None if args.runs_together else 1
        for variant, row in in_processes(pretrain, to_train, args.parallel, at_once):
            if "folder" in row:
                encoders[variant] = row.pop("folder")
            pretrained[variant] = row
            report.get("finetuning", {}).pop(variant, None)  # of an encoder this run has replaced
            report["runs"] = [pretrained[name] for name in args.variants if name in pretrained]
            save_progress(work, progress)
        if entropy is not None:
            report["unigram_entropy"] = entropy.result()
    save_progress(work, progress)
    return bool(to_train)


def finetune_every_encoder(args, work: Path, progress: dict, tokenizer: Path) -> None:
    """Each pretrained encoder and a randomly initialised one on each of --tasks not fine-tuned yet, paired as each
    ends; the results are written after each."""
    report, encoders = progress["report"], progress["encoders"]
    if "random init" not in encoders:
        encoders["random init"] = str(EVM.random_encoder(work / "random-init", tokenizer))
    finetuning = report.setdefault("finetuning", {})
    pending = [(name, task) for task in args.tasks for name in encoders if task not in finetuning.get(name, {})]
    files = {task: RECIPES.task_files(task, args, work) for task in dict.fromkeys(task for _, task in pending)}
    to_finetune = {(name, task): (Path(encoders[name]), task, files[task], args, work) for name, task in pending}
    with GpuUtilization(report, "fine-tuning", to_finetune):
        for (name, task), result in in_processes(finetuned, to_finetune, args.parallel):
            finetuning.setdefault(name, {})[task] = result
            report["comparisons"] = comparisons(finetuning, args.tasks)
            save_progress(work, progress)
            write(report, args)


def new_report(args) -> dict:
    """The report's head (machine, packages, date, command, note, settings); runs and results are added as they end."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    return {
        "machine": {"device": device, "platform": platform.platform()},
        "packages": {name: importlib.metadata.version(name) for name in PACKAGES},
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": args.command,
        "note": args.note,
        "settings": settings_of(args),
        "runs": [],
        "comparisons": [],
    }


def settings_of(args) -> dict:
    """Every setting, as the report's JSON holds it."""
    return json.loads(
        json.dumps({key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()})
    )


def read_progress(work: Path, args) -> dict | None:
    """What earlier calls with this --work-dir finished (its PROGRESS file): the report so far, the tokenizer run's
    numbers and each pretrained encoder's folder; None when there is none. The settings that decide a result must be
    the ones the work was done with: another budget or model is another comparison."""
    path = work / PROGRESS
    if not path.exists():
        if any(work.iterdir()):  # the runs would overwrite folders of the same names
            raise SystemExit(
                f"--work-dir {work} is not empty and holds no {PROGRESS}, so this script did not start it: give a new "
                "or empty folder"
            )
        return None
    progress = json.loads(path.read_text())
    before, now = progress["report"]["settings"], settings_of(args)
    deciding = (before.keys() | now.keys()) - SETTINGS_NOT_DECIDING
    changed = ", ".join("--" + key.replace("_", "-") for key in sorted(deciding) if before.get(key) != now.get(key))
    if changed:
        raise SystemExit(
            f"--work-dir {work} holds a comparison with other settings ({changed}): give the settings it was started "
            "with to continue it, or another --work-dir to start a new one"
        )
    # The report names the call that continued it (its settings deciding nothing may differ); its date, the first's.
    progress["report"].update(command=args.command, settings=now, note=args.note or progress["report"]["note"])
    return progress


def save_progress(work: Path, progress: dict) -> None:
    """PROGRESS in the work folder, replaced whole (a call stopped while writing leaves the one before)."""
    partial = work / (PROGRESS + ".partial")
    partial.write_text(json.dumps(progress, indent=2) + "\n")
    partial.replace(work / PROGRESS)


if __name__ == "__main__":
    sys.exit(main())
