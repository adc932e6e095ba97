"""Packed against padded pretraining, per family, on variable-length text: speed, padding, and held-out loss.

For each family (encoder, decoder, seq2seq) and each --packing the family's objective builds (padded, packed; the
decoder also concatenated), one pretraining run of --preset (`tiny` unless given) on the embedded corpus cut into
documents as they come (--documents: whole files, or single non-blank lines), every run spending the same budget of
REAL (non-pad) tokens: its step count is the budget over the real tokens its batches hold (measured on its first
collated batches). Reported per run:

    tokens/s           every position of every row (pad included) per second of training
    real tokens/s      the non-pad tokens per second (what the budget counts)
    pad share          the share of row positions that are padding (packed: only a row's unfilled tail); seq2seq
                       counts its encoder side, the input tokens (pretraining.inputs.input_token_count)
    held-out loss      the final folder's loss on the held-out documents at fixed settings (coreformer evaluate's:
                       masked LM at 15%, causal LM, denoising at 30%), the same text and layout for every mode

Speed compares only on a quiet machine (the step counts and losses do not depend on load).
Writes results/packing.json and packing.md (machine, date and command at the top).

    python benchmarks/packing.py                                   # every family, files and lines
    python benchmarks/packing.py --families encoder --documents lines
    python benchmarks/packing.py --tiny                            # a smoke run (seconds; the test)
"""

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from results_files import report_head, results_header, write_results

from coreformer.training.batches import GlobalBatches
from coreformer.training.corpora import read_source, stdlib_source_files
from coreformer.training.data import iter_texts
from coreformer.training.families import TRAINING_FACTS
from coreformer.training.objectives import OBJECTIVES
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.inputs import (
    build_collator,
    input_token_count,
    load_dataset_splits,
    load_tokenizer,
)
from coreformer.training.pretraining.run import resolve_arguments
from coreformer.training.tokenizer_training import train_tokenizer
from coreformer.training.zero_shot import held_out_loss, load_language_model

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("encoder", "decoder", "seq2seq")
DOCUMENTS = ("files", "lines")
BUDGET = 400_000  # real tokens per run: about a third of the tiny preset's 600 steps of 16 x 128
TINY_MODELS = {
    "encoder": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "decoder": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "seq2seq": dict(hidden_size=32, encoder_layers=1, decoder_layers=1, num_attention_heads=4, intermediate_size=64),
}
MEASURED_BATCHES = 20  # collated batches that measure a mode's real tokens per batch and its pad share


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--documents", nargs="+", choices=DOCUMENTS, default=list(DOCUMENTS))
    parser.add_argument("--budget", type=int, default=BUDGET, help="real (non-pad) training tokens per run")
    parser.add_argument("--max-files", type=int, default=None, help="read at most this many corpus files")
    parser.add_argument("--preset", default="tiny", help="each family's preset (tiny, small, base)")
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None, help="the preset's if unset")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'under load from other jobs')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="tiny models, 40 files, a tiny budget: a smoke run")
    args = parser.parse_args(argv)
    args.command = "python benchmarks/packing.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        args.budget, args.max_files = min(args.budget, 6_000), args.max_files or 40
    return args


def corpus_documents(kind: str, max_files: int | None) -> list[str]:
    """The embedded corpus as documents, in the order the files come: whole files, or their non-blank lines."""
    texts = [text for text in map(read_source, stdlib_source_files()[:max_files]) if text and text.strip()]
    if kind == "files":
        return texts
    return [line for text in texts for line in text.splitlines() if line.strip()]


def packings(family: str) -> tuple[str, ...]:
    """The --packing modes the family's default objective builds."""
    return OBJECTIVES[TRAINING_FACTS[family].default_objective].packings


def run_settings(family: str, packing: str, args, data: Path, tokenizer: Path, folder: Path, steps: int):
    overrides = dict(dataset=str(data), tokenizer=str(tokenizer), packing=packing, output_dir=str(folder))
    overrides.update(overwrite=True, max_steps=steps, save_every=0, eval_every=0, report_to="none", zero_shot_pairs=0)
    overrides.update(warmup_steps=max(1, steps // 10))
    if args.mixed_precision is not None:
        overrides["mixed_precision"] = args.mixed_precision
    if args.tiny:
        overrides.update(model=TINY_MODELS[family], block_size=32, batch_size=8, eval_batches=2)
    return resolve_arguments(
        family=family, preset=args.preset, overrides=overrides, configs_dir=ROOT / "training" / "configs"
    )


def batch_shape(settings) -> dict[str, float]:
    """Real tokens per micro-batch and the pad share, over the mode's first collated training batches."""
    tokenizer = load_tokenizer(settings.tokenizer, settings.spec)
    examples = settings.spec.examples(load_dataset_splits(settings)["train"], tokenizer, settings)
    batches = GlobalBatches(
        examples,
        build_collator(tokenizer, settings),
        settings.batch_size,
        seed=settings.seed,
        stream="train",
        shuffle=True,
    )
    real = positions = 0
    for g in range(MEASURED_BATCHES):
        batch = batches[g][1]
        real += input_token_count(batch, tokenizer.pad_token_id)
        positions += batch["input_ids"].numel()
    return {"real_per_batch": real / MEASURED_BATCHES, "pad_share": 1 - real / positions}


def measure(family: str, packing: str, args, data: Path, tokenizer: Path, held_out: list[str], work: Path) -> dict:
    """One run of `packing` at the real-token budget: its speed, padding and held-out loss."""
    folder = work / f"{family}-{packing}"
    shape = batch_shape(run_settings(family, packing, args, data, tokenizer, folder, 1))
    settings = run_settings(family, packing, args, data, tokenizer, folder, 1)
    steps = max(1, math.ceil(args.budget / (shape["real_per_batch"] * settings.grad_accum)))
    metrics = run_pretraining(run_settings(family, packing, args, data, tokenizer, folder, steps))
    model, loaded, _ = load_language_model(folder)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    loss = held_out_loss(
        model,
        loaded,
        family,
        held_out,
        block_size=settings.block_size,
        batches=4 if args.tiny else 40,
        batch_size=settings.batch_size,
        seed=0,
    )
    real_per_second = metrics["tokens_seen"] / metrics["train_time_s"]
    return {
        "packing": packing,
        "steps": steps,
        "real_tokens": metrics["tokens_seen"],
        "train_time_s": metrics["train_time_s"],
        "tokens_per_second": real_per_second / (1 - shape["pad_share"]),
        "real_tokens_per_second": real_per_second,
        "pad_share": shape["pad_share"],
        "held_out_loss": loss["loss"],
        "held_out_objective": loss["objective"],
    }


def family_section(family: str, kind: str, args, work: Path) -> dict:
    """Every packing mode of `family` on the `kind` documents, one shared tokenizer and held-out split."""
    data = work / f"{kind}.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus_documents(kind, args.max_files)))
    tokenizer = work / f"{family}-{kind}-tokenizer"
    first = run_settings(family, "padded", args, data, tokenizer, work / "unused", 1)
    splits = load_dataset_splits(first)
    if not tokenizer.exists():
        train_tokenizer(family, iter_texts(splits["train"]), first.vocab_size).save_pretrained(tokenizer)
    held_out = list(splits["validation"]["text"])
    results = [measure(family, mode, args, data, tokenizer, held_out, work) for mode in packings(family)]
    padded = next(row for row in results if row["packing"] == "padded")
    for row in results:
        row["speedup_vs_padded"] = row["real_tokens_per_second"] / padded["real_tokens_per_second"]
    return {"documents": kind, "block_size": first.block_size, "results": results}


def markdown(report: dict) -> str:
    lines = [
        *results_header("Packed against padded pretraining, at equal real tokens", report),
        f"- budget: {report['settings']['budget']:,} real (non-pad) tokens per run",
        "",
    ]
    for section in report["sections"]:
        heading = f"## {section['family']}, documents: {section['documents']} (rows of {section['block_size']})"
        lines += [heading, "", *section_table(section), ""]
    return "\n".join(lines)


def section_table(section: dict) -> list[str]:
    """A family's runs, one row per packing mode (also benchmarks/packing_gpu.py's)."""
    lines = [
        "| packing | steps | tokens/s | real tokens/s | vs padded | pad share | held-out loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in section["results"]:
        lines.append(
            f"| {row['packing']} | {row['steps']} | {row['tokens_per_second']:,.0f} | "
            f"{row['real_tokens_per_second']:,.0f} | {row['speedup_vs_padded']:.2f}x | {row['pad_share']:.1%} | "
            f"{row['held_out_loss']:.4f} ({row['held_out_objective']}) |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = "packing_tiny" if args.tiny else "packing"
    started = time.perf_counter()
    report = {
        **report_head(args),
        "sections": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        for kind in args.documents:
            for family in args.families:
                report["sections"].append({"family": family, **family_section(family, kind, args, Path(scratch))})
    report["wall_time_s"] = time.perf_counter() - started
    table = markdown(report)
    write_results(args.output_dir, name, report, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
