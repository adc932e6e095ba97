"""Time and memory to the first training step against corpus size: pretraining on text (`--dataset`, tokenized by
the run) against pretraining on token shards (`coreformer tokenize` once, then `--data-dir`) and on the text streamed
(`--streaming`), and how fast the shard loader hands out batches against what the default model trains on.

The corpora are the installed packages' Python source (site-packages), one JSON Lines row per file, repeated until
each size is reached; the tokenizer is the default decoder's (byte-level BPE, --vocab-size 8192) trained once on the
first megabytes. For each size:

    text      `coreformer pretrain --family decoder --preset tiny --dataset corpus.jsonl --tokenizer T`, a cold
              datasets cache (what a first run pays; a rerun finds its map caches)
    tokenize  `coreformer tokenize corpus.jsonl shards --tokenizer T --num-proc N` (paid once per corpus)
    shards    `coreformer pretrain --family decoder --preset tiny --data-dir shards`
    stream    `coreformer pretrain --family decoder --preset tiny --dataset corpus.jsonl --streaming --tokenizer T`

Each pretraining run is its own process; a hook in it records the seconds since the process started and the peak
resident memory (ru_maxrss) when the first training step begins: loading, tokenizing, the held-out evaluation
before step one (1 batch), model building. `tokenize` is timed whole, its memory the peak of its largest process.
The loader rows: the default decoder's batches (the preset's block and batch sizes, LOADER_TOKENS of them) built in
this process from the largest corpus' shards, and from the same corpus streamed (tokenized as it is read, in this
process: --num-workers 0), against the training tokens per second of a 20-step shard run of the same preset.

Writes results/data_scale.json and data_scale.md (machine, date, command at the top).

    python benchmarks/data_scale.py --sizes-mb 100 1000 --note "nothing else running"
    python benchmarks/data_scale.py --sizes-mb 2 8 --output-dir /tmp/data-scale        # a smoke run
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from results_files import report_head, results_header, write_results

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_SAMPLE_BYTES = 4_000_000  # the tokenizer's training text: the corpus' first files
LOADER_TOKENS = 5_000_000  # what each loader hands out while timed: a streamed one tokenizes several chunks of it
# Run in each pretraining process: when the first training step begins, write the seconds since `start` (taken by
# the parent just before it started the process) and the peak resident memory so far; then run the command line.
FIRST_STEP_HOOK = """
import json, os, resource, sys, time
start, out = float(sys.argv[1]), sys.argv[2]
import coreformer.training.pretraining.loop as loop
original = loop.train_step
def train_step(run, training):
    if not os.path.exists(out):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with open(out, "w") as handle:
            json.dump({"seconds": time.time() - start, "peak_rss_mib": peak}, handle)
    return original(run, training)
loop.train_step = train_step
import coreformer_cli
sys.exit(coreformer_cli.main(sys.argv[3:]))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000], help="corpus sizes, in MB of text")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count(), help="coreformer tokenize --num-proc")
    parser.add_argument("--scratch", type=Path, default=None, help="where corpora and runs go (default: a temp dir)")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'nothing else running')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "benchmarks/data_scale.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def source_files() -> list[Path]:
    """The installed packages' Python files, in a fixed order."""
    import site

    roots = [Path(folder) for folder in site.getsitepackages()]
    return sorted(path for root in roots for path in root.rglob("*.py") if path.is_file())


def write_corpus(path: Path, size: int, files: list[Path]) -> int:
    """JSON Lines of {"text": a file's source} until `size` bytes of text; the files again when they run out."""
    written = documents = 0
    with path.open("w") as handle:
        while written < size:
            for file in files:
                text = file.read_text(errors="replace")
                if not text.strip():
                    continue
                handle.write(json.dumps({"text": text}) + "\n")
                written, documents = written + len(text.encode()), documents + 1
                if written >= size:
                    break
    return documents


def train_default_tokenizer(files: list[Path], folder: Path) -> None:
    from coreformer.training.tokenizer_training import train_tokenizer

    texts, total = [], 0
    for file in files:
        texts.append(file.read_text(errors="replace"))
        total += len(texts[-1])
        if total > TOKENIZER_SAMPLE_BYTES:
            break
    train_tokenizer("decoder", texts, 8192).save_pretrained(folder)


def timed(command: list[str], environment: dict[str, str]) -> dict:
    """Wall seconds and peak resident memory: wait4's ru_maxrss, the largest of the process and the descendants it
    waited for (its worker processes)."""
    start = time.time()
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{output[-3000:]}")
    return {"seconds": time.time() - start, "peak_rss_mib": usage.ru_maxrss / 1024}


def pretrain(source_flags: list[str], folder: Path, environment: dict[str, str], steps: int = 1) -> dict:
    """A run of the default decoder; the first step's seconds and peak memory (the hook's), and its metrics."""
    marker = folder.with_suffix(".first-step.json")
    command = [sys.executable, "-c", FIRST_STEP_HOOK, str(time.time()), str(marker), "pretrain"]
    command += ["--family", "decoder", "--preset", "tiny", *source_flags, "--output-dir", str(folder)]
    command += ["--max-steps", str(steps), "--eval-every", "0", "--eval-batches", "1", "--save-every", "0"]
    command += ["--zero-shot-pairs", "0", "--report-to", "none"]
    timed(command, environment)
    first = json.loads(marker.read_text())
    return first | {"metrics": json.loads((folder / "metrics.json").read_text())}


def loader_tokens_per_second(shards: Path, corpus: Path, run_config: dict) -> dict[str, float]:
    """Batches of the run's objective, block and batch sizes, built in this process as the run's loader builds them
    (num_workers 0), from `shards` and from `corpus` streamed: input tokens per second of each."""
    from transformers import AutoTokenizer

    from coreformer.training.batches import GlobalBatches, strided_loader
    from coreformer.training.objectives import OBJECTIVES
    from coreformer.training.shards import ShardedTokens
    from coreformer.training.streaming import StreamedBatches, StreamedText, StreamPosition

    tokenizer = AutoTokenizer.from_pretrained(shards / "tokenizer")
    objective = OBJECTIVES[run_config["objective"]]
    args = SimpleNamespace(**{**run_config, "dataset": str(corpus), "streaming": True})
    collator = objective.collator(tokenizer, args)
    table = objective.sharded_examples(ShardedTokens(shards), tokenizer, args)
    batches = GlobalBatches(table, collator, args.batch_size, seed=0, stream="train", shuffle=True)
    loaders = {
        "shards": iter(strided_loader(batches, 0, 1, num_workers=0, pin_memory=False)),
        "stream": StreamedBatches(
            StreamedText(args, 0, 1),
            objective,
            tokenizer,
            collator,
            args,
            start=0,
            step=1,
            position=StreamPosition(),
            num_workers=0,
        ),  # fmt: skip
    }
    speeds = {}
    for name, loader in loaders.items():
        start, tokens = time.perf_counter(), 0
        while tokens < LOADER_TOKENS:
            tokens += next(loader)[1]["input_ids"].numel()
        speeds[name] = tokens / (time.perf_counter() - start)
    return speeds


def measure(args: argparse.Namespace, scratch: Path) -> dict:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true"}
    files = source_files()
    tokenizer = scratch / "tokenizer"
    train_default_tokenizer(files, tokenizer)
    rows = []
    for size in args.sizes_mb:
        corpus = scratch / f"corpus-{size}mb.jsonl"
        documents = write_corpus(corpus, size * 1_000_000, files)
        shards = scratch / f"shards-{size}mb"
        cold = {**environment, "HF_DATASETS_CACHE": str(scratch / f"datasets-cache-{size}mb")}
        text = pretrain(["--dataset", str(corpus), "--tokenizer", str(tokenizer)], scratch / f"text-{size}", cold)
        command = [sys.executable, "-m", "coreformer_cli", "tokenize", str(corpus), str(shards)]
        tokenize = timed(command + ["--tokenizer", str(tokenizer), "--num-proc", str(args.num_proc)], environment)
        sharded = pretrain(["--data-dir", str(shards)], scratch / f"shards-{size}", environment)
        streamed = pretrain(
            ["--dataset", str(corpus), "--streaming", "--tokenizer", str(tokenizer)], scratch / f"stream-{size}", cold
        )
        manifest = json.loads((shards / "manifest.json").read_text())
        rows.append({
            "megabytes": size, "documents": documents, "tokens": manifest["tokens"],
            "text": {key: text[key] for key in ("seconds", "peak_rss_mib")},
            "tokenize": tokenize,
            "shards": {key: sharded[key] for key in ("seconds", "peak_rss_mib")},
            "stream": {key: streamed[key] for key in ("seconds", "peak_rss_mib")},
        })  # fmt: skip
        if size != args.sizes_mb[-1]:
            corpus.unlink()
    largest = scratch / f"shards-{args.sizes_mb[-1]}mb"
    trained = pretrain(["--data-dir", str(largest)], scratch / "throughput", environment, steps=20)
    run_config = json.loads((scratch / "throughput" / "run_config.json").read_text())
    loaders = loader_tokens_per_second(largest, corpus, run_config)
    return {
        "sizes": rows,
        "loader_tokens_per_second": loaders,
        "model_tokens_per_second": trained["metrics"]["tokens_per_second"],
        "block_size": run_config["block_size"],
        "batch_size": run_config["batch_size"],
    }


def table(report: dict) -> list[str]:
    lines = [
        "",
        "The default decoder (`--preset tiny`) to its first training step, each run its own process: seconds since the "
        "process started and its peak resident memory then. `tokenize` is the one-time `coreformer tokenize` of the "
        f"corpus (--num-proc {report['settings']['num_proc']}). Corpora: the installed packages' Python source as "
        "JSON Lines, one file a document.",
        "",
        "| text | documents | tokens | text path: s | text path: MiB | tokenize: s | tokenize: MiB | shards: s | "
        "shards: MiB | streamed: s | streamed: MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["sizes"]:
        lines.append(
            f"| {row['megabytes']:,} MB | {row['documents']:,} | {row['tokens']:,} | {row['text']['seconds']:.1f} | "
            f"{row['text']['peak_rss_mib']:,.0f} | {row['tokenize']['seconds']:.1f} | "
            f"{row['tokenize']['peak_rss_mib']:,.0f} | {row['shards']['seconds']:.1f} | "
            f"{row['shards']['peak_rss_mib']:,.0f} | {row['stream']['seconds']:.1f} | "
            f"{row['stream']['peak_rss_mib']:,.0f} |"
        )
    model = report["model_tokens_per_second"]
    lines += [
        "",
        f"The loaders (blocks of {report['block_size']}, batches of {report['batch_size']}, the largest corpus, one "
        f"process, no workers) against the {model:,.0f} tokens/s the same preset trains at (20 steps):",
        "",
        "| loader | tokens/s | against training |",
        "|---|---|---|",
    ]
    for name, speed in report["loader_tokens_per_second"].items():
        lines.append(f"| {name} | {speed:,.0f} | **{speed / model:.0f}x** |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = report_head(args)
    if args.scratch is not None:
        args.scratch.mkdir(parents=True, exist_ok=True)
        report |= measure(args, args.scratch)
    else:
        with tempfile.TemporaryDirectory(prefix="coreformer-data-scale-") as scratch:
            report |= measure(args, Path(scratch))
    lines = results_header("Time and memory to the first step against corpus size: text, shards, streamed", report)
    lines += table(report)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_results(args.output_dir, "data_scale", report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
