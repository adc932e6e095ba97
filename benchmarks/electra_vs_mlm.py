"""ELECTRA against masked LM at equal training FLOPs, on the modern encoder recipe, judged by its gates and by context
fine-tuning tasks paired by seed.

The backbone is the `tiny-modern` encoder preset (training/configs/encoder-tiny-modern.yaml: pre-norm, rotary, GeGLU,
no biases or dropout, lr 2e-3). Each variant pretrains it on the embedded corpus at every FLOPs budget:

    masked-lm            30% masking (the preset's: Wettig et al. 2023 "Should You Mask 15%" find 30-40% better
                         than BERT's 15% for masked LM)
    electra, 1/4 width   15% masking (Clark et al. 2020, as BERT), RTD weight 50, the generator at 1/4 of the
    electra, 1/2 width   discriminator's width, or 1/2 (the paper's figure 3: generators of 1/4-1/2 width work best)

Budgets are training FLOPs (`Objective.training_flops`, coreformer/training/flops.py: forward + backward of every
network trained; ELECTRA's include the generator and the discriminator and the projection of the shared tables), so
the steps of a run are the same on any machine under any load: steps = budget / (FLOPs per token x tokens per step +
FLOPs per step). Wall time is recorded, comparable only on a quiet machine.

The gates, beside each result (a result whose gates fail says nothing about the objective, only that the budget is
too small for it):

    context learned      held-out masked-LM loss at the [MASK] tokens of a fixed 15% masking (ELECTRA: its
                         generator's) at least CONTEXT_MARGIN nats below the unigram entropy of the training text
                         (a model at the unigram stage predicts token frequencies, not from context). Only the
                         [MASK] tokens: there a token is predicted from its context alone, under every objective;
                         at the selected tokens left visible or replaced at random (BERT's 10% and 10%, which
                         zero_shot.held_out_loss also scores, reported beside) the loss depends on how the
                         objective masked its training input (ELECTRA's generator never sees a random token there,
                         as the paper's code masks: objectives/electra.py)
    replacements seen    ELECTRA: the discriminator's ROC AUC on held-out replacements (its per-token "replaced"
                         logit against the truth, over the held-out split corrupted by its own generator at 15%) at
                         least AUC_GATE, and its held-out RTD loss below the best constant answer's (the binary
                         entropy of the base rate)

The downstream measure: the encoders of the budgets in --finetune-budgets (default: the largest) and a randomly
initialised one of the same architecture are fine-tuned on benchmarks/recipes.py's tasks built from the embedded
text (next-line, corrupted, docstring: context; package: the lexical control), each encoder's learning rate chosen
on a dev split of the training rows (seed 0), then --seeds seeds on the whole training split, scored on the held-out
split. Seed s draws the same classifier initialisation and data order for every encoder, so the report pairs them:
each encoder minus random init, each ELECTRA minus masked LM at the same budget (mean ± std of the per-seed
differences, and on how many seeds it is > 0).

Writes results/electra_vs_mlm.json and .md (machine, date and command at the top) and electra_vs_mlm.png (held-out
MLM loss and discriminator AUC against training FLOPs); the report's tables, verdicts and plot are in
electra_vs_mlm_report.py.

    python benchmarks/electra_vs_mlm.py                                  # the default budgets, 5 seeds
    python benchmarks/electra_vs_mlm.py --flops-budgets 1e13 --tasks corrupted next-line
    python benchmarks/electra_vs_mlm.py --tiny                           # a smoke run (the test)
"""

import argparse
import itertools
import json
import math
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import datasets
import torch
import transformers
from electra_vs_mlm_report import AUC_GATE, CONTEXT_MARGIN, by_group, group_of, write
from results_files import report_head, sibling
from transformers import (
    AutoConfig,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from coreformer.training.data import load_text_dataset
from coreformer.training.finetuning import run_finetuning
from coreformer.training.finetuning.arguments import FinetuningArguments
from coreformer.training.objectives import OBJECTIVES as REGISTRY
from coreformer.training.objectives.electra import DISCRIMINATOR_DIR, GENERATOR_DIR
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.run import resolve_arguments
from coreformer.training.zero_shot import EVAL_MLM_PROBABILITY, held_out_texts
from coreformer.training.zero_shot import unigram_entropy as text_unigram_entropy
from coreformer_settings.objectives import objective_settings

ROOT = Path(__file__).resolve().parents[1]
PRESET = "tiny-modern"
VARIANTS = {  # name -> (objective, its settings); see the module docstring for the sources
    "masked-lm": ("masked-lm", dict(mlm_probability=0.3)),
    "electra, 1/4 width": ("electra", dict(mlm_probability=0.15, generator_fraction=0.25, rtd_weight=50.0)),
    "electra, 1/2 width": ("electra", dict(mlm_probability=0.15, generator_fraction=0.5, rtd_weight=50.0)),
}
BUDGETS = (6e12, 2.4e13)  # training FLOPs: masked LM's ~450 and ~1,800 steps of 16 x 128 on the modern encoder
# (the default encoder preset trains 1,600)
TINY_BUDGETS = (3e8, 6e8)
TINY_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
TASKS = ("next-line", "corrupted", "docstring", "package")  # benchmarks/recipes.py's, chosen before any result
EVAL_SEED = 0  # held-out masking and generator samples: the same for every run
EVAL_BATCHES, EVAL_BATCH_SIZE = 20, 16
CLASSES = 4  # finetune's default: the package task's labels
TINY_HELD_OUT = 32  # --tiny evaluates fine-tuning on the first 32 held-out examples only


def _recipes():
    """benchmarks/recipes.py as a module, loaded when first needed: it loads this module at its top, so a load here
    at import time would loop."""
    if "recipes" not in _LOADED:
        _LOADED["recipes"] = sibling("recipes")
    return _LOADED["recipes"]


_LOADED: dict[str, object] = {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flops-budgets", type=float, nargs="+", help=f"training FLOPs (default {BUDGETS})")
    parser.add_argument("--finetune-budgets", type=float, nargs="+", help="budgets whose encoders are fine-tuned "
                        "(default: the largest)")  # fmt: skip
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--seeds", type=int, default=5, help="fine-tuning seeds per encoder and task")
    parser.add_argument("--pretraining-seeds", type=int, default=1, help="pretraining runs per variant and "
                        "budget (seeds 0, 1, ...; one tokenizer): what retraining alone moves")  # fmt: skip
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--finetune-steps", type=int, default=600)
    parser.add_argument("--finetune-lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3], help="chosen on dev")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'under load from other jobs')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="tiny models and budgets, 1 seed, 1 task: a smoke run")
    args = parser.parse_args(argv)
    args.command = "python benchmarks/electra_vs_mlm.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        args.flops_budgets = args.flops_budgets or list(TINY_BUDGETS)
        args.seeds, args.finetune_steps, args.finetune_lrs = 2, 4, args.finetune_lrs[:2]
        args.tasks = args.tasks if args.tasks != parser.get_default("tasks") else ["corrupted"]
    args.flops_budgets = sorted(args.flops_budgets or BUDGETS)
    args.finetune_budgets = sorted(args.finetune_budgets or args.flops_budgets[-1:])
    unknown = sorted(set(args.finetune_budgets) - set(args.flops_budgets))
    if unknown:
        parser.error(f"--finetune-budgets {unknown} are not among --flops-budgets {args.flops_budgets}")
    if "masked-lm" not in args.variants:
        parser.error("--variants must include masked-lm: ELECTRA is judged against it")
    args.finetune_lr, args.few_shot = args.finetune_lrs[0], 32  # what finetune and recipes.task_files read
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Pretraining at equal FLOPs
# ---------------------------------------------------------------------------------------------------------------------


def pretraining_settings(
    variant: str, args: argparse.Namespace, output_dir: Path, steps: int, tokenizer, seed: int = 0
):
    """The tiny-modern encoder (or its architecture at a tiny size) trained by `variant`, no checkpoints, no
    zero-shot report (the gates are scored here). `seed`: the run's (initialisation, masking, data order and the
    embedded corpus' split)."""
    objective, extra = VARIANTS[variant]
    overrides = dict(objective=objective, output_dir=str(output_dir), overwrite=True, max_steps=steps, seed=seed)
    overrides.update(extra)
    overrides.update(save_every=0, eval_every=0, report_to="none", zero_shot_pairs=0, warmup_steps=max(1, steps // 10))
    if tokenizer is not None:
        overrides["tokenizer"] = str(tokenizer)
    if args.tiny:
        overrides.update(model=TINY_MODEL, max_documents=12, vocab_size=384, block_size=32, batch_size=8)
        overrides.update(eval_batches=2)
    return resolve_arguments(
        family="encoder", preset=PRESET, overrides=overrides, configs_dir=ROOT / "training" / "configs"
    )


def training_flops(objective: str, settings, config_folder: Path) -> tuple[float, float]:
    """(FLOPs per token, FLOPs per step) of the module the objective trains, built from the run's settings and the
    config of the tokenizer run (same vocabulary)."""
    config, trained = AutoConfig.from_pretrained(config_folder), REGISTRY[objective]
    model = trained.build_model(config, settings)
    return trained.training_flops(model, settings.block_size, label_share=trained.label_share(settings))


def steps_for(budget: float, per_token: float, per_step: float, tokens_per_step: float) -> int:
    """The steps that spend `budget` FLOPs (2 at least)."""
    return max(2, round(budget / (per_token * tokens_per_step + per_step)))


def pretrain(
    variant: str, budget: float, args, work: Path, tokenizer: Path, tokens_per_step: float, seed: int = 0
) -> dict:
    """One run spending `budget` FLOPs and its gates."""
    objective = VARIANTS[variant][0]
    slug = re.sub(r"\W+", "-", variant)  # "electra-1-4-width"
    folder = work / f"{slug}-{budget:g}-seed-{seed}"
    per_token, per_step = training_flops(
        objective, pretraining_settings(variant, args, folder, 1, tokenizer, seed), tokenizer
    )
    steps = steps_for(budget, per_token, per_step, tokens_per_step)
    settings = pretraining_settings(variant, args, folder, steps, tokenizer, seed)
    metrics = run_pretraining(settings)
    return {
        "variant": variant,
        "objective": objective,
        "budget": budget,
        "seed": seed,
        "steps": metrics["steps"],
        "tokens_seen": metrics["tokens_seen"],
        "train_time_s": metrics["train_time_s"],
        "flops_per_token": per_token,
        "flops_per_step": per_step,
        "pretraining_flops": per_token * metrics["tokens_seen"] + per_step * metrics["steps"],
        **held_out_gates(folder, objective, settings.block_size),
        "folder": str(folder),
    }


def unigram_entropy(tokenizer: Path, settings) -> float:
    """Entropy (nats per token) of the training split's unigram distribution under the run's tokenizer: the loss of
    a model that predicts token frequencies and nothing from context (the evaluation's, of the training text)."""
    splits = load_text_dataset(
        settings.dataset,
        seed=settings.seed,
        validation_fraction=settings.validation_fraction,
        max_documents=settings.max_documents,
    )
    texts = splits["train"]["text"]
    return text_unigram_entropy(AutoTokenizer.from_pretrained(tokenizer), texts)


# ---------------------------------------------------------------------------------------------------------------------
# The gates
# ---------------------------------------------------------------------------------------------------------------------


def roc_auc(scores: torch.Tensor, positives: torch.Tensor) -> float:
    """ROC AUC of `scores` (N,) for the binary truth `positives` (N,): the probability that a positive scores above
    a negative, ties counting one half (Mann-Whitney U over average ranks). 0.5: no signal."""
    scores, positives = scores.double().flatten(), positives.bool().flatten()
    count, negatives = int(positives.sum()), int((~positives).sum())
    if count == 0 or negatives == 0:
        raise ValueError("ROC AUC needs both classes among the scored tokens; score more held-out text")
    order = scores.argsort()
    _, inverse, tied = torch.unique_consecutive(scores[order], return_inverse=True, return_counts=True)
    first = torch.cumsum(tied, 0) - tied + 1  # each group of tied scores: its first rank (1-based)
    ranks = torch.empty_like(scores)
    ranks[order] = (first + (tied - 1) / 2.0).to(scores.dtype)[inverse]  # a group of t ties: their mean rank
    return float((ranks[positives].sum() - count * (count + 1) / 2) / (count * negatives))


def constant_rtd_loss(base_rate: float) -> float:
    """The RTD loss of the best constant answer (the logit of the replaced share everywhere): the binary entropy of
    the base rate. A discriminator whose held-out RTD loss is not below it has learned nothing from the text."""
    return -(base_rate * math.log(base_rate) + (1.0 - base_rate) * math.log(1.0 - base_rate))


def eval_batches(texts: list[str], tokenizer, objective: str, block_size: int, batches: int, seed: int) -> list[dict]:
    """Held-out batches of `objective`'s collator at 15% masking, the same for every run of the objective."""
    trained = REGISTRY[objective]
    settings = SimpleNamespace(
        family="encoder",
        block_size=block_size,
        seed=seed,
        objective_settings=objective_settings(objective, {"mlm_probability": EVAL_MLM_PROBABILITY}),
    )
    examples = trained.examples(datasets.Dataset.from_dict({"text": texts}), tokenizer, settings).shuffle(seed=seed)
    examples = examples.select(range(min(len(examples), batches * EVAL_BATCH_SIZE)))
    collator = trained.collator(tokenizer, settings)
    rows = [examples[i] for i in range(len(examples))]
    return [collator(rows[s : s + EVAL_BATCH_SIZE]) for s in range(0, len(rows), EVAL_BATCH_SIZE)]


@torch.no_grad()
def replaced_token_detection(folder: Path, texts: list[str], block_size: int, batches: int, device: str) -> dict:
    """The saved discriminator (with its RTD head) on held-out text masked at 15% and filled by the saved generator's
    samples, as in training: ROC AUC of its logits, RTD loss, the constant answer's loss, the base rate."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    generator = AutoModelForMaskedLM.from_pretrained(folder / GENERATOR_DIR).eval().to(device)
    discriminator = AutoModelForTokenClassification.from_pretrained(folder / DISCRIMINATOR_DIR).eval().to(device)
    sampler = torch.Generator(device).manual_seed(EVAL_SEED)
    logits, targets = [], []
    for batch in eval_batches(texts, tokenizer, "electra", block_size, batches, EVAL_SEED):
        batch = {key: value.to(device) for key, value in batch.items()}
        masked = batch["labels"] != -100
        original = torch.where(masked, batch["labels"], batch["input_ids"])
        distributions = generator(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        sampled = torch.multinomial(distributions[masked].float().softmax(-1), 1, generator=sampler).squeeze(-1)
        corrupted = original.masked_scatter(masked, sampled)
        scores = discriminator(input_ids=corrupted, attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        real = batch["attention_mask"].bool()  # (B, T): padding is neither original nor replaced
        logits.append(scores[real].float().cpu())
        targets.append((corrupted != original)[real].float().cpu())
    logit, target = torch.cat(logits), torch.cat(targets)
    base_rate = float((target == 0).float().mean())
    return {
        "rtd_auc": roc_auc(logit, target),
        "rtd_loss": float(torch.nn.functional.binary_cross_entropy_with_logits(logit, target)),
        "rtd_constant_loss": constant_rtd_loss(base_rate),
        "rtd_accuracy": float(((logit > 0).float() == target).float().mean()),
        "rtd_base_rate": base_rate,
        "rtd_tokens": len(target),
    }


def held_out_gates(
    folder: Path, objective: str, block_size: int, *, batches: int = EVAL_BATCHES, device: str = "cpu"
) -> dict:
    """The run's gate numbers on the held-out split of its training text: masked-LM loss at 15% (ELECTRA: its
    generator's) and, for ELECTRA, the discriminator's replaced-token detection."""
    texts, _ = held_out_texts(folder)
    language_model = folder / GENERATOR_DIR if objective == "electra" else folder
    tokenizer = AutoTokenizer.from_pretrained(language_model)
    model = AutoModelForMaskedLM.from_pretrained(language_model).eval().to(device)
    gates = masked_lm_losses(model, tokenizer, texts, block_size, batches, device)
    if objective == "electra":
        gates.update(replaced_token_detection(folder, texts, block_size, batches, device))
    return gates


@torch.no_grad()
def masked_lm_losses(model, tokenizer, texts: list[str], block_size: int, batches: int, device: str) -> dict:
    """The masked LM's held-out loss over one pass of BERT's masking at 15% (zero_shot.held_out_loss's batches): at
    every selected token ("mlm_loss": masked, kept or replaced at random, as `coreformer evaluate` reports it) and at
    the [MASK] tokens only ("mlm_loss_at_masks": the tokens it must predict from their context alone); token means,
    with their token counts."""
    totals = {"selected": 0.0, "at_masks": 0.0}
    counts = {"selected": 0, "at_masks": 0}
    for batch in eval_batches(texts, tokenizer, "masked-lm", block_size, batches, EVAL_SEED):
        batch = {key: value.to(device) for key, value in batch.items()}
        selected = batch["labels"] != -100  # (B, T)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
        labels = batch["labels"][selected]  # (selected,)
        losses = torch.nn.functional.cross_entropy(logits[selected].float(), labels, reduction="none")
        at_masks = (batch["input_ids"] == tokenizer.mask_token_id)[selected]  # (selected,)
        totals["selected"] += float(losses.sum())
        totals["at_masks"] += float(losses[at_masks].sum())
        counts["selected"] += int(selected.sum())
        counts["at_masks"] += int(at_masks.sum())
    return {
        "mlm_loss": totals["selected"] / counts["selected"],
        "mlm_tokens": counts["selected"],
        "mlm_loss_at_masks": totals["at_masks"] / counts["at_masks"],
        "mlm_tokens_at_masks": counts["at_masks"],
    }


def gate_verdicts(row: dict, entropy: float) -> dict:
    """Whether each gate passes: context learned; for ELECTRA, replacements detected."""
    verdicts = {"context_learned": entropy - row["mlm_loss_at_masks"] >= CONTEXT_MARGIN}
    if "rtd_auc" in row:
        verdicts["replacements_detected"] = row["rtd_auc"] >= AUC_GATE and row["rtd_loss"] < row["rtd_constant_loss"]
    return verdicts


# ---------------------------------------------------------------------------------------------------------------------
# Fine-tuning, paired by seed
# ---------------------------------------------------------------------------------------------------------------------


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


def finetune(
    folder: Path,
    args: argparse.Namespace,
    work: Path,
    data: tuple[Path, Path],
    *,
    lr: float | None = None,
    seeds: int | None = None,
    steps: int | None = None,
    classes: int = CLASSES,
    pair: bool = False,
    tag: str = "",
) -> dict:
    """Sequence classification of the rows in `data` (train, evaluation), the same settings for every encoder;
    accuracy per seed (seed s draws the same classifier initialisation and data order for every encoder: the seeds
    pair up). `pair`: the rows hold a second text ("text_pair"); `lr`, `seeds` and `steps` default to the run's."""
    newly_initialised = load_report(folder, classes)
    steps = args.finetune_steps if steps is None else steps
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
                max_steps=steps,
                warmup_steps=steps // 10,
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


def random_encoder(folder: Path, like: Path, model_class: type | None = None) -> Path:
    """An untrained encoder of the same config and tokenizer as the folder `like` (compute 0): the baseline.
    `model_class`: what is saved (default the bare encoder; a masked LM for a baseline scored by its head)."""
    import coreformer as cf

    torch.manual_seed(0)
    (model_class or cf.CoreformerEncoderModel)(AutoConfig.from_pretrained(like)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(like).save_pretrained(folder)
    return folder


def finetuned(encoder: Path, task: str, files: dict, args, work: Path) -> dict:
    """The encoder's learning rate chosen on dev (seed 0), then --seeds seeds on the full training split."""
    return _recipes().finetuned(encoder, task, files, args, work, splits=("full",))["full"]


def comparisons(task: str, results: dict[str, dict], runs: list[dict]) -> list[dict]:
    """Every pretrained encoder against random init, and each ELECTRA against masked LM of the same budget and
    pretraining seed: paired by fine-tuning seed."""
    rows = []
    for run in (run for run in runs if name_of(run) in results):
        references = ["random init"]
        if run["objective"] == "electra" and opponent(run) in results:
            references.append(opponent(run))
        for reference in references:
            rows.append(
                {
                    "task": task,
                    "what": f"{name_of(run)} - {reference}",
                    **paired(results[name_of(run)]["accuracies"], results[reference]["accuracies"]),
                }
            )
    return rows


def across_pretraining_seeds(task: str, results: dict[str, dict], runs: list[dict]) -> list[dict]:
    """Per variant and budget, each pretraining seed's mean accuracy (over the fine-tuning seeds) against random
    init's, and each ELECTRA's against masked LM's of the same budget: paired by pretraining seed, so the spread is
    what retraining moves."""
    groups, rows = by_group(run for run in runs if name_of(run) in results), []
    for group, members in groups.items():
        means = [results[name_of(run)]["accuracy_mean"] for run in members]
        references = {"random init": [results["random init"]["accuracy_mean"]] * len(means)}
        masked = group_of({**members[0], "variant": "masked-lm"})
        if members[0]["objective"] == "electra" and masked in groups:
            references[masked] = [results[name_of(run)]["accuracy_mean"] for run in groups[masked]]
        for reference, reference_means in references.items():
            rows.append({"task": task, "what": f"{group} - {reference}", **paired(means, reference_means)})
    return rows


def name_of(run: dict) -> str:
    """ "masked-lm 2.4e+13, seed 0": one pretraining run."""
    return f"{group_of(run)}, seed {run['seed']}"


def opponent(run: dict) -> str:
    """The masked-LM run an ELECTRA run is judged against: the same budget and pretraining seed."""
    return name_of({**run, "variant": "masked-lm"})


def downstream(report: dict, args, work: Path, tokenizer: Path, name: str) -> None:
    """Each task into report["tasks"]: every fine-tuned encoder's result and the paired comparisons; the report is
    written after each task."""
    recipes, runs, tasks = _recipes(), report["runs"], report["tasks"]
    encoders = {"random init": random_encoder(work / "random-init", tokenizer)}
    encoders.update({name_of(run): Path(run["folder"]) for run in runs if run["budget"] in args.finetune_budgets})
    for task in args.tasks:
        files = recipes.task_files(task, args, work)
        results = {name: finetuned(folder, task, files, args, work) for name, folder in encoders.items()}
        tasks[task] = {
            "measures": recipes.TASKS[task][3],
            "encoders": results,
            "paired": comparisons(task, results, runs),
            "across_pretraining_seeds": across_pretraining_seeds(task, results, runs),
        }
        print(f"{task}: " + ", ".join(f"{n} {r['accuracy_mean']:.3f}" for n, r in results.items()), file=sys.stderr)
        write(report, args, name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = "electra_vs_mlm_tiny" if args.tiny else "electra_vs_mlm"
    started = time.perf_counter()
    report = {
        **report_head(args),
        "variants": {variant: VARIANTS[variant][1] for variant in args.variants},
        "runs": [],
        "tasks": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        # One tokenizer for every run (WordPiece training is not reproducible): trained by a first one-step run.
        first_settings = pretraining_settings("masked-lm", args, work / "tokenizer-run", 1, None)
        first = run_pretraining(first_settings)
        tokenizer, tokens_per_step = work / "tokenizer-run", first["tokens_seen"] / first["steps"]
        report["unigram_entropy"] = unigram_entropy(tokenizer, first_settings)
        seeds = range(args.pretraining_seeds)
        for variant, budget, seed in itertools.product(args.variants, args.flops_budgets, seeds):
            row = pretrain(variant, budget, args, work, tokenizer, tokens_per_step, seed)
            row["gates"] = gate_verdicts(row, report["unigram_entropy"])
            report["runs"].append(row)
            print(f"{name_of(row)}: {json.dumps({k: v for k, v in row.items() if k != 'folder'})}", file=sys.stderr)
            write(report, args, name)
        downstream(report, args, work, tokenizer, name)
    report["wall_time_s"] = time.perf_counter() - started
    print(write(report, args, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
