"""coreformer against transformers' own GPT-2, BERT and BART with the same weights, side by side in one process.

Each reference model is built by transformers, converted with `coreformer.convert_from_hf` (so both compute the same
function: the outputs are compared before timing), and the two are timed in interleaved repeats (A B A B ...) so that
machine noise hits both alike. Reported: median time, spread (min-max), throughput and the ratio coreformer/reference.
Every path runs the way a user would run it by default (sdpa, dynamic cache); opt-in fast paths get their own rows.

    python benchmarks/compare.py            # the full table (several minutes on 2 CPU cores)
    python benchmarks/compare.py --quick    # small shapes, under a minute
"""

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import BartConfig, BartForConditionalGeneration, BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from coreformer import convert_from_hf
from coreformer.pretraining import flops_per_token


def interleaved(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Time each callable `repeats` times, alternating between them, after one warm-up call each."""
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def row(name: str, unit_count: float, unit: str, times: dict[str, list[float]]) -> dict:
    reference, ours = statistics.median(times["reference"]), statistics.median(times["coreformer"])
    return {
        "benchmark": name,
        "unit": unit,
        "reference_per_s": unit_count / reference,
        "coreformer_per_s": unit_count / ours,
        "speedup": reference / ours,
        "reference_spread_s": [min(times["reference"]), max(times["reference"])],
        "coreformer_spread_s": [min(times["coreformer"]), max(times["coreformer"])],
    }


def assert_same_function(reference: torch.Tensor, ours: torch.Tensor, name: str, tolerance: float) -> None:
    difference = (reference.float() - ours.float()).abs().max().item()
    if difference > tolerance:
        raise SystemExit(f"{name}: coreformer and the reference differ by {difference:.2e} (> {tolerance}): not timing")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    return platform.machine()


def bf16_gemm_peak(size: int, repeats: int = 5) -> float:
    """The machine's bf16 matmul FLOP/s: the best of `repeats` (size x size) @ (size x size) products."""
    a, b = torch.randn(size, size, dtype=torch.bfloat16), torch.randn(size, size, dtype=torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def gpt2_pair(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=args.vocab,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        n_positions=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    reference = GPT2LMHeadModel(config)
    return reference, convert_from_hf(reference)


def decoder_training(args: argparse.Namespace, precision: str) -> dict:
    """One AdamW step on (batch, seq) tokens, fp32 or under bf16 autocast."""
    models = dict(zip(("reference", "coreformer"), gpt2_pair(args)))
    ids = torch.randint(0, args.vocab, (args.train_batch, args.train_seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    runs = {}
    for name, model in models.items():
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer):
            with autocast:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        runs[name] = step
    with torch.no_grad(), autocast:
        losses = [m(input_ids=ids, labels=ids).loss for m in models.values()]
    assert_same_function(losses[0], losses[1], "decoder training loss", 1e-4 if precision == "fp32" else 5e-2)
    times = interleaved(runs, args.repeats)
    result = row(f"decoder training step ({precision})", ids.numel(), "tok/s", times)
    ours = models["coreformer"]
    # Model FLOP/s of the step (6N + attention, as pretraining.py's MFU), against the GEMM peak measured here.
    result["flops_per_token"] = flops_per_token(ours.config, ours.num_parameters(), args.train_seq)
    if precision == "bf16":
        for name in ("reference", "coreformer"):
            result[f"{name}_peak_fraction"] = result[f"{name}_per_s"] * result["flops_per_token"] / args.bf16_peak
    return result


def encoder_inference(args: argparse.Namespace) -> dict:
    """BERT-style encoder on a batch of variable-length sequences, right-padded to the longest."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.width,
        attn_implementation="sdpa",
    )
    reference = BertModel(config, add_pooling_layer=False).eval()
    ours = convert_from_hf(reference)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.encoder_seq // 8, args.encoder_seq + 1, (args.encoder_batch,), generator=generator)
    ids = torch.randint(5, args.vocab, (args.encoder_batch, args.encoder_seq), generator=generator)
    mask = (torch.arange(args.encoder_seq)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        outputs = [m(input_ids=ids, attention_mask=mask).last_hidden_state for m in (reference, ours)]
    real = mask.bool()
    assert_same_function(outputs[0][real], outputs[1][real], "encoder last_hidden_state", 1e-4)

    def runner(model):
        def run():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)

        return run

    times = interleaved({"reference": runner(reference), "coreformer": runner(ours)}, args.repeats)
    return row("encoder inference, variable-length padded batch", int(mask.sum()), "real tok/s", times)


def generation(pair: tuple[torch.nn.Module, torch.nn.Module], ids, mask, name: str, args, **options) -> dict:
    reference, ours = (model.eval() for model in pair)
    settings = dict(
        attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, **options
    )
    outputs = [model.generate(ids, **settings) for model in (reference, ours)]
    if not torch.equal(outputs[0], outputs[1]):
        raise SystemExit(f"{name}: generated tokens differ from the reference: not timing")
    times = interleaved(
        {
            "reference": lambda: reference.generate(ids, **settings),
            "coreformer": lambda: ours.generate(ids, **settings),
        },
        args.repeats,
    )
    return row(name, ids.shape[0] * args.new_tokens, "new tok/s", times)


def decoder_generation(args: argparse.Namespace, batch: int, **options) -> dict:
    pair = gpt2_pair(args)
    ids = torch.randint(5, args.vocab, (batch, args.prompt))
    mask = torch.ones_like(ids)
    mask[1:, : args.prompt // 4] = 0  # left padding on every row but the first
    suffix = f", {options['cache_implementation']} cache" if options else ""
    return generation(pair, ids, mask, f"decoder generation, batch {batch}{suffix}", args, pad_token_id=0, **options)


def seq2seq_generation(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=args.vocab,
        d_model=args.width,
        encoder_layers=args.layers // 2 or 1,
        decoder_layers=args.layers // 2 or 1,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=4 * args.width,
        decoder_ffn_dim=4 * args.width,
        max_position_embeddings=1024,
        dropout=0.0,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )
    reference = BartForConditionalGeneration(config)
    ids = torch.randint(5, args.vocab, (args.seq2seq_batch, args.prompt))
    mask = torch.ones_like(ids)
    mask[1:, -args.prompt // 4 :] = 0
    return generation((reference, convert_from_hf(reference)), ids, mask, "seq2seq generation", args)


def markdown(rows: list[dict], machine: str, bf16_peak: float) -> str:
    notes = []
    lines = [
        f"Machine: {machine}",
        "",
        "| benchmark | transformers | coreformer | speedup | spread (s) transformers / coreformer |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "coreformer_peak_fraction" in r:
            notes.append(
                f"{r['benchmark']}: {r['flops_per_token'] / 1e6:.0f} MFLOP/token; model FLOP/s = "
                f"{r['reference_peak_fraction']:.0%} (transformers) and {r['coreformer_peak_fraction']:.0%} "
                f"(coreformer) of the measured bf16 GEMM peak, {bf16_peak / 1e9:,.0f} GFLOP/s."
            )
        spread = "{:.3f}-{:.3f} / {:.3f}-{:.3f}".format(*r["reference_spread_s"], *r["coreformer_spread_s"])
        lines.append(
            f"| {r['benchmark']} | {r['reference_per_s']:,.0f} {r['unit']} | {r['coreformer_per_s']:,.0f} {r['unit']} "
            f"| {r['speedup']:.2f}x | {spread} |"
        )
    return "\n".join(lines + [""] + notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (about a minute)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes, one repeat: checks the harness, times nothing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/compare.json"))
    args = parser.parse_args()
    # The reference setting: 6 layers, 384 wide, vocab 8192, training batch 8 x 256.
    shapes = dict(
        layers=6,
        width=384,
        heads=6,
        vocab=8192,
        train_batch=8,
        train_seq=256,
        encoder_batch=32,
        encoder_seq=256,
        prompt=32,
        new_tokens=128,
        seq2seq_batch=8,
    )
    if args.quick:
        shapes.update(
            layers=2,
            width=128,
            heads=4,
            vocab=1024,
            train_batch=4,
            train_seq=64,
            encoder_batch=8,
            encoder_seq=64,
            prompt=8,
            new_tokens=16,
            seq2seq_batch=4,
        )
        args.repeats = min(args.repeats, 3)
    if args.tiny:
        shapes.update(
            layers=1,
            width=32,
            heads=2,
            vocab=128,
            train_batch=2,
            train_seq=16,
            encoder_batch=4,
            encoder_seq=16,
            prompt=8,
            new_tokens=4,
            seq2seq_batch=2,
        )
        args.repeats = 1
    vars(args).update(shapes)

    machine = f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    args.bf16_peak = bf16_gemm_peak(256 if args.tiny else 2048)
    print(f"measured bf16 GEMM peak: {args.bf16_peak / 1e9:,.0f} GFLOP/s", flush=True)
    rows = [
        decoder_training(args, "fp32"),
        decoder_training(args, "bf16"),
        encoder_inference(args),
        decoder_generation(args, batch=1),
        decoder_generation(args, batch=8),
        decoder_generation(args, batch=8, cache_implementation="static"),
        seq2seq_generation(args),
    ]
    for r in rows:
        print(f"  {r['benchmark']}: {r['speedup']:.2f}x", flush=True)
    print("\n" + markdown(rows, machine, args.bf16_peak))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    report = {"machine": machine, "bf16_gemm_peak_flops": args.bf16_peak, "settings": settings, "rows": rows}
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
