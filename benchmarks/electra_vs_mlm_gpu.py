"""ELECTRA vs masked LM on one GPU at 5e15-1e16 training FLOPs (where the paper's curves start), in one call of at
most 10 minutes.

The backbone is the modern encoder recipe (training/configs/encoder-tiny-modern.yaml: pre-norm, rotary, GeGLU, no
biases, no dropout) at GPU size (--hidden-size 512, --layers 8), bf16 autocast, batches of 128 x 128 tokens, the
whole embedded corpus. Each run spends the same training FLOPs (steps = budget / FLOPs per step, from the model's
shapes: benchmarks/electra_vs_mlm.py's `training_flops`):

    masked-lm            30% masking (Wettig et al. 2023)
    electra, 1/4 width   15% masking, RTD weight 50 (Clark et al. 2020: generators of 1/4-1/2 width work best)
    electra, 1/2 width

The gates stand beside each result (benchmarks/electra_vs_mlm.py's `held_out_gates`): held-out MLM loss at 15%
masking (for ELECTRA: its generator's) against the unigram entropy of the training text (a model at the unigram stage
has learned no context), and ELECTRA's discriminator on held-out replacements by its own generator: ROC AUC (0.5: no
signal), RTD loss and accuracy against the best constant answer's (not below it: it learned nothing). Each encoder and a
randomly initialised one are then fine-tuned on --tasks (benchmarks/recipes.py's tasks: context ones and the
lexical control) with --seeds seeds, paired by seed against random init and ELECTRA against masked LM.

The defaults are sized to fit one call of 10 minutes from the one run measured (results/electra_vs_mlm_gpu.json: on an
H200, masked LM at 1e16 FLOPs and batch 128 trained for about 4.5 minutes, so three variants at 1e16 need about 14):
5e15 FLOPs for masked LM and ELECTRA at 1/4 width (--variants adds the 1/2 width). That run's masked LM also ended at
the unigram stage, where the same recipe at tiny width on CPU leaves it: the gates say whether a run is worth
comparing. Results are written after every run, so a call cut off at its time limit keeps what it finished:
results/electra_vs_mlm_gpu.json and, once the fine-tuning ran, .md (machine, date and command at the top).

    python benchmarks/electra_vs_mlm_gpu.py                      # on the GPU machine (wall_time_s says how long)
    python benchmarks/electra_vs_mlm_gpu.py --tiny               # a CPU smoke run of the same code
"""

import argparse
import datetime
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from results_files import sibling, write_results

from coreformer.training.pretraining import resolve_arguments, run_pretraining

ROOT = Path(__file__).resolve().parents[1]


EVM, RECIPES = sibling("electra_vs_mlm"), sibling("recipes")
VARIANTS = EVM.VARIANTS  # name -> (objective, its settings): the CPU benchmark's, sources in its docstring


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flops-budget", type=float, default=5e15, help="training FLOPs of every run")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS)[:2], help="which runs, in this order"
    )
    parser.add_argument("--seeds", type=int, default=3, help="fine-tuning seeds per encoder and task")
    parser.add_argument("--tasks", nargs="+", default=["corrupted", "package"], choices=list(RECIPES.TASKS))
    parser.add_argument("--finetune-steps", type=int, default=200)
    parser.add_argument("--finetune-lr", type=float, default=3e-4)
    parser.add_argument("--note", default="")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU: a smoke run of the same code")
    args = parser.parse_args(argv)
    args.command = "python benchmarks/electra_vs_mlm_gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.few_shot = 32  # recipes.task_files writes a few-shot split too; only full-size runs here
    if args.tiny:
        args.flops_budget, args.hidden_size, args.layers, args.batch_size = 3e8, 32, 2, 8
        args.seeds, args.finetune_steps, args.tasks = 1, 4, args.tasks[:1]
    return args


def run_settings(variant: str, args, folder: Path, steps: int, tokenizer: Path | None):
    objective, extra = VARIANTS[variant]
    heads = max(4, args.hidden_size // 64)  # generators of 1/4 and 1/2 width differ in heads: 4 at least
    model = dict(hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=heads)
    model.update(intermediate_size=args.hidden_size * 8 // 3 // 16 * 16)  # gated: about 4x hidden in two matrices
    overrides = dict(objective=objective, model=model, output_dir=str(folder), overwrite=True, max_steps=steps)
    overrides.update(extra, batch_size=args.batch_size, lr=args.lr, warmup_steps=max(1, steps // 20))
    overrides.update(save_every=0, eval_every=0, report_to="none", zero_shot_pairs=0)
    overrides.update(mixed_precision="bf16" if torch.cuda.is_available() else "no", vocab_size=16384)
    if tokenizer is not None:
        overrides["tokenizer"] = str(tokenizer)
    if args.tiny:
        overrides.update(max_documents=12, vocab_size=384, block_size=32, eval_batches=2)
    return resolve_arguments(family="encoder", preset="tiny-modern", overrides=overrides)


def pretrain(variant: str, args, work: Path, tokenizer: Path, tokens_per_step: float) -> dict:
    """One run spending --flops-budget, its held-out numbers and FLOPs."""
    objective = VARIANTS[variant][0]
    folder = work / re.sub(r"\W+", "-", variant)  # "electra-1-4-width"
    per_token, per_step = EVM.training_flops(objective, run_settings(variant, args, folder, 1, tokenizer), tokenizer)
    steps = max(2, round(args.flops_budget / (per_token * tokens_per_step + per_step)))
    settings = run_settings(variant, args, folder, steps, tokenizer)
    metrics = run_pretraining(settings)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gates = EVM.held_out_gates(folder, objective, settings.block_size, batches=args_batches(args), device=device)
    return {
        "variant": variant,
        "steps": metrics["steps"],
        "tokens_seen": metrics["tokens_seen"],
        "train_time_s": metrics["train_time_s"],
        "pretraining_flops": per_token * metrics["tokens_seen"] + per_step * metrics["steps"],
        **gates,
        "folder": str(folder),
    }


def args_batches(args) -> int:
    return 2 if args.tiny else 20


def finetuned(folder: Path, args, work: Path, files: dict) -> dict:
    """Each task, full-size, at --finetune-lr: accuracy per seed (paired across encoders)."""
    results = {}
    for task, task_files in files.items():
        _, classes, pair, _ = RECIPES.TASKS[task]
        results[task] = EVM.finetune(folder, args, work, task_files["full"], classes=classes, pair=pair, tag=f"-{task}")
    return results


def markdown(report: dict) -> str:
    lines = [
        "# ELECTRA vs masked LM on one GPU at equal training FLOPs",
        "",
        f"- machine: {report['machine']['device']}, {report['machine']['platform']}"
        + (f" ({report['note']})" if report["note"] else ""),
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- unigram entropy of the training text: {report['unigram_entropy']:.3f} nats per token",
        "",
        "| encoder | steps | training FLOPs | time (s) | held-out MLM loss at the [MASK] tokens (ELECTRA: generator) | "
        "below unigram by | over all selected tokens | RTD AUC | RTD loss / constant's | RTD accuracy / base rate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        auc = f"{row['rtd_auc']:.4f}" if "rtd_auc" in row else "—"
        rtd = f"{row['rtd_loss']:.4f} / {row['rtd_constant_loss']:.4f}" if "rtd_loss" in row else "—"
        accuracy = f"{row['rtd_accuracy']:.4f} / {row['rtd_base_rate']:.4f}" if "rtd_accuracy" in row else "—"
        # The gate reads the [MASK] tokens (electra_vs_mlm.held_out_gates): at the visible and random-replaced ones the
        # loss depends on how each objective masked its own training input.
        at_masks = row["mlm_loss_at_masks"]
        lines.append(
            f"| {row['variant']} | {row['steps']} | {row['pretraining_flops']:.3g} | {row['train_time_s']:.1f} | "
            f"{at_masks:.4f} | {report['unigram_entropy'] - at_masks:+.3f} | {row['mlm_loss']:.4f} | {auc} | {rtd} | "
            f"{accuracy} |"
        )
    lines += ["", "| task | encoder | accuracy (mean ± std) | paired difference | seeds > 0 |", "|---|---|---|---|---|"]
    for comparison in report["comparisons"]:
        lines.append(
            f"| {comparison['task']} | {comparison['what']} | {comparison['accuracy_mean']:.3f} ± "
            f"{comparison['accuracy_std']:.3f} | {comparison['mean']:+.3f} ± {comparison['std']:.3f} | "
            f"{comparison['wins']} / {comparison['seeds']} |"
        )
    return "\n".join(lines) + "\n"


def comparisons(finetuning: dict[str, dict]) -> list[dict]:
    """Every encoder against random init, and each ELECTRA against masked LM, per task, paired by seed."""
    rows = []
    for task in next(iter(finetuning.values())):
        references = {"random init": finetuning["random init"][task]}
        if "masked-lm" in finetuning:
            references["masked-lm"] = finetuning["masked-lm"][task]
        for name, results in finetuning.items():
            result = results[task]
            against = ["random init"] + (
                ["masked-lm"] if name.startswith("electra") and "masked-lm" in references else []
            )
            for reference in against if name != "random init" else []:
                paired = EVM.paired(result["accuracies"], references[reference]["accuracies"])
                rows.append(
                    {
                        "task": task,
                        "what": f"{name} - {reference}",
                        "accuracy_mean": result["accuracy_mean"],
                        "accuracy_std": result["accuracy_std"],
                        **paired,
                    }
                )
    return rows


def write(report: dict, args) -> None:
    name = "electra_vs_mlm_gpu_tiny" if args.tiny else "electra_vs_mlm_gpu"
    write_results(args.output_dir, name, report, markdown(report) if report["comparisons"] else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    report = {
        "machine": {"device": device, "platform": platform.platform()},
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": args.command,
        "note": args.note,
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "runs": [],
        "comparisons": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        first_settings = run_settings("masked-lm", args, work / "tokenizer-run", 1, None)
        first = run_pretraining(first_settings)
        tokenizer, tokens_per_step = work / "tokenizer-run", first["tokens_seen"] / first["steps"]
        report["unigram_entropy"] = EVM.unigram_entropy(tokenizer, first_settings)
        for variant in args.variants:
            report["runs"].append(pretrain(variant, args, work, tokenizer, tokens_per_step))
            write(report, args)
        files = {task: RECIPES.task_files(task, args, work) for task in args.tasks}
        encoders = {"random init": EVM.random_encoder(work / "random-init", tokenizer)}
        encoders.update({row["variant"]: Path(row.pop("folder")) for row in report["runs"]})
        finetuning = {name: finetuned(folder, args, work, files) for name, folder in encoders.items()}
        report["comparisons"] = comparisons(finetuning)
    report["wall_time_s"] = time.perf_counter() - started
    write(report, args)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
