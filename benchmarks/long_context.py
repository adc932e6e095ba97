"""Time and peak memory of one forward + backward pass versus sequence length, for each attention type.

By default an encoder stack in training mode; `--family decoder` a causal stack, `--inference` one forward pass in
eval mode without gradients (a decoder then builds its default cache: the prefill of generation).

Each (type, length) runs in its own subprocess so that peak memory (the process's max RSS above its baseline after
building the model) belongs to that measurement alone. On a shared machine, --quiet-cpu 0.1 starts each one only
once the CPUs are that idle (waited for up to --quiet-timeout seconds; the busy share found is stored with each
result). Also reports how each type does on the associative-recall task (`coreformer.probes`), trained briefly.
Writes a markdown table to stdout, JSON and a PNG plot.

    python benchmarks/long_context.py                       # 512 ... 16384 on CPU, ~15 minutes
    python benchmarks/long_context.py --lengths 256 512 --repeats 1 --skip-recall   # a smoke run
    python benchmarks/long_context.py --family decoder --inference --skip-recall     # decoder prefill
    python benchmarks/long_context.py --family decoder --packed-documents 1024 --types full sliding --skip-recall

--packed-documents N makes each row a packed row of documents of N tokens (position_ids restarting every N tokens, no
attention mask: what DataCollatorWithFlattening and `--packing packed` feed), so the rows show what packing costs
each type at long lengths: a sliding layer keeps its O(L·w) kernel, full attention masks each document's block.
"""

import argparse
import datetime
import gc
import json
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import coreformer as cf
from coreformer.probes import AssociativeRecall, recall_model_config, train_associative_recall

TYPES = ("full", "sliding", "strided", "lowrank", "linear")
# "full_eager": full attention under the eager backend, which materialises the L x L probabilities. torch's sdpa
# kernel on CPU is flash-style and keeps even full attention's memory linear in L; eager shows the classic O(L²).
ROWS = ("full_eager", *TYPES)
# The attention variants of today's decoders, measured on request (--types): multi-head latent attention (its latent
# widths below) and Gated DeltaNet, whose stack ends in one full layer (its cache layer counts no tokens; with
# --layers 4 that is Qwen3-Next's 3 : 1 mix).
VARIANTS = ("mla", "gated_deltanet")
VARIANT_FIELDS = {"mla": dict(kv_lora_rank=128, qk_nope_head_dim=64, v_head_dim=64), "gated_deltanet": {}}


def build_model(layer_type: str, length: int, args: argparse.Namespace) -> torch.nn.Module:
    """An encoder (every type, incl. encoder-only Linformer, applies bidirectionally) or decoder stack of one type."""
    backend = "eager" if layer_type == "full_eager" else "sdpa"
    layer_type = layer_type.removesuffix("_eager")
    config_class = cf.CoreformerEncoderConfig if args.family == "encoder" else cf.CoreformerDecoderConfig
    layer_types = [layer_type] * args.layers
    if layer_type == "gated_deltanet":
        layer_types[-1] = "full"
    config = config_class(
        vocab_size=1024,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=length,
        position_embedding_type="rotary",
        hidden_dropout=0.0,
        layer_types=layer_types,
        sliding_window=args.window,
        stride=args.stride,
        lowrank_k=min(args.lowrank_k, length),
        attn_implementation=backend,
        **VARIANT_FIELDS.get(layer_type, {}),
    )
    torch.manual_seed(0)
    return (cf.CoreformerEncoderModel if args.family == "encoder" else cf.CoreformerDecoderModel)(config)


def measure_one(layer_type: str, length: int, args: argparse.Namespace) -> dict:
    """Forward(+backward) seconds (best of `--repeats`) and peak MiB above baseline, in this process (run in a fresh
    subprocess). Best, not median: on a shared machine interference only ever adds time."""
    torch.set_num_threads(args.threads)
    model = build_model(layer_type, length, args).train(not args.inference)
    ids = torch.randint(0, 1024, (args.batch_size, length))
    # a packed row: documents of --packed-documents tokens, each with its own positions from 0
    inputs = (
        {"position_ids": (torch.arange(length) % args.packed_documents).expand_as(ids)} if args.packed_documents else {}
    )
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    times = []
    for repeat in range(args.repeats + 1):  # the first run warms up allocators and kernels
        start = time.perf_counter()
        if args.inference:
            with torch.no_grad():
                model(ids, **inputs)
        else:
            model(ids, **inputs).last_hidden_state.float().pow(2).mean().backward()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        if repeat:
            times.append(elapsed)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "type": layer_type,
        "length": length,
        "seconds": min(times),
        "median_seconds": statistics.median(times),
        "peak_mib": (peak - baseline) / 1024,
    }


def cpu_busy_share(seconds: float = 1.0) -> float | None:
    """Share of all CPUs' time spent busy over the next `seconds` (Linux /proc/stat), or None where unavailable."""

    def counters() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
        return sum(fields[3:5]), sum(fields)  # idle + iowait, total

    try:
        idle_start, total_start = counters()
        time.sleep(seconds)
        idle_end, total_end = counters()
    except OSError:
        return None
    return 1 - (idle_end - idle_start) / max(total_end - total_start, 1)


def wait_for_quiet(args: argparse.Namespace) -> float | None:
    """Wait until the CPUs are idle before a timing: other jobs on a 2-core machine would be timed along with it."""
    if args.quiet_cpu is None:
        return None
    deadline = time.monotonic() + args.quiet_timeout
    busy = cpu_busy_share()
    while busy is not None and busy > args.quiet_cpu and time.monotonic() < deadline:
        time.sleep(4)
        busy = cpu_busy_share()
    return busy


def measure_all(args: argparse.Namespace) -> list[dict]:
    results = []
    for length in args.lengths:
        for layer_type in args.types:
            limit = args.max_eager_length if layer_type == "full_eager" else args.max_full_length
            if layer_type.startswith("full") and length > limit:
                continue
            busy = wait_for_quiet(args)
            command = [sys.executable, __file__, "--one", layer_type, str(length), *sys.argv[1:]]
            child = subprocess.run(command, capture_output=True, text=True)
            if child.returncode != 0:
                raise SystemExit(f"{layer_type} at {length} failed:\n{child.stderr[-2000:]}")
            result = json.loads(child.stdout.strip().splitlines()[-1])
            result["cpu_busy_before"] = busy
            note = "" if busy is None else f"  (CPUs {100 * busy:.0f}% busy before)"
            print(
                f"  {layer_type:8s} L={length:6d}  {result['seconds']:8.3f} s  {result['peak_mib']:8.1f} MiB{note}",
                flush=True,
            )
            results.append(result)
    return results


def recall_accuracy(args: argparse.Namespace) -> dict[str, float]:
    """Associative recall (decoder, causal) per type; lowrank is encoder-only, so it has no entry."""
    task = AssociativeRecall()
    accuracies = {}
    for layer_type in ("full", "sliding", "strided", "linear"):
        config = recall_model_config(task, layer_type)
        accuracies[layer_type] = train_associative_recall(config, task, steps=args.recall_steps, lr=1e-3)
        print(f"  recall {layer_type:8s} accuracy {accuracies[layer_type]:.3f}", flush=True)
    return accuracies


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    lengths = sorted({r["length"] for r in results})
    by_key = {(r["type"], r["length"]): r for r in results}
    lines = ["| type | " + " | ".join(f"L={n}" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for layer_type in args.types:
        cells = []
        for length in lengths:
            r = by_key.get((layer_type, length))
            cells.append(f"{r['seconds']:.3f} s / {r['peak_mib']:.0f} MiB" if r else "—")
        lines.append(f"| {layer_type} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(args: argparse.Namespace) -> tuple[str, str]:
    """(what one timing is, where the results go): the default run keeps the names the README links to."""
    what = "forward" if args.inference else "forward + backward"
    mode = f"{args.family}{'_inference' if args.inference else ''}{'_packed' if args.packed_documents else ''}"
    if args.name:
        return what, args.name
    return what, "long_context" if mode == "encoder" else f"long_context_{mode}"


def plot(results: list[dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for layer_type in dict.fromkeys(r["type"] for r in results):
        rows = sorted((r for r in results if r["type"] == layer_type), key=lambda r: r["length"])
        lengths = [r["length"] for r in rows]
        time_axis.plot(lengths, [r["seconds"] for r in rows], marker="o", label=layer_type)
        memory_axis.plot(lengths, [r["peak_mib"] for r in rows], marker="o", label=layer_type)
    axes = (
        (time_axis, f"{describe(args)[0]} (s)", "seconds"),
        (memory_axis, "peak memory above baseline (MiB)", "peak_mib"),
    )
    for axis, label, field in axes:
        axis.set_xscale("log", base=2)
        # a log axis cannot show a zero: tiny cells can stay within the baseline's pages (0 MiB above it)
        axis.set_yscale("log" if all(r[field] > 0 for r in results) else "linear")
        axis.set_xlabel("sequence length")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
    time_axis.legend()
    packed = f", packed documents of {args.packed_documents}" if args.packed_documents else ""
    figure.suptitle(f"coreformer attention types on CPU ({args.family}, batch {args.batch_size}{packed})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--family", choices=("encoder", "decoder"), default="encoder")
    parser.add_argument("--inference", action="store_true", help="one forward pass without gradients, eval mode")
    parser.add_argument("--types", nargs="+", default=list(ROWS), choices=(*ROWS, *VARIANTS))
    parser.add_argument("--max-full-length", type=int, default=16384, help="skip full attention beyond this length")
    parser.add_argument("--max-eager-length", type=int, default=8192, help="eager full attention needs O(L²) memory")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--window", type=int, default=128, help="sliding_window (ModernBERT's local layers: 128)")
    parser.add_argument("--stride", type=int, default=128)
    parser.add_argument("--lowrank-k", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--recall-steps", type=int, default=1200)
    parser.add_argument("--skip-recall", action="store_true")
    parser.add_argument("--packed-documents", type=int, help="packed rows of documents of this many tokens (above)")
    parser.add_argument("--quiet-cpu", type=float, help="start each timing once the CPUs' busy share is below this")
    parser.add_argument("--quiet-timeout", type=float, default=300, help="seconds to wait for that before timing")
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", help="the results files' name (default: long_context, then the family and mode)")
    parser.add_argument("--one", nargs=2, metavar=("TYPE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    # What the imports made lives as long as the process (each measured cell is one): no garbage collection, exit
    # included, walks it again, as in the coreformer commands (coreformer_cli.after_imports).
    gc.freeze()
    if args.family == "decoder" and "lowrank" in args.types:
        args.types = [t for t in args.types if t != "lowrank"]  # Linformer is encoder-only (the config refuses it)
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args)))
        return

    # compare.py (this folder's other benchmark, sys.path[0] when run as a script) imports transformers' GPT-2, BERT
    # and BART: only the parent, which writes the report, pays for that, not each measuring child.
    from measure import cpu_name

    machine = f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}"
    print(f"machine: {machine}")
    results = measure_all(args)
    accuracies = {} if args.skip_recall else recall_accuracy(args)
    table = markdown(results, args)
    what, name = describe(args)
    print(f"\n{what} time / peak memory above baseline\n" + table)
    if accuracies:
        print("\nassociative recall accuracy: " + ", ".join(f"{t} {a:.3f}" for t, a in accuracies.items()))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("one", "output_dir")}
    command = shlex.join(["python", "benchmarks/long_context.py", *sys.argv[1:]])
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = {"machine": machine, "date": date, "command": command, "settings": settings, "results": results}
    report["recall_accuracy"] = accuracies
    (args.output_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(results, args.output_dir / f"{name}.png", args)
    print(f"\nwrote {args.output_dir / f'{name}.json'} and {args.output_dir / f'{name}.png'}")


if __name__ == "__main__":
    main()
