"""ELECTRA vs masked-LM pretraining at equal wall time, each then fine-tuned the same way: accuracy against compute.

For each objective (masked-lm, electra) and each time budget (--budgets, seconds of training), one pretraining run
of the same encoder (the encoder-tiny preset unless --tiny) on the embedded corpus, its step count set so that its
training time matches the budget (seconds per step from a short calibration run of that objective first, then from
the previous run). Each pretrained encoder, and a randomly initialised one (compute 0), is then fine-tuned for
sequence classification on the embedded classification data (docstring -> package) with the same settings and
--seeds seeds, and evaluated on the validation split. Pretraining FLOPs are tokens seen x training FLOPs per token
(6 N + 12 L d T per model, PaLM appendix B; ELECTRA counts its generator and its discriminator).

Writes results/electra_vs_mlm.json, electra_vs_mlm.png (accuracy against pretraining FLOPs and seconds) and a
markdown table (stdout and electra_vs_mlm.md).

    python benchmarks/electra_vs_mlm.py                  # ~25 minutes on 2 CPU cores: budgets 75, 150, 300 s
    python benchmarks/electra_vs_mlm.py --tiny           # seconds: a smoke run (the test runs it)
"""

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

from coreformer.training.finetuning import FinetuningArguments, run_finetuning
from coreformer.training.objectives.electra import GENERATOR_DIR
from coreformer.training.pretraining import resolve_arguments, run_pretraining
from coreformer.training.reports import flops_per_token

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVES = ("masked-lm", "electra")
TINY_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=float, nargs="+", default=[75.0, 150.0, 300.0], help="training seconds")
    parser.add_argument("--calibration-steps", type=int, default=30, help="steps timed to set the first run's length")
    parser.add_argument("--finetune-steps", type=int, default=60, help="fine-tuning steps (3 epochs of 320)")
    parser.add_argument("--finetune-lr", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, default=3, help="fine-tuning seeds per pretrained encoder")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, few documents, budgets of seconds")
    args = parser.parse_args(argv)
    if args.tiny:
        args.budgets, args.calibration_steps, args.finetune_steps, args.seeds = [1.0, 2.0], 3, 4, 1
    return args


def pretraining_settings(objective: str, args: argparse.Namespace, output_dir: Path, steps: int, tokenizer):
    """The encoder-tiny preset (or a tiny model), no checkpoints, one held-out evaluation at the end."""
    overrides = dict(objective=objective, output_dir=str(output_dir), overwrite=True, max_steps=steps)
    overrides.update(save_every=0, eval_every=0, report_to="none", warmup_steps=max(1, steps // 10))
    if tokenizer is not None:
        overrides["tokenizer"] = str(tokenizer)
    if args.tiny:
        overrides.update(model=TINY_MODEL, max_documents=12, vocab_size=384, block_size=32, batch_size=8)
        overrides.update(eval_batches=2)
    return resolve_arguments(
        family="encoder", preset="tiny", overrides=overrides, configs_dir=ROOT / "training" / "configs"
    )


def model_flops_per_token(folder: Path, block_size: int) -> float:
    """Training FLOPs per token of what a run trained: the encoder with its MLM head, or ELECTRA's discriminator and
    generator (the generator's saved embeddings stand for its share of the shared matrix and the projection)."""
    parts = [(AutoConfig.from_pretrained(folder), AutoModel.from_pretrained(folder))]
    if (folder / GENERATOR_DIR).is_dir():
        generator = AutoModelForMaskedLM.from_pretrained(folder / GENERATOR_DIR)
        parts.append((generator.config, generator))
    else:
        masked_lm = AutoModelForMaskedLM.from_pretrained(folder)
        parts = [(masked_lm.config, masked_lm)]
    return sum(
        flops_per_token(config, sum(p.numel() for p in model.parameters()), block_size) for config, model in parts
    )


def pretrain(objective: str, budget: float, seconds_per_step: float, args, work: Path, tokenizer) -> dict:
    """One run whose training time is about `budget` seconds at `seconds_per_step`."""
    steps = max(2, round(budget / seconds_per_step))
    folder = work / f"{objective}-{budget:g}s"
    settings = pretraining_settings(objective, args, folder, steps, tokenizer)
    metrics = run_pretraining(settings)
    per_token = model_flops_per_token(folder, settings.block_size)
    return {
        "objective": objective,
        "budget_s": budget,
        "steps": metrics["steps"],
        "train_time_s": metrics["train_time_s"],
        "tokens_seen": metrics["tokens_seen"],
        "flops_per_token": per_token,
        "pretraining_flops": per_token * metrics["tokens_seen"],
        "final_eval_loss": metrics["final_eval_loss"],
        "folder": str(folder),
    }


def seconds_per_step(objective: str, args: argparse.Namespace, work: Path, tokenizer) -> float:
    """A short run of the objective, timed."""
    folder = work / f"{objective}-calibration"
    calibration = run_pretraining(pretraining_settings(objective, args, folder, args.calibration_steps, tokenizer))
    return calibration["train_time_s"] / calibration["steps"]


def finetune(folder: Path, args: argparse.Namespace, work: Path) -> dict:
    """Sequence classification on the embedded data, the same settings for every encoder; accuracy per seed."""
    accuracies = []
    for seed in range(args.seeds):
        finetuning = FinetuningArguments(
            task="sequence-classification",
            model=str(folder),
            output_dir=str(work / f"finetune-{folder.name}-{seed}"),
            overwrite=True,
            max_steps=args.finetune_steps,
            batch_size=16,
            lr=args.finetune_lr,
            max_length=128,
            seed=seed,
        )
        accuracies.append(run_finetuning(finetuning)["eval_accuracy"])
    return {
        "accuracies": accuracies,
        "accuracy_mean": statistics.fmean(accuracies),
        "accuracy_std": statistics.pstdev(accuracies),
    }


def random_encoder(folder: Path, like: Path) -> Path:
    """An untrained encoder of the same config and tokenizer as the folder `like` (compute 0): the baseline."""
    from transformers import AutoTokenizer

    import coreformer as cf

    torch.manual_seed(0)
    cf.CoreformerEncoderModel(AutoConfig.from_pretrained(like)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(like).save_pretrained(folder)
    return folder


def markdown(results: list[dict], baseline: dict) -> str:
    lines = [
        "| objective | budget (s) | steps | training time (s) | tokens | pretraining FLOPs | "
        "held-out loss (own objective) | fine-tuned accuracy (mean ± std) |",
        "|---|---|---|---|---|---|---|---|",
        f"| none (random init) | 0 | 0 | 0 | 0 | 0 | — | {baseline['accuracy_mean']:.3f} ± "
        f"{baseline['accuracy_std']:.3f} |",
    ]
    for row in results:
        lines.append(
            f"| {row['objective']} | {row['budget_s']:g} | {row['steps']} | {row['train_time_s']:.1f} | "
            f"{row['tokens_seen']:,} | {row['pretraining_flops']:.3g} | {row['final_eval_loss']:.3f} | "
            f"{row['accuracy_mean']:.3f} ± {row['accuracy_std']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], baseline: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for objective in OBJECTIVES:
        rows = sorted((r for r in results if r["objective"] == objective), key=lambda r: r["budget_s"])
        for axis, key in zip(axes, ("pretraining_flops", "train_time_s"), strict=True):
            axis.errorbar(
                [0.0] + [r[key] for r in rows],
                [baseline["accuracy_mean"]] + [r["accuracy_mean"] for r in rows],
                yerr=[baseline["accuracy_std"]] + [r["accuracy_std"] for r in rows],
                marker="o",
                capsize=3,
                label=objective,
            )
    for axis, label in zip(axes, ("pretraining FLOPs", "pretraining time (s)"), strict=True):
        axis.set(xlabel=label, ylabel="fine-tuned accuracy (validation)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("ELECTRA vs masked LM: sequence classification after pretraining")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        # One tokenizer for every run (WordPiece training is not reproducible): trained by a first short run.
        run_pretraining(pretraining_settings("masked-lm", args, work / "tokenizer-run", 1, None))
        tokenizer = work / "tokenizer-run"
        results = []
        for objective in OBJECTIVES:
            rate = seconds_per_step(objective, args, work, tokenizer)
            for budget in args.budgets:
                row = pretrain(objective, budget, rate, args, work, tokenizer)
                rate = row["train_time_s"] / row["steps"]  # the latest run's rate sets the next run's length
                row.update(finetune(Path(row.pop("folder")), args, work))
                results.append(row)
                print(f"{objective} {budget:g}s: accuracy {row['accuracy_mean']:.3f}", file=sys.stderr)
        baseline = finetune(random_encoder(work / "random-init", tokenizer), args, work)
    table = markdown(results, baseline)
    report = {
        "machine": {"platform": platform.platform(), "cpu": platform.processor(), "threads": torch.get_num_threads()},
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "baseline": baseline,
        "results": results,
        "wall_time_s": time.perf_counter() - started,
    }
    name = "electra_vs_mlm_tiny" if args.tiny else "electra_vs_mlm"
    (args.output_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.output_dir / f"{name}.md").write_text(table)
    plot(results, baseline, args.output_dir / f"{name}.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
