"""Few-shot: what pretrained encoders show from a few examples per class, fine-tuned with a new classifier, scored by
their own masked-LM head, or fine-tuned through it, paired against random init.

benchmarks/recipes.py fine-tunes a fresh classifier on every encoder; at 32 examples per class that leaves every
encoder, pretrained or not, near chance on the context tasks: the classifier cannot learn from 64 rows what the
encoder knows. Few-shot methods for masked LMs use the pretrained head instead (Schick & Schütze 2021, PET; Gao et al.
2021, LM-BFF). This benchmark measures three ways on the same rows, for the pretrained encoders of
benchmarks/recipes.py's recipes at one FLOPs budget and for a randomly initialised one of the modern recipe's
architecture (with a random masked-LM head):

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

    head-tuned    the encoder and its masked-LM head fine-tuned through the likelihood classifier (PET's way of
                  fine-tuning a masked LM through its pretraining head): the likelihood classifier on one score (mean
                  log-prob for single texts, mutual information for pairs, whose second term, the text alone, stays
                  the untuned encoder's) is the start; the encoder, the head and the regression are trained together
                  on the few examples (--tuned-steps full-batch steps, TUNED_POSITIONS tokens of each text drawn
                  afresh per step); the regression is refitted to the tuned scores, each from at most
                  SCORED_POSITIONS tokens of the text. The learning rate is chosen per encoder on the dev split

Rows are recipes.py's (task_splits: split by source file, every split balanced, so chance is 0.5). Draw d takes
--shots rows per class from the training split at random (seed d) and is scored on the whole test split; every
encoder and every method gets the same draws, so the report pairs them draw by draw against random init (mean ± std
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
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from results_files import report_head, results_header, sibling, write_results

import coreformer as cf
from coreformer.training.zero_shot import (
    MaskedCopy,
    batched_copies,
    load_language_model,
    masked_copies,
    masked_token_log_probs,
)

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
TUNED_FEATURE = {False: "mean", True: "mutual information"}  # what head-tuning trains through: texts, pairs
TUNED_POSITIONS = 4  # tokens of each text scored per head-tuning step, drawn afresh every step
SCORED_POSITIONS = 32  # at most this many tokens of each text score a head-tuned encoder (drawn once, seeded)
METHODS = {"fine-tuned": "lr", "likelihood": "score", "head-tuned": "lr"}  # method -> the setting chosen on dev
REGRESSION_LR = 1e-2  # the head-tuned classifier's logistic regression (two numbers) learns at this rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["tiny-faithful", "tiny-modern"], help="recipes.py's")
    parser.add_argument("--flops-budget", type=float, help=f"pretraining FLOPs (default {BUDGET:g})")
    parser.add_argument("--shots", type=int, default=32, help="examples per class of each draw")
    parser.add_argument("--draws", type=int, default=5, help="draws of the examples (paired across encoders)")
    parser.add_argument("--few-shot-steps", type=int, default=200, help="fine-tuning steps (recipes.py's few-shot)")
    parser.add_argument("--finetune-lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3], help="chosen on dev")
    parser.add_argument("--tuned-steps", type=int, default=40, help="head-tuning's full-batch steps")
    parser.add_argument("--tuned-lrs", type=float, nargs="+", default=[1e-5, 3e-5], help="chosen on dev")
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
        args.tuned_steps, args.tuned_lrs = 2, [1e-3]
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


@dataclass(frozen=True)
class Terms:
    """A row's pseudo-log-likelihood terms from one masked-LM head (zero_shot.masked_token_log_probs)."""

    given: torch.Tensor  # (tokens,): the text's tokens (a pair's second text, after the first)
    alone: torch.Tensor | None  # (tokens,): pairs: the same tokens of the second text alone; None for single texts


def row_terms(folder: Path, rows: list[dict], pair: bool) -> dict[tuple, Terms]:
    """Each distinct row's Terms (row_key -> Terms) from the folder's masked-LM head, without training it."""
    model, tokenizer, _ = load_language_model(folder)
    distinct = list({row_key(row): row for row in rows}.values())
    texts, contexts = scored_texts(distinct, pair)
    given = masked_token_log_probs(model, tokenizer, texts, contexts, max_length=MAX_LENGTH[pair])
    alone = masked_token_log_probs(model, tokenizer, texts, max_length=MAX_LENGTH[pair]) if pair else given
    table = {}
    for row, terms, own in zip(distinct, given, alone, strict=True):
        if len(terms) == 0:
            raise ValueError(f"A row has no text to score after truncation: {row!r}")
        # the same tokens: the pair's truncation may have cut the second text's tail
        table[row_key(row)] = Terms(terms, own[: len(terms)] if pair else None)
    return table


def scored_texts(rows: list[dict], pair: bool) -> tuple[list[str], list[str] | None]:
    """The texts the masked-LM head scores (a pair's second text) and their contexts (a pair's first; None)."""
    if pair:
        return [row["text_pair"] for row in rows], [row["text"] for row in rows]
    return [row["text"] for row in rows], None


def features(terms: Terms) -> dict[str, float]:
    """A row's features (`SCORES`' names) from its terms."""
    values = {"mean": terms.given.mean().item(), "lowest": terms.given.min().item()}
    if terms.alone is not None:
        values["mutual information"] = terms.given.mean().item() - terms.alone.mean().item()
    return values


def row_key(row: dict) -> tuple:
    return row["text"], row.get("text_pair")


@dataclass(frozen=True)
class Logistic:
    """A fitted logistic regression on standardised features."""

    mean: torch.Tensor  # (F,)
    std: torch.Tensor  # (F,)
    weights: torch.Tensor  # (F + 1,): the last is the bias

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """(M, F) features -> (M,) logits."""
        return ((features - self.mean) / self.std) @ self.weights[:-1] + self.weights[-1]

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """(M, F) features -> (M,) bool predictions."""
        return self.logits(features) > 0


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-2) -> Logistic:
    """A logistic regression on standardised features (L2 `l2`, L-BFGS in float64: deterministic), fitted to (N, F)
    features `x` and (N,) labels `y`."""
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
    return Logistic(mean, std, weights.detach())


def truth(rows: list[dict], positive: str) -> torch.Tensor:
    """(N,) whether each row is labelled `positive`."""
    return torch.tensor([row["label"] == positive for row in rows])


def likelihood_accuracy(table: dict, score: str, training: list[dict], evaluation: list[dict], positive: str) -> float:
    """Accuracy on `evaluation` of the logistic regression on `score`'s features fitted to `training`."""

    def matrix(rows):  # (N, F)
        values = [[table[row_key(row)][name] for name in SCORES[score]] for row in rows]
        return torch.tensor(values, dtype=torch.float64)

    predict = fit_logistic(matrix(training), truth(training, positive).double())
    return (predict(matrix(evaluation)) == truth(evaluation, positive)).double().mean().item()


def scores_for(pair: bool) -> list[str]:
    """The SCORES a task of pairs (or of single texts) chooses from."""
    return [name for name, needed in SCORES.items() if pair or not PAIR_FEATURES & set(needed)]


def by_likelihood(terms: dict[tuple, Terms], task: str, splits: dict, draws: list[list[dict]], dev_draw) -> dict:
    """The score chosen on dev, then its accuracy on the test split for every draw."""
    _, _, pair, _ = RECIPES.TASKS[task]
    positive = POSITIVE[task]
    table = {key: features(row) for key, row in terms.items()}
    dev = {score: likelihood_accuracy(table, score, dev_draw, splits["dev"], positive) for score in scores_for(pair)}
    score = max(dev, key=dev.__getitem__)
    accuracies = [likelihood_accuracy(table, score, rows, splits["test"], positive) for rows in draws]
    return {"score": score, "dev_accuracy": dev, **summary(accuracies)}


# ---------------------------------------------------------------------------------------------------------------------
# Head-tuned: the encoder and its masked-LM head fine-tuned through the likelihood classifier
# ---------------------------------------------------------------------------------------------------------------------


def row_copies(tokenizer, rows: list[dict], pair: bool) -> list[list[MaskedCopy]]:
    """Every row's text with one token masked at a time (a pair's second text after the first), truncated as
    `row_terms` truncates it (which has checked that each row keeps a token to score)."""
    return masked_copies(tokenizer, *scored_texts(rows, pair), MAX_LENGTH[pair])


def head_log_probs(model, copies: list[MaskedCopy], pad_token_id: int) -> torch.Tensor:
    """(R,) float32 log p(target | its masked copy), differentiable. The masked-LM head reads the masked position
    only: projecting every other position onto the vocabulary would cost more than the encoder and go unused."""
    values, order = [], []
    for indices, input_ids, mask in batched_copies(copies, pad_token_id):
        chunk = [copies[index] for index in indices]
        hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (R, T, H)
        at_mask = hidden[torch.arange(len(chunk)), torch.tensor([copy.position for copy in chunk])]  # (R, H)
        if model.lm_head_transform is not None:
            at_mask = model.lm_head_transform(at_mask)
        log_probs = torch.log_softmax(model.lm_head(at_mask).float(), dim=-1)  # (R, V)
        values.append(log_probs[torch.arange(len(chunk)), torch.tensor([copy.target for copy in chunk])])
        order += indices
    return torch.empty(len(copies)).index_put((torch.tensor(order),), torch.cat(values))


def tuned_feature(
    model, pad_token_id: int, copies: list[list[MaskedCopy]], references: list[Terms], count: int, rng: random.Random
) -> torch.Tensor:
    """(N,) each row's TUNED_FEATURE from at most `count` of its text's tokens (drawn by `rng`; all of a shorter
    text's): the mean log-prob of a single text; for a pair, the mean over those tokens of log p(token | the first
    text, the rest) - the untuned encoder's log p(token | the rest) from `references` (the row's Terms), the mutual
    information of `features` before any tuning."""
    chosen, owners, alone = [], [], []
    for index, (row, reference) in enumerate(zip(copies, references, strict=True)):
        picked = sorted(rng.sample(range(len(row)), min(count, len(row))))
        chosen += [row[token] for token in picked]
        owners += [index] * len(picked)
        alone += reference.alone[picked].tolist() if reference.alone is not None else [0.0] * len(picked)
    terms = head_log_probs(model, chosen, pad_token_id) - torch.tensor(alone, dtype=torch.float32)  # (R,)
    owners = torch.tensor(owners)
    return torch.zeros(len(copies)).index_add(0, owners, terms) / torch.bincount(owners, minlength=len(copies))


def head_tuned_accuracy(
    folder: Path,
    terms: dict[tuple, Terms],
    task: str,
    training: list[dict],
    evaluation: list[dict],
    lr: float,
    args: argparse.Namespace,
) -> float:
    """Accuracy on `evaluation` after tuning the folder's masked LM on `training`. The likelihood classifier on
    TUNED_FEATURE (a logistic regression on the untuned encoder's feature, from its `terms`) is the starting point;
    the encoder, its head and the regression are then trained together on the classifier's loss for --tuned-steps
    full-batch steps (AdamW at a constant `lr`, the regression at REGRESSION_LR), each step scoring TUNED_POSITIONS
    tokens of every text drawn afresh. The regression is then refitted to the tuned feature of `training`, as the
    likelihood classifier is, and the tuned feature of `evaluation` classified."""
    _, _, pair, _ = RECIPES.TASKS[task]
    positive, feature = POSITIVE[task], TUNED_FEATURE[pair]
    model, tokenizer, _ = load_language_model(folder)
    pad = tokenizer.pad_token_id
    labels = truth(training, positive).double()
    references = [terms[row_key(row)] for row in training]
    start = fit_logistic(torch.tensor([[features(row)[feature]] for row in references], dtype=torch.float64), labels)
    # the fitted regression as a function of the raw feature: weight / std * feature + (bias - weight * mean / std)
    scale = torch.nn.Parameter((start.weights[0] / start.std[0]).float())
    bias = torch.nn.Parameter((start.weights[1] - start.weights[0] * start.mean[0] / start.std[0]).float())
    optimiser = torch.optim.AdamW(
        [{"params": model.parameters(), "lr": lr}, {"params": [scale, bias], "lr": REGRESSION_LR}], weight_decay=0.0
    )
    copies = row_copies(tokenizer, training, pair)
    torch.manual_seed(0)  # dropout, where the recipe has it
    rng = random.Random(0)
    model.train()
    for _ in range(args.tuned_steps):
        logits = scale * tuned_feature(model, pad, copies, references, TUNED_POSITIONS, rng) + bias  # (N,)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    model.eval()

    def scored(rows: list[dict]) -> torch.Tensor:  # (N, 1)
        copies, references = row_copies(tokenizer, rows, pair), [terms[row_key(row)] for row in rows]
        with torch.no_grad():
            return tuned_feature(model, pad, copies, references, SCORED_POSITIONS, random.Random(0))[:, None].double()

    predict = fit_logistic(scored(training), labels)
    return (predict(scored(evaluation)) == truth(evaluation, positive)).double().mean().item()


def by_head_tuning(folder: Path, terms: dict, task: str, splits: dict, draws: list[list[dict]], dev_draw, args) -> dict:
    """The learning rate chosen on dev, then the accuracy on the test split of the encoder tuned on every draw."""
    dev = {
        f"{lr:g}": head_tuned_accuracy(folder, terms, task, dev_draw, splits["dev"], lr, args) for lr in args.tuned_lrs
    }
    lr = max(args.tuned_lrs, key=lambda value: dev[f"{value:g}"])
    accuracies = [head_tuned_accuracy(folder, terms, task, rows, splits["test"], lr, args) for rows in draws]
    return {"lr": lr, "dev_accuracy": dev, **summary(accuracies)}


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
        scored = [row for rows in (*draws, dev_draw, splits["dev"], splits["test"]) for row in rows]
        results = {}
        for name, folder in encoders.items():
            terms = row_terms(folder, scored, pair=RECIPES.TASKS[task][2])  # the untuned head's, once per encoder
            results[name] = {
                "fine-tuned": by_finetuning(folder, task, files, args, work),
                "likelihood": by_likelihood(terms, task, splits, draws, dev_draw),
                "head-tuned": by_head_tuning(folder, terms, task, splits, draws, dev_draw, args),
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


TITLE = "Few-shot: pretrained encoders against random init, three ways (a new classifier, the masked-LM head, tuned)"


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
        "| task | encoder | "
        + " | ".join(f"{method} ({chosen}, on dev) | vs random init" for method, chosen in METHODS.items())
        + " |",
        "|---|---|" + "---|---|" * len(METHODS),
    ]
    for task, entry in report["tasks"].items():
        for name, methods in entry["encoders"].items():
            cells = []
            for method, chosen in METHODS.items():
                result = methods[method]
                setting = f"{result[chosen]:g}" if chosen == "lr" else result[chosen]
                cells.append(f"{result['accuracy_mean']:.3f} ± {result['accuracy_std']:.3f} ({setting})")
                cells.append(RECIPES.paired_cell(result.get("paired_vs_random")))
            lines.append(f"| {task} | {name} | {' | '.join(cells)} |")
    lines += ["", "What each task measures:", ""]
    lines += [f"- {task}: {entry['measures']}" for task, entry in report["tasks"].items()]
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
