"""LSH attention ("lsh" layers) against sliding and full attention; writes benchmarks/results/lsh.md.

recall      multi-query associative recall (coreformer.probes), a small decoder of each type trained briefly:
            lsh, sliding with the same number of keys per query (window = n_hashes * (bucket_size - 1)), full
mass        the share of the dense attention mass (softmax over every earlier key, from the trained lsh model's
            own queries and keys) that falls on the keys LSH chose, and on a band of the same size
ablation    the trained lsh model's recall with its lsh layers' output zeroed: how much the model uses them
speed       time and peak memory of one forward + backward of the attention alone, (1, H, L, D) fp32, for full
            attention under sdpa, the sliding kernel and the lsh kernel (hashing included), at each length;
            each (type, length) in its own process, memory being its max RSS above its baseline (CPU) or
            torch's peak allocation (CUDA)

python benchmarks/lsh.py                                          # the full run (quiet machine: tens of minutes)
python benchmarks/lsh.py --lengths 256 512 --recall-steps 20 --pairs 4 --output /tmp/lsh.md   # a smoke run
"""

import argparse
import json
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


def markdown(
    recall: dict,
    mass: tuple[float, float],
    speed: list[dict],
    args: argparse.Namespace,
    recall_args: argparse.Namespace,
) -> str:
    machine = (
        f"{platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}, {args.threads} threads"
    )
    if args.device.startswith("cuda"):
        machine += f", {torch.cuda.get_device_name()}"
    lines = [
        "# LSH attention",
        "",
        f"Machine: {machine}. Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        f"Command: `python {shlex.join(sys.argv)}`",
        "",
        f"LSH: {args.num_hashes} hash round(s), {args.num_buckets} buckets; bucket_size {recall_args.bucket_size} for "
        f"recall (sliding window {keys_per_query(recall_args)}: the same number of earlier keys per query), "
        f"{args.bucket_size} for speed (sliding window {keys_per_query(args)}).",
        "",
        f"## Associative recall ({args.pairs} pairs, {args.recall_steps} steps)",
        "",
        "| layers | answer accuracy |",
        "|---|---|",
        *(f"| {name} | {accuracy:.3f} |" for name, accuracy in recall.items()),
        "",
        "## Dense attention mass on the chosen keys (trained lsh model)",
        "",
        f"LSH's keys: {mass[0]:.3f}; a band of the same size: {mass[1]:.3f}.",
        "",
        f"## Time and peak memory, forward + backward, (1, {args.heads}, L, {args.head_dim}) fp32, {args.device}",
        "",
        "| L | " + " | ".join(f"{name} s | {name} MiB" for name in SPEED_TYPES) + " |",
        "|---|" + "---|" * (2 * len(SPEED_TYPES)),
    ]
    cells = {(row["type"], row["length"]): row for row in speed}
    for length in args.lengths:
        values = [cells[(name, length)] for name in SPEED_TYPES]
        lines.append(
            f"| {length} | " + " | ".join(f"{row['seconds']:.4f} | {row['peak_mib']:.0f}" for row in values) + " |"
        )
    faster = [
        length for length in args.lengths if cells[("lsh", length)]["seconds"] < cells[("full", length)]["seconds"]
    ]
    lines += [
        "",
        f"LSH is faster than full sdpa from L = {faster[0]} on."
        if faster
        else "LSH was not faster than full sdpa at any measured length.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--bucket-size", type=int, default=64)
    parser.add_argument("--num-hashes", type=int, default=2)
    parser.add_argument("--num-buckets", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=32, help="associative-recall pairs (length 4 * pairs)")
    parser.add_argument("--recall-bucket-size", type=int, default=8)
    parser.add_argument("--recall-steps", type=int, default=1200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/lsh.md"))
    parser.add_argument("--one", nargs=2, metavar=("TYPE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args)))
        return
    speed = measure_all(args)
    recall_args = argparse.Namespace(**{**vars(args), "bucket_size": args.recall_bucket_size})
    task = AssociativeRecall(num_keys=2 * args.pairs, num_values=2 * args.pairs, num_pairs=args.pairs)
    models = {name: train(recall_config(task, name, recall_args), task, recall_args) for name in SPEED_TYPES}
    recall = {name: recall_accuracy(model, task, recall_args) for name, model in models.items()}
    recall["lsh, its lsh layers' output zeroed"] = ablated_accuracy(models["lsh"], task, recall_args)
    mass = attention_mass(models["lsh"], task, recall_args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(markdown(recall, mass, speed, args, recall_args))
    print(args.output.read_text())


if __name__ == "__main__":
    main()
