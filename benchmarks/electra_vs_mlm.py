"""ELECTRA vs masked-LM pretraining at equal compute, each then fine-tuned the same way: accuracy against compute.

For each objective (masked-lm, electra) and each budget, one pretraining run of the same encoder (the encoder-tiny
preset unless --tiny) on the embedded corpus, its step count set so that it spends the budget:

    equal time   (--budgets S ...)        seconds of training; seconds per step from a short calibration run of
                                          the objective, then from its previous run. Needs a quiet machine.
    equal FLOPs  (--flops-budgets F ...)  training FLOPs; steps = F / (FLOPs per token x tokens per step + FLOPs
                                          per step), tokens per step measured on the data (the same batches for
                                          both objectives). Independent of machine load: wall time is recorded
                                          but is a second axis, comparable only on a quiet machine.

Training FLOPs (`Objective.training_flops`, coreformer/training/flops.py), forward + backward of every network
trained: 6 N_matmul + 12 L d T per token, N_matmul the weights and biases of the linear layers (an output layer
tied to the embeddings counts as the (V, d) matmul it is; embedding lookups do not) and 12 L d T the attention
scores and values (PaLM appendix B). Masked LM: the encoder and its vocabulary head at every position. ELECTRA:
the generator (with its (V, d_g) head) plus the discriminator (with its one-logit head), plus once per step 6 x rows
x d x d_g for projecting the shared embedding tables. A pretraining run's FLOPs are per token x tokens seen + per
step x steps (checked against torch's FLOP counter in tests/training/objectives/test_electra.py).

Each pretrained encoder, and a randomly initialised one (compute 0, fine-tuned once per run), is then loaded with
AutoModelForSequenceClassification (its load report printed and recorded: only the new classifier may be missing),
fine-tuned for sequence classification on the embedded classification data at its full size (docstring -> package:
every first paragraph of the four packages, 189 per package, 454 to train on, 302 held out; the task's default
takes 100 per package and holds out 80) for --finetune-steps steps (200: a random encoder is within 0.01 of its
accuracy at 300 by then) with --seeds seeds, and evaluated on the held-out examples. Seed s draws the same classifier
initialisation and data order for every encoder, so besides mean ± std the report pairs them: per seed, each
encoder minus the random one, and ELECTRA minus masked LM at the same budget (mean ± std of the differences, and
on how many seeds it is > 0). Each row also records the held-out masked-LM loss (for ELECTRA: its generator's, at
1/4 of the width) and, for ELECTRA, the discriminator's replaced-token-detection loss beside the loss of the best
constant answer (the binary entropy of the base rate: not below it, the discriminator learned nothing from the
text) and its accuracy beside the base rate (always answering "original").

Writes results/electra_vs_mlm.json (one section per kind of budget; a run replaces the sections of its own kinds and
keeps the other), electra_vs_mlm.png (accuracy against pretraining FLOPs and seconds) and the markdown tables
(stdout and electra_vs_mlm.md). Both kinds may be given in one run (they then share the tokenizer and the baseline).

    python benchmarks/electra_vs_mlm.py --budgets 30 60 120       # equal time: a quiet machine only
    python benchmarks/electra_vs_mlm.py --flops-budgets 1.25e12 5e12      # equal FLOPs: the same steps under any load
    python benchmarks/electra_vs_mlm.py --tiny --budgets 1 --flops-budgets 1      # a smoke run of both (the test)
"""

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
import transformers
from transformers import AutoConfig, AutoModelForSequenceClassification

from coreformer.training.finetuning import FinetuningArguments, run_finetuning
from coreformer.training.objectives import OBJECTIVES as REGISTRY
from coreformer.training.pretraining import resolve_arguments, run_pretraining
from coreformer.training.tasks.sequence_classification import package_docstrings

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVES = ("masked-lm", "electra")
TINY_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
CLASSES = 4  # the embedded classification data's labels
HELD_OUT = 0.4  # of the 756 docstrings (189 per package): 302 held out, 454 to fine-tune on
TINY_HELD_OUT = 32  # --tiny evaluates on the first 32 held-out examples only
# The kinds of budget: (JSON section, what a budget is, the row key it is spent on)
KINDS = {"equal-time": ("seconds of training", "train_time_s"), "equal-flops": ("training FLOPs", "pretraining_flops")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=float, nargs="+", help="training seconds (default 75 150 300 when no kind "
                        "of budget is given)")  # fmt: skip
    parser.add_argument("--flops-budgets", type=float, nargs="+", help="training FLOPs (equal-FLOPs runs)")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'under load from other jobs')")
    parser.add_argument("--calibration-steps", type=int, default=30, help="steps timed to set the first run's length")
    parser.add_argument("--finetune-steps", type=int, default=200, help="fine-tuning steps (7 epochs of 454)")
    parser.add_argument("--finetune-lr", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, default=5, help="fine-tuning seeds per pretrained encoder")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=("tiny", "tiny-modern", "tiny-faithful"),
        help="the encoder both objectives pretrain (training/configs/encoder-PRESET.yaml; tiny-modern: the modern "
        "recipe's backbone, at its 30%% masking)",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model, few documents, budgets of seconds")
    args = parser.parse_args(argv)
    if args.budgets is None and args.flops_budgets is None:
        args.budgets = [75.0, 150.0, 300.0]
    if args.tiny:
        args.calibration_steps, args.finetune_steps, args.seeds = 3, 4, 1
        args.budgets = [1.0, 2.0] if args.budgets else None
        args.flops_budgets = [5e8, 1e9] if args.flops_budgets else None
    args.kinds = [kind for kind, given in zip(KINDS, (args.budgets, args.flops_budgets), strict=True) if given]
    return args


def pretraining_settings(objective: str, args: argparse.Namespace, output_dir: Path, steps: int, tokenizer):
    """The --preset encoder (or its architecture at a tiny size), no checkpoints, one held-out evaluation at the
    end."""
    overrides = dict(objective=objective, output_dir=str(output_dir), overwrite=True, max_steps=steps)
    overrides.update(save_every=0, eval_every=0, report_to="none", warmup_steps=max(1, steps // 10))
    if tokenizer is not None:
        overrides["tokenizer"] = str(tokenizer)
    if args.tiny:
        overrides.update(model=TINY_MODEL, max_documents=12, vocab_size=384, block_size=32, batch_size=8)
        overrides.update(eval_batches=2)
    return resolve_arguments(
        family="encoder", preset=args.preset, overrides=overrides, configs_dir=ROOT / "training" / "configs"
    )


def training_flops(objective: str, settings, config_folder: Path) -> tuple[float, float]:
    """(FLOPs per token, FLOPs per step) of the module the objective trains, built from the run's settings and the
    config of the tokenizer run (same vocabulary); see the module docstring."""
    config, trained = AutoConfig.from_pretrained(config_folder), REGISTRY[objective]
    model = trained.build_model(config, settings)
    return trained.training_flops(model, settings.block_size, label_share=trained.label_share(settings))


def held_out_numbers(objective: str, final: dict) -> dict:
    """The numbers of the last held-out evaluation that compare across objectives: the masked-LM loss (ELECTRA:
    its generator's) and, for ELECTRA, what shows whether its discriminator learned beyond its base rate."""
    if objective == "electra":
        names = ("rtd_loss", "rtd_accuracy", "rtd_base_rate", "generator_accuracy", "replaced_share")
        return {
            "mlm_loss": final["mlm_loss"],
            **{name: final[name] for name in names},
            "rtd_constant_loss": constant_rtd_loss(final["rtd_base_rate"]),
        }
    return {"mlm_loss": final["loss"]}


def constant_rtd_loss(base_rate: float) -> float:
    """The RTD loss of the best constant answer (the logit of the replaced share everywhere): the binary entropy of
    the base rate. A discriminator whose held-out RTD loss is not below it has learned nothing from the text."""
    return -(base_rate * math.log(base_rate) + (1.0 - base_rate) * math.log(1.0 - base_rate))


def pretrain(objective: str, kind: str, budget: float, steps: int, args, work: Path, tokenizer) -> dict:
    """One run of `steps` steps, meant to spend `budget` (seconds or FLOPs, after `kind`)."""
    folder = work / f"{kind}-{objective}-{budget:g}"
    settings = pretraining_settings(objective, args, folder, steps, tokenizer)
    per_token, per_step = training_flops(objective, settings, tokenizer)
    metrics = run_pretraining(settings)
    return {
        "objective": objective,
        "budget": budget,
        "steps": metrics["steps"],
        "train_time_s": metrics["train_time_s"],
        "tokens_seen": metrics["tokens_seen"],
        "flops_per_token": per_token,
        "flops_per_step": per_step,
        "pretraining_flops": per_token * metrics["tokens_seen"] + per_step * metrics["steps"],
        "final_eval_loss": metrics["final_eval_loss"],
        **held_out_numbers(objective, metrics["history"]["eval"][-1]),
        "folder": str(folder),
    }


def seconds_per_step(objective: str, args: argparse.Namespace, work: Path, tokenizer) -> float:
    """A short run of the objective, timed."""
    folder = work / f"{objective}-calibration"
    calibration = run_pretraining(pretraining_settings(objective, args, folder, args.calibration_steps, tokenizer))
    return calibration["train_time_s"] / calibration["steps"]


def budget_runs(objective: str, kind: str, args, work: Path, tokenizer, tokens_per_step: float) -> list[dict]:
    """The objective's runs at every budget of `kind`, each run's length set from the rate its previous run
    measured."""
    rows = []
    if kind == "equal-time":
        rate = seconds_per_step(objective, args, work, tokenizer)
        for budget in args.budgets:
            row = pretrain(objective, kind, budget, max(2, round(budget / rate)), args, work, tokenizer)
            rate = row["train_time_s"] / row["steps"]
            rows.append(row)
        return rows
    for budget in args.flops_budgets:
        settings = pretraining_settings(objective, args, work / "unused", 1, tokenizer)
        per_token, per_step = training_flops(objective, settings, tokenizer)
        steps = max(2, round(budget / (per_token * tokens_per_step + per_step)))
        row = pretrain(objective, kind, budget, steps, args, work, tokenizer)
        tokens_per_step = row["tokens_seen"] / row["steps"]
        rows.append(row)
    return rows


def load_report(folder: Path, classes: int = CLASSES) -> list[str]:
    """Print and return the modules AutoModelForSequenceClassification initialises anew from the pretrained folder;
    anything beyond the classifier means the encoder's weights did not load, and stops the benchmark."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its own table of the same keys
    try:
        _, info = AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=classes, output_loading_info=True
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    missing = sorted({key.rsplit(".", 1)[0] for key in info["missing_keys"]})
    print(f"{folder.name}: newly initialised {missing}; unused {sorted(info['unexpected_keys'])}", file=sys.stderr)
    if any(not name.startswith("classifier.") for name in missing):
        raise RuntimeError(f"{folder}: the encoder did not load (missing {missing})")
    return missing


def classification_files(work: Path) -> tuple[Path, Path]:
    """The embedded sequence-classification data at its full size: every docstring first paragraph of the four
    packages, balanced (189 each, where the task's default takes 100), HELD_OUT of it held out; (train, validation)
    JSON-lines files."""
    rows = package_docstrings(per_package=None)
    held_out = round(len(rows) * HELD_OUT)
    files = work / "classification-train.jsonl", work / "classification-validation.jsonl"
    for path, part in zip(files, (rows[:-held_out], rows[-held_out:]), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in part))
    return files


def finetune(
    folder: Path,
    args: argparse.Namespace,
    work: Path,
    data: tuple[Path, Path],
    *,
    lr: float | None = None,
    seeds: int | None = None,
    classes: int = CLASSES,
    pair: bool = False,
    tag: str = "",
) -> dict:
    """Sequence classification of the rows in `data` (train, evaluation), the same settings for every encoder;
    accuracy per seed (seed s draws the same classifier initialisation and data order for every encoder: the seeds
    pair up). `pair`: the rows hold a second text ("text_pair"); `lr` and `seeds` default to the run's."""
    newly_initialised = load_report(folder, classes)
    accuracies = []
    for seed in range(args.seeds if seeds is None else seeds):
        finetuning = FinetuningArguments.resolve(
            dict(
                task="sequence-classification",
                model=str(folder),
                output_dir=str(work / f"finetune-{folder.name}{tag}-{seed}"),
                overwrite=True,
                train_file=str(data[0]),
                validation_file=str(data[1]),
                text_pair_column="text_pair" if pair else None,
                max_eval_examples=TINY_HELD_OUT if args.tiny else None,
                max_steps=args.finetune_steps,
                warmup_steps=args.finetune_steps // 10,
                batch_size=16,
                lr=args.finetune_lr if lr is None else lr,
                max_length=128 if pair else 64,
                seed=seed,
            )
        )  # resolve: text_pair_column is the sequence-classification task's own setting
        accuracies.append(run_finetuning(finetuning)["eval_accuracy"])
    return {
        "newly_initialised": newly_initialised,
        "accuracies": accuracies,
        "accuracy_mean": statistics.fmean(accuracies),
        "accuracy_std": statistics.pstdev(accuracies),
    }


def paired(accuracies: list[float], reference: list[float]) -> dict:
    """Seed-by-seed differences `accuracies - reference` (the same seeds): their mean, std and how many are > 0."""
    differences = [a - b for a, b in zip(accuracies, reference, strict=True)]
    return {
        "mean": statistics.fmean(differences),
        "std": statistics.pstdev(differences),
        "wins": sum(d > 0 for d in differences),
        "seeds": len(differences),
    }


def paired_comparisons(section: dict) -> list[dict]:
    """Each pretrained encoder against the random one, and ELECTRA against masked LM at each budget."""
    rows, baseline = section["results"], section["baseline"]["accuracies"]
    comparisons = [
        {"what": f"{row['objective']} {row['budget']:g} - random init", **paired(row["accuracies"], baseline)}
        for row in rows
    ]
    by_budget = {(row["objective"], row["budget"]): row for row in rows}
    for (objective, budget), row in by_budget.items():
        if objective == "electra" and ("masked-lm", budget) in by_budget:
            masked = by_budget[("masked-lm", budget)]
            comparisons.append(
                {"what": f"electra - masked-lm at {budget:g}", **paired(row["accuracies"], masked["accuracies"])}
            )
    return comparisons


def random_encoder(folder: Path, like: Path) -> Path:
    """An untrained encoder of the same config and tokenizer as the folder `like` (compute 0): the baseline."""
    from transformers import AutoTokenizer

    import coreformer as cf

    torch.manual_seed(0)
    cf.CoreformerEncoderModel(AutoConfig.from_pretrained(like)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(like).save_pretrained(folder)
    return folder


def _number(row: dict, key: str, form: str) -> str:
    return format(row[key], form) if row.get(key) is not None else "—"


def markdown(sections: dict[str, dict]) -> str:
    """One table per kind of budget, each under a line saying what its budgets are and how the machine was, and
    the paired differences of its fine-tuned accuracies."""
    blocks = []
    for kind, section in sections.items():
        baseline = section["baseline"]
        seeds = len(baseline["accuracies"])
        lines = [
            f"### {kind}: budgets in {KINDS[kind][0]}" + (f" ({section['note']})" if section.get("note") else ""),
            "",
            "| objective | budget | steps | training time (s) | tokens | pretraining FLOPs | held-out MLM loss "
            "(ELECTRA: generator) | RTD loss / constant's | RTD accuracy / base rate | fine-tuned accuracy "
            f"(mean ± std, {seeds} seeds) |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| none (random init) | 0 | 0 | 0 | 0 | 0 | — | — | — | {baseline['accuracy_mean']:.3f} ± "
            f"{baseline['accuracy_std']:.3f} |",
        ]
        for row in section["results"]:
            loss, accuracy = "—", "—"
            if row.get("rtd_accuracy") is not None:
                accuracy = f"{row['rtd_accuracy']:.4f} / {row['rtd_base_rate']:.4f}"
            if row.get("rtd_constant_loss") is not None:
                loss = f"{row['rtd_loss']:.4f} / {row['rtd_constant_loss']:.4f}"
            lines.append(
                f"| {row['objective']} | {row['budget']:g} | {row['steps']} | {row['train_time_s']:.1f} | "
                f"{row['tokens_seen']:,} | {row['pretraining_flops']:.3g} | {_number(row, 'mlm_loss', '.3f')} | "
                f"{loss} | {accuracy} | {row['accuracy_mean']:.3f} ± {row['accuracy_std']:.3f} |"
            )
        lines += [
            "",
            "| paired by fine-tuning seed | accuracy difference (mean ± std) | seeds where > 0 |",
            "|---|---|---|",
        ]
        lines += [
            f"| {c['what']} | {c['mean']:+.3f} ± {c['std']:.3f} | {c['wins']} / {c['seeds']} |"
            for c in paired_comparisons(section)
        ]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def plot(sections: dict[str, dict], path: Path) -> None:
    """Accuracy against pretraining FLOPs (every kind of budget) and against seconds (equal-time runs only: the
    seconds of equal-FLOPs runs depend on the machine's load); each section's note in the caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 5))
    for kind, section in sections.items():
        baseline, style = section["baseline"], "-" if kind == "equal-flops" else "--"
        for objective in OBJECTIVES:
            rows = sorted((r for r in section["results"] if r["objective"] == objective), key=lambda r: r["budget"])
            for axis, key in zip(axes, ("pretraining_flops", "train_time_s"), strict=True):
                if key == "train_time_s" and kind != "equal-time":
                    continue
                axis.errorbar(
                    [0.0] + [r[key] for r in rows],
                    [baseline["accuracy_mean"]] + [r["accuracy_mean"] for r in rows],
                    yerr=[baseline["accuracy_std"]] + [r["accuracy_std"] for r in rows],
                    marker="o",
                    linestyle=style,
                    capsize=3,
                    label=f"{objective}, {kind}",
                )
    for axis, label in zip(axes, ("pretraining FLOPs", "pretraining time (s), equal-time runs"), strict=True):
        axis.set(xlabel=label, ylabel="fine-tuned accuracy (validation)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    notes = [f"{kind}: {section['note']}" for kind, section in sections.items() if section.get("note")]
    figure.suptitle("ELECTRA vs masked LM: sequence classification after pretraining (compute 0: random init)")
    figure.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom")
    figure.tight_layout(rect=(0, 0.04 * len(notes), 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def merge_section(report: dict, kind: str, section: dict) -> dict[str, dict]:
    """The report with `kind`'s section replaced by this run's and every other kind's kept; its sections in KINDS
    order."""
    report["sections"][kind] = section
    return {name: report["sections"][name] for name in KINDS if name in report["sections"]}


def run_kind(kind: str, args, work: Path, tokenizer: Path, tokens_per_step: float, data, baseline: dict) -> dict:
    """Every objective at every budget of `kind`, each fine-tuned; the run's randomly initialised baseline beside
    them."""
    started, results = time.perf_counter(), []
    for objective in OBJECTIVES:
        for row in budget_runs(objective, kind, args, work, tokenizer, tokens_per_step):
            row.update(finetune(Path(row.pop("folder")), args, work, data))
            results.append(row)
            print(f"{kind} {objective} {row['budget']:g}: accuracy {row['accuracy_mean']:.3f}", file=sys.stderr)
    return {
        "machine": {"platform": platform.platform(), "cpu": platform.processor(), "threads": torch.get_num_threads()},
        "note": args.note,
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "baseline": baseline,
        "results": results,
        "wall_time_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = "electra_vs_mlm_tiny" if args.tiny else "electra_vs_mlm"
    path = args.output_dir / f"{name}.json"
    report = json.loads(path.read_text()) if path.is_file() else {"sections": {}}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        # One tokenizer for every run (WordPiece training is not reproducible): trained by a first short run.
        first = run_pretraining(pretraining_settings("masked-lm", args, work / "tokenizer-run", 1, None))
        tokenizer, data = work / "tokenizer-run", classification_files(work)
        tokens_per_step = first["tokens_seen"] / first["steps"]
        baseline = finetune(random_encoder(work / "random-init", tokenizer), args, work, data)  # one for every kind
        for kind in args.kinds:
            section = run_kind(kind, args, work, tokenizer, tokens_per_step, data, baseline)
            sections = merge_section(report, kind, section)
            for section in sections.values():
                section["paired"] = paired_comparisons(section)
            path.write_text(json.dumps(report, indent=2) + "\n")  # after each kind: a later failure keeps it
    table = markdown(sections)
    (args.output_dir / f"{name}.md").write_text(table)
    plot(sections, args.output_dir / f"{name}.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
