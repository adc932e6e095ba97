"""Few-shot: what pretrained encoders show from a few examples per class, fine-tuned or scored by their own masked-LM
head, paired against random init.

benchmarks/recipes.py fine-tunes a fresh classifier on every encoder; at 32 examples per class that leaves every
encoder, pretrained or not, near chance on the context tasks: the classifier cannot learn from 64 rows what the
encoder knows. Few-shot methods for masked LMs use the pretrained head instead (Schick & Schütze 2021, PET; Gao et al.
2021, LM-BFF). This benchmark measures both on the same rows, for the pretrained encoders of benchmarks/recipes.py's
recipes at one FLOPs budget and for a randomly initialised one of the modern recipe's architecture (with a random
masked-LM head):

    fine-tuned    recipes.py's few-shot fine-tuning (a new classifier on the encoder, --few-shot-steps steps), its
                  learning rate chosen per encoder on the dev split
    likelihood    each row scored by the encoder's masked-LM head, without training it: the pseudo-log-likelihood
                  terms of the row's text, one token masked at a time (zero_shot.masked_token_log_probs); for a pair
                  of texts, those of the second text after the first and alone. A logistic regression on the row's
                  score, fitted to the few examples, is the classifier. The score is chosen per encoder on the dev
                  split from SCORES:

        mean log-prob          mean over the text's tokens of log p(token | the rest)   (a corrupted line: lower)
        lowest log-prob        the least likely token's                                  (a corrupted line: lower)
        mutual information     pairs: mean over the second text's tokens of log p(token | the first text, the
                               rest) - log p(token | the rest): how much the first text helps predict the second
                               (pointwise mutual information; Holtzman et al. 2021 score choices this way)
        all                    every one of the above, together

Rows are recipes.py's (task_splits: split by source file, every split balanced, so chance is 0.5). Draw d takes
--shots rows per class from the training split at random (seed d) and is scored on the whole test split; every
encoder and both methods get the same draws, so the report pairs them draw by draw against random init (mean ± std
of the differences, and on how many draws the encoder is ahead). Settings are chosen on one draw of --shots per class
from the training split minus dev, scored on dev. Only the binary context tasks: the lexical control has four
classes and no text whose likelihood answers it.

Writes results/few_shot.json and few_shot.md (machine, date and command at the top).

    python benchmarks/few_shot.py                    # both recipes at 2.4e13 FLOPs, 32 per class, 5 draws
    python benchmarks/few_shot.py --tiny             # a smoke run (the test)
"""

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from results_files import report_head, results_header, sibling, write_results

import coreformer as cf
from coreformer.training.zero_shot import load_language_model, masked_token_log_probs

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sibling("recipes")  # the tasks, the pretraining runs and the few-shot fine-tuning
EVM = RECIPES.EVM  # paired differences and the random-init baseline
TASKS = ("next-line", "corrupted", "docstring")  # recipes.py's binary context tasks
BUDGET = 2.4e13  # training FLOPs: recipes.py's largest encoder budget, about the default preset's training
TINY_BUDGET = 3e8
POSITIVE = {"next-line": "next", "corrupted": "corrupted", "docstring": "documents"}  # the label a score predicts
MAX_LENGTH = {True: 128, False: 64}  # tokens of a pair of texts, of one text: as the fine-tuning runs truncate them
# score -> the features (`features`' names) its logistic regression reads; a score reading one of PAIR_FEATURES is
# for pairs of texts only
SCORES = {
    "mean log-prob": ("mean",),
    "lowest log-prob": ("lowest",),
    "mutual information": ("mutual information",),
    "all": ("mean", "lowest", "mutual information"),
}
PAIR_FEATURES = frozenset({"mutual information"})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["tiny-faithful", "tiny-modern"], help="recipes.py's")
    parser.add_argument("--flops-budget", type=float, help=f"pretraining FLOPs (default {BUDGET:g})")
    parser.add_argument("--shots", type=int, default=32, help="examples per class of each draw")
    parser.add_argument("--draws", type=int, default=5, help="draws of the examples (paired across encoders)")
    parser.add_argument("--few-shot-steps", type=int, default=200, help="fine-tuning steps (recipes.py's few-shot)")
    parser.add_argument("--finetune-lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3], help="chosen on dev")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'under load from other jobs')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="tiny models and budget, 2 draws of 4: a smoke run")
    args = parser.parse_args(argv)
    if "tiny-modern" not in args.recipes:
        parser.error("--recipes must include tiny-modern: random init is its architecture")
    args.command = "python benchmarks/few_shot.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.flops_budget = args.flops_budget or (TINY_BUDGET if args.tiny else BUDGET)
    if args.tiny:
        args.shots, args.draws, args.few_shot_steps, args.finetune_lrs = 4, 2, 4, [1e-3]
    # what recipes.py's and electra_vs_mlm.py's fine-tuning read
    args.seeds, args.finetune_steps, args.finetune_lr = 1, args.few_shot_steps, args.finetune_lrs[0]
    return args


# ---------------------------------------------------------------------------------------------------------------------
# The rows: draws of a few per class
# ---------------------------------------------------------------------------------------------------------------------


def draw(rows: list[dict], shots: int, seed: int) -> list[dict]:
    """`shots` rows of each label, drawn at random (seed), in label order."""
    rng = random.Random(seed)
    by_label = {label: [row for row in rows if row["label"] == label] for label in sorted({r["label"] for r in rows})}
    for label, pool in by_label.items():
        if len(pool) < shots:
            raise ValueError(f"--shots {shots}: the split holds only {len(pool)} rows labelled {label!r}; draw fewer.")
    return [row for pool in by_label.values() for row in rng.sample(pool, shots)]


# ---------------------------------------------------------------------------------------------------------------------
# Likelihood: rows scored by the masked-LM head, a logistic regression fitted to the draw
# ---------------------------------------------------------------------------------------------------------------------


def features(folder: Path, rows: list[dict], pair: bool) -> dict[tuple, dict[str, float]]:
    """Each distinct row's features (row_key -> {feature: value}) from the folder's masked-LM head."""
    model, tokenizer, _ = load_language_model(folder)
    distinct = list({row_key(row): row for row in rows}.values())
    texts = [row["text_pair"] if pair else row["text"] for row in distinct]
    contexts = [row["text"] for row in distinct] if pair else None
    given = masked_token_log_probs(model, tokenizer, texts, contexts, max_length=MAX_LENGTH[pair])
    alone = masked_token_log_probs(model, tokenizer, texts, max_length=MAX_LENGTH[pair]) if pair else given
    table = {}
    for row, terms, own in zip(distinct, given, alone, strict=True):
        if len(terms) == 0:
            raise ValueError(f"A row has no text to score after truncation: {row!r}")
        values = {"mean": terms.mean().item(), "lowest": terms.min().item()}
        if pair:  # the same tokens: the pair's truncation may have cut the second text's tail
            values["mutual information"] = terms.mean().item() - own[: len(terms)].mean().item()
        table[row_key(row)] = values
    return table


def row_key(row: dict) -> tuple:
    return row["text"], row.get("text_pair")


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-2):
    """A logistic regression on standardised features (L2 `l2`, L-BFGS in float64: deterministic); returns the
    function (M, F) features -> (M,) bool predictions."""
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp(min=1e-9)
    z = (x - mean) / std  # (N, F)
    weights = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)  # (F + 1,): the last is the bias
    optimiser = torch.optim.LBFGS([weights], max_iter=100, line_search_fn="strong_wolfe")

    def closure():
        optimiser.zero_grad()
        logits = z @ weights[:-1] + weights[-1]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y) + l2 * weights[:-1].square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimiser.step(closure)
    fitted = weights.detach()
    return lambda features: ((features - mean) / std) @ fitted[:-1] + fitted[-1] > 0


def likelihood_accuracy(table: dict, score: str, training: list[dict], evaluation: list[dict], positive: str) -> float:
    """Accuracy on `evaluation` of the logistic regression on `score`'s features fitted to `training`."""

    def matrix(rows):  # (N, F)
        values = [[table[row_key(row)][name] for name in SCORES[score]] for row in rows]
        return torch.tensor(values, dtype=torch.float64)

    def truth(rows):  # (N,)
        return torch.tensor([row["label"] == positive for row in rows])

    predict = fit_logistic(matrix(training), truth(training).double())
    return (predict(matrix(evaluation)) == truth(evaluation)).double().mean().item()


def scores_for(pair: bool) -> list[str]:
    """The SCORES a task of pairs (or of single texts) chooses from."""
    return [name for name, needed in SCORES.items() if pair or not PAIR_FEATURES & set(needed)]


def by_likelihood(folder: Path, task: str, splits: dict, draws: list[list[dict]], dev_draw: list[dict]) -> dict:
    """The score chosen on dev, then its accuracy on the test split for every draw."""
    _, _, pair, _ = RECIPES.TASKS[task]
    positive = POSITIVE[task]
    table = features(folder, [row for rows in (*draws, dev_draw, splits["dev"], splits["test"]) for row in rows], pair)
    dev = {score: likelihood_accuracy(table, score, dev_draw, splits["dev"], positive) for score in scores_for(pair)}
    score = max(dev, key=dev.__getitem__)
    accuracies = [likelihood_accuracy(table, score, rows, splits["test"], positive) for rows in draws]
    return {"score": score, "dev_accuracy": dev, **summary(accuracies)}


# ---------------------------------------------------------------------------------------------------------------------
# Fine-tuned: recipes.py's few-shot fine-tuning on the same draws
# ---------------------------------------------------------------------------------------------------------------------


def finetuning_files(task: str, splits: dict, draws, dev_draw, work: Path) -> dict:
    """The task's JSON-lines files, written once for every encoder: (training, evaluation) of the dev choice and of
    each draw."""
    test = RECIPES.write_rows(work / f"{task}-test.jsonl", splits["test"])
    return {
        "dev": (
            RECIPES.write_rows(work / f"{task}-dev-draw.jsonl", dev_draw),
            RECIPES.write_rows(work / f"{task}-dev.jsonl", splits["dev"]),
        ),
        "draws": [
            (RECIPES.write_rows(work / f"{task}-draw-{index}.jsonl", rows), test) for index, rows in enumerate(draws)
        ],
    }


def by_finetuning(folder: Path, task: str, files: dict, args, work: Path) -> dict:
    """The learning rate chosen on dev, then a fine-tuning run (seed 0) on every draw, scored on the test split."""
    _, classes, pair, _ = RECIPES.TASKS[task]

    def accuracy(data, lr: float, tag: str) -> float:
        run = EVM.finetune(folder, args, work, data, lr=lr, seeds=1, classes=classes, pair=pair, tag=f"-{task}-{tag}")
        return run["accuracy_mean"]

    dev = {f"{lr:g}": accuracy(files["dev"], lr, "dev") for lr in args.finetune_lrs}
    lr = max(args.finetune_lrs, key=lambda value: dev[f"{value:g}"])
    accuracies = [accuracy(data, lr, f"draw-{index}") for index, data in enumerate(files["draws"])]
    return {"lr": lr, "dev_accuracy": dev, **summary(accuracies)}


def summary(accuracies: list[float]) -> dict:
    return {
        "accuracies": accuracies,
        "accuracy_mean": statistics.fmean(accuracies),
        "accuracy_std": statistics.pstdev(accuracies),
    }


# ---------------------------------------------------------------------------------------------------------------------
# The encoders and the run
# ---------------------------------------------------------------------------------------------------------------------


def pretrained(args, work: Path) -> tuple[dict, dict[str, Path]]:
    """recipes.py's encoder pretraining at the budget (one tokenizer for every recipe, each scored zero-shot): its
    rows, and each recipe's folder."""
    recipes_argv = ["--families", "encoder", "--recipes", *args.recipes, "--flops-budgets", f"{args.flops_budget:g}"]
    section = RECIPES.family_section("encoder", RECIPES.parse_args(recipes_argv + ["--tiny"] * args.tiny), work)
    return section, {row["recipe"]: Path(row["folder"]) for row in section["results"]}


def run(args, work: Path) -> dict:
    """Pretrain, then every task: the same draws for every encoder, fine-tuned and by likelihood, paired."""
    section, folders = pretrained(args, work)
    # random init: the modern recipe's architecture, with a random masked-LM head for the likelihood scores
    random_init = EVM.random_encoder(work / "random-init", folders["tiny-modern"], cf.CoreformerEncoderForMaskedLM)
    encoders = {"random init": random_init, **folders}
    tasks = {}
    for task in args.tasks:
        splits = RECIPES.task_splits(task, args.tiny)
        draws = [draw(splits["train"], args.shots, seed) for seed in range(args.draws)]
        dev_draw = draw(splits["train minus dev"], args.shots, 0)
        files = finetuning_files(task, splits, draws, dev_draw, work)
        results = {
            name: {
                "fine-tuned": by_finetuning(folder, task, files, args, work),
                "likelihood": by_likelihood(folder, task, splits, draws, dev_draw),
            }
            for name, folder in encoders.items()
        }
        for name in folders:
            for method, result in results[name].items():
                baseline = results["random init"][method]["accuracies"]
                result["paired_vs_random"] = EVM.paired(result["accuracies"], baseline)
        tasks[task] = {
            "measures": RECIPES.TASKS[task][3],
            "rows": {split: len(rows) for split, rows in splits.items()},
            "encoders": results,
        }
        print(f"{task}: {json.dumps({n: {m: r['accuracy_mean'] for m, r in e.items()} for n, e in results.items()})}")
    for row in section["results"]:
        row.pop("folder")
    return {"pretraining": section["results"], "tasks": tasks}


TITLE = "Few-shot: pretrained encoders fine-tuned, or scored by their masked-LM head, against random init"


def markdown(report: dict) -> str:
    lines = [
        *results_header(TITLE, report),
        "",
        "Pretraining (benchmarks/recipes.py's runs, scored by `coreformer evaluate`):",
        "",
        "| recipe | training FLOPs | held-out loss (masked LM at 15%) | below unigram entropy | minimal pairs |",
        "|---|---|---|---|---|",
    ]
    for row in report["pretraining"]:
        lines.append(
            f"| {row['recipe']} | {row['pretraining_flops']:.3g} | {row['held_out_loss']:.4f} | "
            f"{row['unigram_entropy'] - row['held_out_loss']:.3f} | {row['minimal_pair_accuracy']:.3f} |"
        )
    settings = report["settings"]
    lines += [
        "",
        f"Each of {settings['draws']} draws: {settings['shots']} training rows per class; accuracy on the whole test "
        "split (balanced: chance 0.5); paired draw by draw against random init.",
        "",
        "| task | what it measures | encoder | fine-tuned: lr (dev) | accuracy | vs random init | likelihood: score "
        "(dev) | accuracy | vs random init |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task, entry in report["tasks"].items():
        for name, methods in entry["encoders"].items():
            cells = []
            for method, chosen in (("fine-tuned", "lr"), ("likelihood", "score")):
                result = methods[method]
                setting = f"{result[chosen]:g}" if chosen == "lr" else result[chosen]
                cells.append(f"{setting} | {result['accuracy_mean']:.3f} ± {result['accuracy_std']:.3f}")
                cells.append(RECIPES.paired_cell(result.get("paired_vs_random")))
            lines.append(f"| {task} | {entry['measures']} | {name} | {' | '.join(cells)} |")
    rows = "; ".join(
        f"{task} {entry['rows']['train']:,} training / {entry['rows']['test']:,} test"
        for task, entry in report["tasks"].items()
    )
    return "\n".join(lines + ["", f"Rows the draws come from and are scored on: {rows}.", ""])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {
        **report_head(args),
    }
    with tempfile.TemporaryDirectory() as scratch:
        report.update(run(args, Path(scratch)))
    report["wall_time_s"] = time.perf_counter() - started
    table = markdown(report)
    write_results(args.output_dir, "few_shot_tiny" if args.tiny else "few_shot", report, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
