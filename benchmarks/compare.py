"""coreformer against transformers' own GPT-2, BERT and BART with the same weights, side by side in one process.

Each reference model is built by transformers, converted with `coreformer.convert_from_hf` (so both compute the same
function: the outputs are compared before timing), and the two are timed in interleaved repeats (A B A B ...) so that
machine noise hits both alike. Reported: median time, spread (min-max), throughput and the ratio coreformer/reference.
Every path runs the way a user would run it by default (sdpa, dynamic cache); opt-in fast paths get their own rows.

Two larger measurements, on by default with `--device cuda` (`--large-rows` forces them, `--no-large-rows` drops them),
get tables of their own: a GPT-2-small-shape (124M) bf16 training step with fused AdamW, with model FLOP utilisation
(MFU) against the bf16 GEMM peak measured on the same device; and the TFLOP/s of coreformer's attention core, forward
and forward+backward, under each attention backend transformers registers that runs on the device.

    python benchmarks/compare.py                    # the full table (several minutes on 2 CPU cores)
    python benchmarks/compare.py --quick            # small shapes, under a minute
    python benchmarks/compare.py --device cuda      # every row on the GPU, plus the 124M training and attention tables
    python benchmarks/compare.py --tiny --large-rows   # toy shapes for every row and table: checks the harness
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
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_flash_attn_4_available

from coreformer import CoreformerDecoderConfig, convert_from_hf
from coreformer.attention import Attention, eager_attention_forward
from coreformer.training.reports import flops_per_token

# A flash backend is only tried where its package is importable: transformers would otherwise fall back to fetching a
# kernel from the Hub.
FLASH_AVAILABLE = {
    "flash_attention_2": is_flash_attn_2_available,
    "flash_attention_3": is_flash_attn_3_available,
    "flash_attention_4": is_flash_attn_4_available,
}


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`: CUDA kernels run asynchronously, so reading the clock before this would
    time the launches, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(runs: dict[str, Callable[[], None]], repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Time each callable `repeats` times, alternating between them, after one warm-up call each."""
    for run in runs.values():
        run()
    synchronize(device)
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            synchronize(device)
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


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA, else the CPU's model name and torch's thread count."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"{cpu_name()}, {torch.get_num_threads()} threads"


def bf16_gemm_peak(size: int, device: torch.device, repeats: int = 5) -> float:
    """The device's bf16 matmul FLOP/s: the best of `repeats` (size x size) @ (size x size) products."""
    a, b = (torch.randn(size, size, dtype=torch.bfloat16, device=device) for _ in range(2))
    a @ b
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        synchronize(device)
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
    reference = GPT2LMHeadModel(config).to(args.device)
    return reference, convert_from_hf(reference)  # on the reference's device


def decoder_training(
    args: argparse.Namespace, precision: str, *, label: str | None = None, fused: bool | None = None
) -> dict:
    """One AdamW step on (batch, seq) tokens, fp32 or under bf16 autocast; `fused` picks torch's fused AdamW kernel."""
    models = dict(zip(("reference", "coreformer"), gpt2_pair(args)))
    ids = torch.randint(0, args.vocab, (args.train_batch, args.train_seq), device=args.device)
    autocast = torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    runs = {}
    for name, model in models.items():
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

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
    times = interleaved(runs, args.repeats, args.device)
    result = row(label or f"decoder training step ({precision})", ids.numel(), "tok/s", times)
    ours = models["coreformer"]
    result.update(parameters=ours.num_parameters(), batch=args.train_batch, seq=args.train_seq)
    # Model FLOP/s of the step (6N + attention, as pretraining.py's MFU), against the GEMM peak measured here: the
    # `_peak_fraction` fields are MFU with the measured bf16 peak, not the spec sheet's, as the denominator.
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
    reference = BertModel(config, add_pooling_layer=False).eval().to(args.device)
    ours = convert_from_hf(reference)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.encoder_seq // 8, args.encoder_seq + 1, (args.encoder_batch,), generator=generator)
    ids = torch.randint(5, args.vocab, (args.encoder_batch, args.encoder_seq), generator=generator)
    mask = (torch.arange(args.encoder_seq)[None, :] < lengths[:, None]).long()
    ids, mask = ids.to(args.device), mask.to(args.device)
    with torch.no_grad():
        outputs = [m(input_ids=ids, attention_mask=mask).last_hidden_state for m in (reference, ours)]
    real = mask.bool()
    assert_same_function(outputs[0][real], outputs[1][real], "encoder last_hidden_state", 1e-4)

    def runner(model):
        def run():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)

        return run

    times = interleaved({"reference": runner(reference), "coreformer": runner(ours)}, args.repeats, args.device)
    return row("encoder inference, variable-length padded batch", int(mask.sum()), "real tok/s", times)


def decode_step_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weight matrices one decode step multiplies by: every Linear except the encoder's and the cross-attention
    keys/values (computed once per prompt), and the LM head."""
    once_per_prompt = ("encoder.", "cross_attn.k_proj", "cross_attn.v_proj")
    return [
        module.weight
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not any(part in name for part in once_per_prompt)
    ]


def weight_products_floor(model: torch.nn.Module, batch: int, repeats: int, device: torch.device) -> float:
    """Seconds for one decode step's matrix products alone: each weight times a (batch, in_features) input, nothing
    else. Small-batch decoding is bound by reading these weights, so no implementation of the same function in the
    same dtype decodes faster than this; the best of `repeats`."""
    weights = decode_step_weights(model)
    inputs = {
        width: torch.randn(batch, width, device=device, dtype=weights[0].dtype)
        for width in {w.shape[1] for w in weights}
    }

    def step():
        for weight in weights:
            torch.nn.functional.linear(inputs[weight.shape[1]], weight)

    with torch.no_grad():
        times = interleaved({"floor": step}, repeats, device)["floor"]
    return min(times)


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
        args.device,
    )
    result = row(name, ids.shape[0] * args.new_tokens, "new tok/s", times)
    result["weight_products_floor_per_s"] = ids.shape[0] / weight_products_floor(ours, ids.shape[0], 20, args.device)
    return result


def decoder_generation(args: argparse.Namespace, batch: int, **options) -> dict:
    pair = gpt2_pair(args)
    ids = torch.randint(5, args.vocab, (batch, args.prompt), device=args.device)
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
    reference = BartForConditionalGeneration(config).to(args.device)
    ids = torch.randint(5, args.vocab, (args.seq2seq_batch, args.prompt), device=args.device)
    mask = torch.ones_like(ids)
    mask[1:, -args.prompt // 4 :] = 0
    return generation((reference, convert_from_hf(reference)), ids, mask, "seq2seq generation", args)


def large_decoder_training(args: argparse.Namespace) -> dict:
    """The bf16 training step of a GPT-2-small-shape decoder (training/configs/decoder-base.yaml: 124M parameters),
    through `decoder_training` with its shapes, and torch's fused AdamW (CPU and CUDA kernels since torch 2.4)."""
    shape = argparse.Namespace(**{**vars(args), **args.large_decoder})
    label = (
        f"GPT-2 small shape training step ({shape.layers} x {shape.width}, vocab {shape.vocab}, "
        f"{shape.train_batch} x {shape.train_seq} tokens, bf16, fused AdamW)"
    )
    return decoder_training(shape, "bf16", label=label, fused=True)


def attention_backends(names: list[str], device: torch.device) -> dict[str, str | None]:
    """Each backend in `names` with the reason it cannot run on `device`, or None where it may."""
    backends: dict[str, str | None] = {}
    for name in names:
        if name.startswith("paged"):
            backends[name] = "reads keys and values from a paged cache (continuous batching): no plain forward"
        elif name.startswith("flash") and device.type != "cuda":
            backends[name] = "needs CUDA"
        elif name.startswith("flash") and not FLASH_AVAILABLE.get(name, lambda: False)():
            backends[name] = "its package is not installed"
        else:
            backends[name] = None
    return backends


def attention_call(implementation: str, shape: tuple[int, int, int, int], device: torch.device) -> Callable:
    """coreformer's attention core for a full causal layer under `implementation`, called as `Attention._attend`
    calls it: (B, H, L, D) queries, keys and values -> (B, L, H, D)."""
    batch, heads, length, head_dim = shape
    config = CoreformerDecoderConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_hidden_layers=1, max_position_embeddings=length
    )
    config._attn_implementation = implementation
    module = Attention(config, layer_idx=0, is_causal=True).to(device).eval()  # its settings are read, not its weights
    # The mask the decoder stack builds once per forward, in the form this backend wants (None for sdpa and flash,
    # which then run their causal kernels; a BlockMask for flex; an additive (B, 1, L, L) tensor for eager).
    mask = create_causal_mask(
        config=config,
        inputs_embeds=torch.empty(batch, length, config.hidden_size, dtype=torch.bfloat16, device=device),
        attention_mask=None,
        past_key_values=None,
        position_ids=torch.arange(length, device=device)[None],
    )
    attention_fn = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)

    def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return attention_fn(module, query, key, value, mask, dropout=0.0, scaling=module.scaling)[0]

    return call


def failure(error: Exception) -> str:
    """An exception as a one-line reason for a table cell."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]


def attention_core(args: argparse.Namespace) -> dict:
    """FLOP/s of the attention core, forward and forward+backward, causal and bf16, under each backend that runs on
    the device. A backend that raises here, or whose output is not the first backend's (eager's by default), is
    reported as skipped with the reason."""
    batch, heads, length, head_dim = args.attention_shape
    # FLOPs as FlashAttention counts them (Dao 2023, benchmarks/benchmark_flash_attention.py): Q Kᵀ and P V take
    # 2·B·H·L²·D each, so 4·B·H·L²·D forward, halved for causal attention (only the lower triangle is useful work,
    # whatever a backend computes); the backward pass counts 2.5x the forward (FlashAttention's backward recomputes
    # Q Kᵀ: five matmuls to the forward's two), so forward+backward is 3.5x the forward.
    forward_flops = 4 * batch * heads * length**2 * head_dim / 2
    flops = {"forward": forward_flops, "forward_backward": 3.5 * forward_flops}
    torch.manual_seed(0)
    inputs = [
        torch.randn(batch, heads, length, head_dim, dtype=torch.bfloat16, device=args.device) for _ in range(3)
    ]  # query, key, value: (B, H, L, D)
    leaves = [tensor.detach().requires_grad_() for tensor in inputs]
    output_grad = torch.randn(batch, length, heads, head_dim, dtype=torch.bfloat16, device=args.device)  # (B, L, H, D)

    backends = attention_backends(args.attention_backends, args.device)
    results = {name: {"backend": name} for name in backends}
    runs: dict[str, dict[str, Callable[[], None]]] = {"forward": {}, "forward_backward": {}}
    reference = None
    for name, reason in backends.items():
        if reason is None:
            # Any error is this backend's limit on this device (no CPU backward for flex, a missing compiler, ...):
            # it becomes the row's reason rather than ending the run.
            try:
                call = attention_call(name, args.attention_shape, args.device)
                with torch.no_grad():
                    output = call(*inputs).float()
            except Exception as error:
                reason = failure(error)
            else:
                if reference is None:  # the first backend that runs, eager by default
                    reference, reference_name = output, name
                # bf16 outputs: two roundings (a bf16 step is 2⁻⁸ of the value) are not a difference.
                difference = (output - reference).abs().max().item()
                if difference > 2e-2 * reference.abs().max().item():
                    reason = f"output differs from {reference_name}'s by {difference:.2e}: not timed"
        if reason is not None:
            results[name].update(forward={"skipped": reason}, forward_backward={"skipped": reason})
            continue

        def forward(call=call):
            with torch.no_grad():
                call(*inputs)

        def forward_backward(call=call):
            torch.autograd.grad(call(*leaves), leaves, output_grad)

        runs["forward"][name] = forward
        try:
            forward_backward()
            runs["forward_backward"][name] = forward_backward
        except Exception as error:
            results[name]["forward_backward"] = {"skipped": failure(error)}

    for mode, mode_runs in runs.items():
        for name, seconds in interleaved(mode_runs, args.repeats, args.device).items():
            median = statistics.median(seconds)
            results[name][mode] = {
                "flop_per_s": flops[mode] / median,
                "median_s": median,
                "spread_s": [min(seconds), max(seconds)],
            }
    return {
        "shape": dict(zip(("batch", "heads", "length", "head_dim"), args.attention_shape)),
        "causal": True,
        "dtype": "bfloat16",
        "flops": flops,
        "backends": list(results.values()),
    }


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
        if "weight_products_floor_per_s" in r:
            floor = r["weight_products_floor_per_s"]
            notes.append(
                f"{r['benchmark']}: the weight products alone (every matrix a decode step reads, times the batch, "
                f"nothing else) allow at most {floor:,.0f} new tok/s; transformers reaches "
                f"{r['reference_per_s'] / floor:.0%} of that, coreformer {r['coreformer_per_s'] / floor:.0%}."
            )
        spread = "{:.3f}-{:.3f} / {:.3f}-{:.3f}".format(*r["reference_spread_s"], *r["coreformer_spread_s"])
        lines.append(
            f"| {r['benchmark']} | {r['reference_per_s']:,.0f} {r['unit']} | {r['coreformer_per_s']:,.0f} {r['unit']} "
            f"| {r['speedup']:.2f}x | {spread} |"
        )
    return "\n".join(lines + [""] + notes)


def training_markdown(r: dict, device: str, bf16_peak: float) -> str:
    lines = [
        f"{r['benchmark']} on {device}: {r['parameters'] / 1e6:.3g}M parameters, "
        f"{r['flops_per_token'] / 1e6:,.0f} MFLOP/token (6N + attention). MFU = tok/s x FLOP/token / the bf16 GEMM "
        f"peak measured on this device, {bf16_peak / 1e12:.3g} TFLOP/s.",
        "",
        "| model | tok/s | MFU | spread (s) |",
        "|---|---|---|---|",
    ]
    for name, label in (("reference", "transformers GPT2LMHeadModel"), ("coreformer", "coreformer")):
        spread = "{:.3f}-{:.3f}".format(*r[f"{name}_spread_s"])
        lines.append(f"| {label} | {r[f'{name}_per_s']:,.0f} | {r[f'{name}_peak_fraction']:.1%} | {spread} |")
    return "\n".join(lines + ["", f"coreformer / transformers: {r['speedup']:.2f}x"])


def attention_markdown(attention: dict, device: str) -> str:
    shape = attention["shape"]
    lines = [
        f"Attention core on {device}: causal, bf16, batch {shape['batch']}, {shape['heads']} heads, length "
        f"{shape['length']}, head dim {shape['head_dim']}. TFLOP/s count the causal half, "
        f"4·B·H·L²·D / 2 = {attention['flops']['forward'] / 1e9:,.3g} GFLOP forward, and 3.5x that forward+backward "
        "(FlashAttention's convention), whatever a backend computes.",
        "",
        "| backend | forward TFLOP/s | forward (ms) | forward+backward TFLOP/s | forward+backward (ms) |",
        "|---|---|---|---|---|",
    ]
    for backend in attention["backends"]:
        cells = []
        for mode in ("forward", "forward_backward"):
            result = backend[mode]
            if "skipped" in result:
                cells += [f"skipped: {result['skipped']}", ""]
            else:
                cells += [f"{result['flop_per_s'] / 1e12:.3g}", f"{result['median_s'] * 1e3:.3g}"]
        # A pipe inside a cell ("paged|eager") would end it: markdown tables take it escaped.
        cells = [cell.replace("|", "\\|") for cell in (backend["backend"], *cells)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (about a minute)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes, one repeat: checks the harness, times nothing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/compare.json"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every model and input lives")
    parser.add_argument(
        "--large-rows",
        action=argparse.BooleanOptionalAction,
        help="the 124M training step and attention backend tables (default: on with --device cuda only)",
    )
    # "eager" is no registered function: it is the fallback that `Attention` hands to `get_interface`.
    backends = ["eager", *sorted(ALL_ATTENTION_FUNCTIONS)]
    parser.add_argument(
        "--attention-backends",
        nargs="+",
        choices=backends,
        default=backends,
        metavar="NAME",
        help=f"attention implementations to time, the first as the reference output (default: all of {backends})",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda: torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda}). "
            "Run on a machine with an NVIDIA GPU and a CUDA build of torch, or use --device cpu."
        )
    args.device = torch.device(args.device)
    if args.large_rows is None:
        args.large_rows = args.device.type == "cuda"
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
        # GPT-2 small (training/configs/decoder-base.yaml), vocab 50257 padded to a multiple of 64. Micro-batch 8 on
        # a GPU; a CPU step on 8 x 1024 tokens would take minutes.
        large_decoder=dict(
            layers=12,
            width=768,
            heads=12,
            vocab=50304,
            train_batch=8 if args.device.type == "cuda" else 1,
            train_seq=1024,
        ),
        attention_shape=(4, 12, 4096, 64) if args.device.type == "cuda" else (1, 12, 1024, 64),  # (B, H, L, D)
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
            large_decoder=dict(layers=2, width=64, heads=4, vocab=128, train_batch=2, train_seq=32),
            attention_shape=(1, 2, 32, 8),
        )
        args.repeats = 1
    vars(args).update(shapes)

    device = device_name(args.device)
    machine = f"{device}, torch {torch.__version__}"
    args.bf16_peak = bf16_gemm_peak(256 if args.tiny else 8192 if args.device.type == "cuda" else 2048, args.device)
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
    report = {"machine": machine, "device": device, "bf16_gemm_peak_flops": args.bf16_peak, "rows": rows}
    tables = [markdown(rows, machine, args.bf16_peak)]
    if args.large_rows:
        report["large_decoder_training"] = training = large_decoder_training(args)
        print(f"  {training['benchmark']}: {training['speedup']:.2f}x", flush=True)
        report["attention"] = attention = attention_core(args)
        tables += [training_markdown(training, device, args.bf16_peak), attention_markdown(attention, device)]
    print("\n" + "\n\n".join(tables))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report["settings"] = {k: v for k, v in vars(args).items() if k != "output"}
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
