"""The report of benchmarks/electra_vs_mlm.py: its gates, its tables, its verdicts and its plot, written after every
run and every task (a run cut off keeps what finished).

    CONTEXT_MARGIN, AUC_GATE           the gates' thresholds (the module docstring of electra_vs_mlm.py says why)
    by_group(runs), group_of(run)      runs grouped by variant and budget, every pretraining seed
    verdicts(report)                   ELECTRA against masked LM per task, paired by seed
    write(report, args, name) -> str   the JSON, the markdown and the plot; the markdown returned
"""

import statistics
from pathlib import Path

from results_files import results_header, write_results

from coreformer.training.zero_shot import EVAL_MLM_PROBABILITY

CONTEXT_MARGIN = 1.0  # nats below the unigram entropy that count as context learned
AUC_GATE = 0.6  # discriminator AUC that counts as replacements detected (0.5: none)


def by_group(runs) -> dict[str, list[dict]]:
    """ "variant budget" -> its runs, in seed order."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(group_of(run), []).append(run)
    return groups


def group_of(run: dict) -> str:
    """ "masked-lm 2.4e+13": a run's variant and budget, every pretraining seed."""
    return f"{run['variant']} {run['budget']:g}"


def _pass(value: bool | None) -> str:
    return "—" if value is None else ("pass" if value else "FAIL")


def runs_markdown(report: dict) -> list[str]:
    entropy = report["unigram_entropy"]
    lines = [
        f"Unigram entropy of the training text: {entropy:.3f} nats per token. Gates: held-out MLM loss at the "
        f"[MASK] tokens of {EVAL_MLM_PROBABILITY:.0%} masking at least {CONTEXT_MARGIN:g} nats below it (context "
        "learned; beside it the loss over all selected tokens, 10% of them left visible and 10% random); ELECTRA's "
        f"discriminator: ROC AUC on held-out replacements at least {AUC_GATE:g} and RTD loss below the constant "
        "answer's (replacements detected).",
        "",
        "| variant | budget (FLOPs) | pretraining seed | steps | tokens | training FLOPs | held-out MLM loss at 15%, "
        "all selected (ELECTRA: generator) | at [MASK] | at [MASK]: below unigram by | context learned | RTD AUC | "
        "RTD loss / constant's | RTD accuracy / base rate | replacements detected | training time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        electra = "rtd_auc" in row
        lines.append(
            f"| {row['variant']} | {row['budget']:g} | {row['seed']} | {row['steps']} | {row['tokens_seen']:,} | "
            f"{row['pretraining_flops']:.3g} | {row['mlm_loss']:.4f} | {row['mlm_loss_at_masks']:.4f} | "
            f"{entropy - row['mlm_loss_at_masks']:+.3f} | "
            f"{_pass(row['gates']['context_learned'])} | "
            + (f"{row['rtd_auc']:.4f} | {row['rtd_loss']:.4f} / {row['rtd_constant_loss']:.4f} | "
               f"{row['rtd_accuracy']:.4f} / {row['rtd_base_rate']:.4f} | " if electra else "— | — | — | ")
            + f"{_pass(row['gates'].get('replacements_detected'))} | {row['train_time_s']:.1f} |"
        )  # fmt: skip
    return lines + [""]


def tasks_markdown(report: dict) -> list[str]:
    seeds = report["settings"]["seeds"]
    lines = [
        f"Fine-tuned accuracy on the held-out split ({seeds} seeds; learning rate chosen per encoder on dev), and "
        "the per-seed differences:",
        "",
        "| task | what it measures | encoder | lr (dev) | accuracy (mean ± std) |",
        "|---|---|---|---|---|",
    ]
    for task, entry in report["tasks"].items():
        for name, result in entry["encoders"].items():
            lines.append(
                f"| {task} | {entry['measures']} | {name} | {result['lr']:g} | "
                f"{result['accuracy_mean']:.3f} ± {result['accuracy_std']:.3f} |"
            )
    lines += ["", "| task | paired by seed | difference (mean ± std) | seeds where > 0 |", "|---|---|---|---|"]
    for entry_task, entry in report["tasks"].items():
        lines += [
            f"| {entry_task} | {c['what']} | {c['mean']:+.3f} ± {c['std']:.3f} | {c['wins']} / {c['seeds']} |"
            for c in entry["paired"]
        ]
    lines += [
        "",
        "Across pretraining seeds (each pretraining run's mean over the fine-tuning seeds, paired by pretraining seed: "
        "the spread is what retraining moves):",
        "",
        "| task | paired by pretraining seed | difference (mean ± std) | pretraining seeds where > 0 |",
        "|---|---|---|---|",
    ]
    for entry_task, entry in report["tasks"].items():
        lines += [
            f"| {entry_task} | {c['what']} | {c['mean']:+.3f} ± {c['std']:.3f} | {c['wins']} / {c['seeds']} |"
            for c in entry["across_pretraining_seeds"]
        ]
    return lines + [""]


def verdicts(report: dict) -> list[dict]:
    """Per ELECTRA variant and budget fine-tuned: whether the gates of its runs and of masked LM's pass, and on the
    context tasks (every task but the lexical control) whether its difference against masked LM, averaged over the
    pretraining seeds, is >= 0 on each."""
    budgets = report["settings"]["finetune_budgets"]
    groups, rows = by_group(run for run in report["runs"] if run["budget"] in budgets), []
    for group, members in groups.items():
        masked = groups.get(group_of({**members[0], "variant": "masked-lm"}))
        if members[0]["objective"] != "electra" or masked is None:
            continue
        differences = {
            task: next(
                c["mean"] for c in entry["across_pretraining_seeds"] if c["what"] == f"{group} - {group_of(masked[0])}"
            )
            for task, entry in report["tasks"].items()
            if task != "package"
        }
        rows.append(
            {
                "electra": group,
                "pretraining_seeds": len(members),
                "gates_pass": all(all(run["gates"].values()) for run in members + masked),
                "context_tasks_at_least_matched": sum(value >= 0 for value in differences.values()),
                "context_tasks": len(differences),
                "mean_difference_vs_masked_lm": statistics.fmean(differences.values()) if differences else None,
            }
        )
    return rows


def verdict_markdown(report: dict) -> list[str]:
    lines = [
        "ELECTRA against masked LM at equal FLOPs, on the context tasks (the package task is the lexical control and "
        "is left out):",
        "",
        "| ELECTRA | pretraining seeds | gates of every run of both pass | context tasks where its difference vs "
        "masked LM (mean over pretraining seeds) >= 0 | mean of those differences |",
        "|---|---|---|---|---|",
    ]
    for row in report["verdicts"]:
        mean = row["mean_difference_vs_masked_lm"]
        lines.append(
            f"| {row['electra']} | {row['pretraining_seeds']} | {'yes' if row['gates_pass'] else 'no'} | "
            f"{row['context_tasks_at_least_matched']} "
            f"/ {row['context_tasks']} | {'—' if mean is None else format(mean, '+.3f')} |"
        )
    return lines + [""]


def markdown(report: dict) -> str:
    header = [
        *results_header("ELECTRA against masked LM at equal training FLOPs (modern encoder recipe)", report),
        "- variants (encoder-tiny-modern backbone): "
        + "; ".join(
            f"{name}: " + ", ".join(f"{k} {v:g}" for k, v in kept.items()) for name, kept in report["variants"].items()
        ),
        "",
    ]
    body = runs_markdown(report)
    if report.get("tasks"):
        body += tasks_markdown(report) + verdict_markdown(report)
    unfinished = [task for task in report["settings"]["tasks"] if task not in report.get("tasks", {})]
    if unfinished:
        body += [f"Not fine-tuned (the run stopped before them): {', '.join(unfinished)}.", ""]
    return "\n".join(header + body)


def plot(report: dict, path: Path) -> None:
    """Held-out MLM loss (at the [MASK] tokens of 15%) against training FLOPs per variant, the unigram entropy as a
    line; ELECTRA's discriminator AUC against training FLOPs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, auc_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, variant in enumerate(report["variants"]):  # one colour per variant in both panels
        rows = [row for row in report["runs"] if row["variant"] == variant]
        if not rows:
            continue
        flops, style = [row["pretraining_flops"] for row in rows], dict(marker="o", color=f"C{index}", label=variant)
        loss_axis.plot(flops, [row["mlm_loss_at_masks"] for row in rows], **style)
        if "rtd_auc" in rows[0]:
            auc_axis.plot(flops, [row["rtd_auc"] for row in rows], **style)
    loss_axis.axhline(report["unigram_entropy"], color="grey", ls="--", lw=0.8, label="unigram entropy")
    loss_axis.set(xscale="log", xlabel="training FLOPs", ylabel="held-out MLM loss at [MASK], 15% (ELECTRA: generator)")
    auc_axis.axhline(0.5, color="grey", ls="--", lw=0.8, label="no signal")
    auc_axis.set(xscale="log", xlabel="training FLOPs", ylabel="discriminator ROC AUC, held-out replacements")
    for axis in (loss_axis, auc_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("ELECTRA vs masked LM at equal training FLOPs" + (f" ({report['note']})" if report["note"] else ""))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write(report: dict, args, name: str) -> str:
    """The JSON, the markdown and the plot of what has finished (written after every run and every task: a run cut
    off keeps them); the markdown returned."""
    report["verdicts"] = verdicts(report) if report["tasks"] else []
    rows = [{key: value for key, value in row.items() if key != "folder"} for row in report["runs"]]
    table = markdown(report)
    write_results(args.output_dir, name, {**report, "runs": rows}, table)
    plot(report, args.output_dir / f"{name}.png")
    return table
