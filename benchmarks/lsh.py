"""LSH attention ("lsh" layers) against sliding and full attention, in two parts, each writing its own results file.

quality (benchmarks/results/lsh_quality.md): seeded, so its numbers do not depend on the machine or its load

recall      multi-query associative recall (coreformer.probes), a small decoder of each type trained briefly:
            lsh, sliding with the same number of keys per query (window = n_hashes * (bucket_size - 1)), full
mass        the share of the dense attention mass (softmax over every earlier key, from the trained lsh model's
            own queries and keys) that falls on the keys LSH chose, and on a band of the same size
ablation    the trained lsh model's recall with its lsh layers' output zeroed: how much the model uses them
speed (benchmarks/results/lsh_speed.md): timings, for a quiet machine
speed       time and peak memory of one forward + backward of the attention alone, (1, H, L, D) fp32, for full
            attention under sdpa, the sliding kernel and the lsh kernel (hashing included), at each length;
            each (type, length) in its own process, memory being its max RSS above its baseline (CPU) or
            torch's peak allocation (CUDA); the file states from the rows where LSH pays off (the length)

python benchmarks/lsh.py --part quality                           # any time, even under load
python benchmarks/lsh.py --part speed                             # on a quiet machine
python benchmarks/lsh.py                                          # both
python benchmarks/lsh.py --lengths 256 512 --recall-steps 20 --pairs 4 --results-dir /tmp/lsh   # a smoke run
"""

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

import coreformer as cf
from coreformer.lsh_attention import draw_rotations, hash_buckets, length_normalized, lsh_attention, lsh_visible_mask
from coreformer.probes import AssociativeRecall
from coreformer.sparse_attention import sliding_window_attention

SPEED_TYPES = ("full", "sliding", "lsh")


def recall_config(task: AssociativeRecall, layer_type: str, args: argparse.Namespace) -> cf.CoreformerDecoderConfig:
    """The recall decoder: 2 layers of `layer_type`, 64 wide, 2 heads, rotary positions."""
    return cf.CoreformerDecoderConfig(
        vocab_size=task.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=task.length,
        position_embedding_type="rotary",
        hidden_dropout=0.0,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        layer_types=[layer_type] * 2,
        sliding_window=keys_per_query(args),
        lsh_bucket_size=args.bucket_size,
        lsh_num_hashes=args.num_hashes,
        lsh_num_buckets=args.num_buckets,
    )


def keys_per_query(args: argparse.Namespace) -> int:
    """The most earlier keys an lsh query sees: bucket_size - 1 per round (itself excluded), over the rounds."""
    return args.num_hashes * (args.bucket_size - 1)


def train(config: cf.CoreformerDecoderConfig, task: AssociativeRecall, args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    model = cf.CoreformerDecoderForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(args.recall_steps):
        ids, labels = task.batch(64, generator)
        loss = torch.nn.functional.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def recall_accuracy(model: torch.nn.Module, task: AssociativeRecall, args: argparse.Namespace) -> float:
    ids, labels = task.batch(1024, torch.Generator().manual_seed(args.seed + 1))
    with torch.no_grad():
        predictions = model(ids).logits.argmax(-1)
    answered = labels != -100
    return (predictions[answered] == labels[answered]).float().mean().item()


def ablated_accuracy(model: torch.nn.Module, task: AssociativeRecall, args: argparse.Namespace) -> float:
    """Recall with every lsh layer's attention output replaced by zeros (its residual branch removed)."""
    handles = [
        layer.self_attn.register_forward_hook(lambda module, inputs, output: (torch.zeros_like(output[0]), *output[1:]))
        for layer in model.model.decoder.layers
        if layer.self_attn.layer_type == "lsh"
    ]
    try:
        return recall_accuracy(model, task, args)
    finally:
        for handle in handles:
            handle.remove()


def captured_queries(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rotated queries (B, H, L, D) and rotations each lsh layer hashed, captured from one forward."""
    captured = []
    kernel_class = type(next(layer.self_attn.kernel for layer in model.model.decoder.layers if layer.self_attn.kernel))
    original = kernel_class.attend

    def recording(self, attention, query, *rest, **kwargs):
        captured.append((query.detach(), attention.lsh_rotations))
        return original(self, attention, query, *rest, **kwargs)

    kernel_class.attend = recording
    try:
        with torch.no_grad():
            model(ids)
    finally:
        kernel_class.attend = original
    return captured


def attention_mass(model: torch.nn.Module, task: AssociativeRecall, args: argparse.Namespace) -> tuple[float, float]:
    """Mean share of each query's dense causal attention mass (over the earlier keys, itself excluded) on the keys
    LSH chose, and on the band of the same number of nearest earlier keys."""
    ids, _ = task.batch(64, torch.Generator().manual_seed(args.seed + 2))
    lsh_shares, band_shares = [], []
    for query, rotations in captured_queries(model, ids):
        key = length_normalized(query)
        length = query.shape[2]
        buckets = hash_buckets(key, rotations)
        chosen = lsh_visible_mask(
            buckets, buckets, query_positions=torch.arange(length), bucket_size=args.bucket_size, causal=True
        )
        earlier = torch.ones(length, length, dtype=torch.bool).tril(-1)
        band = earlier & ~torch.ones(length, length, dtype=torch.bool).tril(-keys_per_query(args) - 1)
        scores = (query @ key.transpose(-1, -2)) * query.shape[-1] ** -0.5
        dense = torch.softmax(scores.masked_fill(~earlier, float("-inf")), dim=-1)[:, :, 1:]  # token 0 sees nothing
        lsh_shares.append((dense * (chosen & earlier)[:, :, 1:]).sum(-1).mean().item())
        band_shares.append((dense * band[1:]).sum(-1).mean().item())
    return sum(lsh_shares) / len(lsh_shares), sum(band_shares) / len(band_shares)


def measure_one(layer_type: str, length: int, args: argparse.Namespace) -> dict:
    """One forward + backward of the attention alone; run in a fresh process (`--one`)."""
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    heads, head_dim = args.heads, args.head_dim
    query, value, key = (torch.randn(1, heads, length, head_dim, generator=generator).to(device) for _ in range(3))
    rotations = draw_rotations(heads, head_dim, args.num_hashes, args.num_buckets, seed=0).to(device)

    def step() -> None:
        q, k, v = (tensor.detach().requires_grad_() for tensor in (query, key, value))
        if layer_type == "full":
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif layer_type == "sliding":
            out = sliding_window_attention(
                q, k, v, window=keys_per_query(args), causal=True, padding_mask=None, scaling=head_dim**-0.5
            )
        else:
            shared_key = length_normalized(q)
            buckets = hash_buckets(shared_key, rotations)
            out = lsh_attention(
                q,
                shared_key,
                v,
                buckets,
                num_buckets=args.num_buckets,
                bucket_size=args.bucket_size,
                causal=True,
                padding_mask=None,
                scaling=head_dim**-0.5,
            )
        out.sum().backward()

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up (and the memory peak)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if device.type == "cuda"
        else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024
    )
    times = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"type": layer_type, "length": length, "seconds": min(times), "peak_mib": peak}


def measure_all(args: argparse.Namespace) -> list[dict]:
    rows = []
    for length in args.lengths:
        for layer_type in SPEED_TYPES:
            command = [sys.executable, __file__, "--one", layer_type, str(length), *forwarded(args)]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))  # the child's last line: its result
    return rows


def forwarded(args: argparse.Namespace) -> list[str]:
    """The options a measuring child needs."""
    return [
        *("--heads", str(args.heads), "--head-dim", str(args.head_dim), "--repeats", str(args.repeats)),
        *("--bucket-size", str(args.bucket_size), "--num-hashes", str(args.num_hashes)),
        *("--num-buckets", str(args.num_buckets), "--device", args.device, "--threads", str(args.threads)),
    ]


def header(title: str, args: argparse.Namespace) -> list[str]:
    """The top of a results file: what it holds, the machine, the date and the command that wrote it."""
    machine = f"{platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    machine += f", {args.threads} threads, {args.device}"
    if args.device.startswith("cuda"):
        machine += f" ({torch.cuda.get_device_name()})"
    return [
        f"### {title}",
        "",
        f"Machine: {machine}. Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        f"Command: `python {shlex.join(sys.argv)}`",
        "",
    ]


def quality_markdown(recall: dict, mass: tuple[float, float], args: argparse.Namespace) -> str:
    """The quality part's results file: recall, the ablation and the captured attention mass."""
    lines = header("LSH attention: recall, ablation, captured attention mass", args) + [
        f"Seeded throughout, so the numbers do not depend on the machine or its load. LSH: {args.num_hashes} hash "
        f"round(s), {args.num_buckets} buckets, bucket_size {args.bucket_size}; sliding window "
        f"{keys_per_query(args)}, the same number of earlier keys per query. A decoder of 2 layers of each type, "
        f"64 wide, trained {args.recall_steps} steps on associative recall with {args.pairs} pairs (length "
        f"{4 * args.pairs}).",
        "",
        "| layers | answer accuracy |",
        "|---|---|",
        *(f"| {name} | {accuracy:.3f} |" for name, accuracy in recall.items()),
        "",
        f"Share of the dense causal attention mass (the trained lsh model's own queries and keys, over every earlier "
        f"key) on the keys LSH chose: {mass[0]:.3f}; on a band of the same number of nearest earlier keys: "
        f"{mass[1]:.3f}.",
    ]
    return "\n".join(lines) + "\n"


def speed_markdown(rows: list[dict], args: argparse.Namespace) -> str:
    """The speed part's results file: time and peak memory per length, and where LSH pays off."""
    cells = {(row["type"], row["length"]): row for row in rows}
    lines = header("LSH attention: time and peak memory against full sdpa and sliding", args) + [
        f"One forward + backward of the attention alone, (1, {args.heads}, L, {args.head_dim}) fp32, causal; each "
        f"(type, length) in its own process, best of {args.repeats}; memory: the peak above the process's baseline "
        f"(max RSS on CPU, torch's peak allocation on CUDA). LSH: {args.num_hashes} hash round(s), {args.num_buckets} "
        f"buckets, bucket_size {args.bucket_size} (hashing included); sliding window {keys_per_query(args)}, the same "
        f"number of earlier keys per query.",
        "",
        "| L | " + " | ".join(f"{name} s | {name} MiB" for name in SPEED_TYPES) + " | lsh / full time |",
        "|---|" + "---|" * (2 * len(SPEED_TYPES) + 1),
    ]
    for length in args.lengths:
        values = [cells[(name, length)] for name in SPEED_TYPES]
        ratio = cells[("lsh", length)]["seconds"] / cells[("full", length)]["seconds"]
        cells_text = " | ".join(f"{row['seconds']:.4f} | {row['peak_mib']:.0f}" for row in values)
        lines.append(f"| {length} | {cells_text} | {ratio:.2f} |")
    lines += ["", *payoff_lines(cells, args.lengths)]
    return "\n".join(lines) + "\n"


def payoff_lines(cells: dict, lengths: list[int]) -> list[str]:
    """Where LSH pays off against full sdpa, in time and in memory, read from the measured rows: the shortest length
    from which LSH wins at every longer measured length too."""
    lines = []
    for measure, word in (("seconds", "faster than"), ("peak_mib", "lighter in peak memory than")):
        wins = [cells[("lsh", length)][measure] < cells[("full", length)][measure] for length in lengths]
        longest = max(lengths)
        if not any(wins):
            lines.append(f"- LSH was not {word} full sdpa at any measured length (up to L = {longest}).")
            continue
        first = len(wins) - next(index for index, won in enumerate(reversed(wins)) if not won) if not all(wins) else 0
        if first == len(wins):
            won_at = ", ".join(str(length) for length, won in zip(lengths, wins) if won)
            lines.append(f"- LSH was {word} full sdpa at L = {won_at}, but not at the longest, {longest}.")
        elif first == 0:
            lines.append(f"- LSH is {word} full sdpa at every measured length, from L = {lengths[0]} on.")
        else:
            lines.append(
                f"- LSH is {word} full sdpa from L = {lengths[first]} on (not at {lengths[first - 1]}): it pays off "
                f"between {lengths[first - 1]} and {lengths[first]} tokens."
            )
    return lines


def run_quality(args: argparse.Namespace) -> str:
    """Train the three recall decoders; their accuracy, the lsh model's ablation and captured mass, as markdown."""
    task = AssociativeRecall(num_keys=2 * args.pairs, num_values=2 * args.pairs, num_pairs=args.pairs)
    models = {}
    for name in SPEED_TYPES:
        started = time.perf_counter()
        models[name] = train(recall_config(task, name, args), task, args)
        print(f"trained {name}: {time.perf_counter() - started:.1f} s", flush=True)
    recall = {name: recall_accuracy(model, task, args) for name, model in models.items()}
    recall["lsh, its lsh layers' output zeroed"] = ablated_accuracy(models["lsh"], task, args)
    return quality_markdown(recall, attention_mass(models["lsh"], task, args), args)


def run_speed(args: argparse.Namespace) -> str:
    """Time and memory of each (type, length), each in its own process, as markdown."""
    return speed_markdown(measure_all(args), args)


# The parts: each runs alone and writes its own results file (quality: any machine, any load; speed: a quiet one).
PARTS = {"quality": (run_quality, "lsh_quality.md"), "speed": (run_speed, "lsh_speed.md")}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all", help="which part to run (default: both)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--bucket-size", type=int, default=64, help="lsh_bucket_size of the speed part")
    parser.add_argument("--num-hashes", type=int, default=2)
    parser.add_argument("--num-buckets", type=int, default=32)
    # 8 pairs: full attention learns the task within the default steps (at 32 pairs no model left chance)
    parser.add_argument("--pairs", type=int, default=8, help="associative-recall pairs (length 4 * pairs)")
    parser.add_argument("--recall-bucket-size", type=int, default=8, help="lsh_bucket_size of the quality part")
    parser.add_argument("--recall-steps", type=int, default=1200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--one", nargs=2, metavar=("TYPE", "LENGTH"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def part_arguments(args: argparse.Namespace, part: str) -> argparse.Namespace:
    """`args` as the part reads them: the quality part's bucket size is `--recall-bucket-size`."""
    if part == "quality":
        return argparse.Namespace(**{**vars(args), "bucket_size": args.recall_bucket_size})
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    torch.set_num_threads(args.threads)
    if args.one:  # a measuring child of the speed part
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args)))
        return
    for part in PARTS if args.part == "all" else [args.part]:
        run, filename = PARTS[part]
        started = time.perf_counter()
        text = run(part_arguments(args, part))
        args.results_dir.mkdir(parents=True, exist_ok=True)
        (args.results_dir / filename).write_text(text)
        print(
            text, f"{part}: {time.perf_counter() - started:.0f} s, written to {args.results_dir / filename}", sep="\n"
        )


if __name__ == "__main__":
    main()
