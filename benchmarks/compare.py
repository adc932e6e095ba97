"""coreformer against transformers' own GPT-2, BERT and BART with the same weights, side by side in one process.

Each reference model is built by transformers, converted with `coreformer.convert_from_hf` (so both compute the same
function: the outputs are compared before timing), and the two are timed in interleaved repeats (A B A B ...) so that
machine noise hits both alike. Reported: median time, spread (min-max), throughput and the ratio coreformer/reference;
the share of the row's physical limit (training: model FLOP/s over the bf16 GEMM peak measured here; decoding: new
tok/s over the weight-products floor); and each model's peak memory, the rise of resident memory during one call,
measured in a fresh process per row (a count of bytes, so load on the machine does not change it). Every path runs the
way a user would run it by default (sdpa, dynamic cache); coreformer's training rows take the loss as pretraining
does (`skip_logits=True`, the projection fused with the loss); opt-in fast paths (static cache, bf16 weights,
torch.compile with the same options for both models) get their own rows.

Two larger measurements, on by default with `--device cuda` (`--large-rows` forces them, `--no-large-rows` drops them),
get tables of their own: a GPT-2-small-shape (124M) bf16 training step with fused AdamW, with model FLOP utilisation
(MFU) against the bf16 GEMM peak measured on the same device; and the TFLOP/s of coreformer's attention core, forward
and forward+backward, under each attention backend transformers registers that runs on the device.

    python benchmarks/compare.py                    # the full table (several minutes on 2 CPU cores)
    python benchmarks/compare.py --quick            # small shapes, under a minute
    python benchmarks/compare.py --device cuda      # every row on the GPU, plus the 124M training and attention tables
    python benchmarks/compare.py --tiny --large-rows   # toy shapes for every row and table: checks the harness
    python benchmarks/compare.py --only "vocab 50,257" --no-compiled-rows   # some rows only

Beside it: compare_attention.py (the attention-core table) and measure.py (timing, memory and the machine).
"""

import argparse
import json
import multiprocessing
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from compare_attention import attention_core, attention_markdown
from measure import LIBC, M_MMAP_THRESHOLD, bf16_gemm_peak, device_name, interleaved, peak_memory_mib
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertModel,
    CompileConfig,
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from coreformer import convert_from_hf
from coreformer.training.flops import flops_per_token


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


class Prepared(NamedTuple):
    """A pair ready to time: one call per model (same work), what a call produces, and what its limit reads."""

    runs: dict[str, Callable[[], None]]  # "reference", "coreformer"
    units: float  # tokens (training, inference) or new tokens (generation) per call
    unit: str
    ours: torch.nn.Module  # whose FLOPs (training) or weights (decoding) the physical limit counts
    batch: int
    seq: int


@dataclass(frozen=True)
class Benchmark:
    """One row: `prepare(args, **options)` builds and checks the pair; `limit` names the physical limit its share is
    reported against: "gemm" (model FLOP/s over the measured bf16 GEMM peak), "floor" (new tok/s over the
    weight-products floor) or None."""

    label: str
    prepare: Callable[..., Prepared]
    options: dict = field(default_factory=dict)
    limit: str | None = None


def gpt2_pair(args: argparse.Namespace, vocab: int | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab or args.vocab,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        n_positions=max(1024, args.long_seq),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    reference = GPT2LMHeadModel(config).to(args.device)
    return reference, convert_from_hf(reference)  # on the reference's device


def prepare_decoder_training(
    args: argparse.Namespace,
    precision: str,
    *,
    vocab: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    fused_loss: bool = True,
    fused_adamw: bool | None = None,
    compiled: bool = False,
) -> Prepared:
    """One AdamW step on (batch, seq) tokens, fp32 or under bf16 autocast. coreformer takes its loss as pretraining
    does, fused with the projection (`skip_logits=True`), unless `fused_loss=False`; `fused_adamw` picks torch's fused
    AdamW kernel; `compiled` runs both models' forward through `torch.compile` with the same options
    (`--compile-backend`)."""
    vocab, batch, seq = vocab or args.vocab, batch or args.train_batch, seq or args.train_seq
    models = dict(zip(("reference", "coreformer"), gpt2_pair(args, vocab)))
    ids = torch.randint(0, vocab, (batch, seq), device=args.device)
    autocast = torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    loss_options = {"reference": {}, "coreformer": {"skip_logits": fused_loss}}
    runs = {}
    for name, model in models.items():
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused_adamw)
        forward = torch.compile(model, backend=args.compile_backend) if compiled else model

        def step(forward=forward, optimizer=optimizer, options=loss_options[name]):
            with autocast:
                loss = forward(input_ids=ids, labels=ids, **options).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        runs[name] = step
    with torch.no_grad(), autocast:
        losses = [model(input_ids=ids, labels=ids, **loss_options[n]).loss for n, model in models.items()]
    assert_same_function(losses[0], losses[1], "decoder training loss", 1e-4 if precision == "fp32" else 5e-2)
    return Prepared(runs, ids.numel(), "tok/s", models["coreformer"], batch, seq)


def prepare_encoder_inference(args: argparse.Namespace, *, dtype: torch.dtype = torch.float32) -> Prepared:
    """BERT-style encoder on a batch of variable-length sequences, right-padded to the longest; weights in `dtype`."""
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
    reference, ours = reference.to(dtype), ours.to(dtype)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.encoder_seq // 8, args.encoder_seq + 1, (args.encoder_batch,), generator=generator)
    ids = torch.randint(5, args.vocab, (args.encoder_batch, args.encoder_seq), generator=generator)
    mask = (torch.arange(args.encoder_seq)[None, :] < lengths[:, None]).long()
    ids, mask = ids.to(args.device), mask.to(args.device)
    with torch.no_grad():
        outputs = [m(input_ids=ids, attention_mask=mask).last_hidden_state for m in (reference, ours)]
    real = mask.bool()
    # bf16 weights: the two round the same sums in a different order (a bf16 step is 2⁻⁸ of the value).
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2 * outputs[0][real].abs().max().item()
    assert_same_function(outputs[0][real], outputs[1][real], "encoder last_hidden_state", tolerance)

    def runner(model):
        def run():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)

        return run

    runs = {"reference": runner(reference), "coreformer": runner(ours)}
    return Prepared(runs, int(mask.sum()), "real tok/s", ours, args.encoder_batch, args.encoder_seq)


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


def prepare_generation(
    pair: tuple[torch.nn.Module, torch.nn.Module], ids, mask, name: str, args, dtype: torch.dtype, **options
) -> Prepared:
    reference, ours = (model.to(dtype).eval() for model in pair)
    settings = dict(
        attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, **options
    )
    if dtype == torch.float32:
        outputs = [model.generate(ids, **settings) for model in (reference, ours)]
        if not torch.equal(outputs[0], outputs[1]):
            raise SystemExit(f"{name}: generated tokens differ from the reference: not timing")
    else:  # bf16 weights: a near-tie may pick another token; the prompt's logits must agree within bf16 rounding
        with torch.no_grad():
            logits = [model(ids, attention_mask=mask).logits[:, -1].float() for model in (reference, ours)]
        assert_same_function(logits[0], logits[1], name, 5e-2 * logits[0].abs().max().item())
    runs = {
        "reference": lambda: reference.generate(ids, **settings),
        "coreformer": lambda: ours.generate(ids, **settings),
    }
    return Prepared(runs, ids.shape[0] * args.new_tokens, "new tok/s", ours, ids.shape[0], ids.shape[1])


def compile_settings(args: argparse.Namespace) -> dict:
    """generate() options of the compiled rows, the same for both models: a static cache and a compile config
    (`fullgraph=True`; transformers compiles only on CUDA/XPU unless told to compile on every device)."""
    config = CompileConfig(fullgraph=True, backend=args.compile_backend)
    config._compile_all_devices = True  # transformers' own switch for devices it does not auto-compile on
    return dict(cache_implementation="static", compile_config=config)


def prepare_decoder_generation(
    args: argparse.Namespace, batch: int, *, dtype: torch.dtype = torch.float32, compiled: bool = False, **options
) -> Prepared:
    pair = gpt2_pair(args)
    ids = torch.randint(5, args.vocab, (batch, args.prompt), device=args.device)
    mask = torch.ones_like(ids)
    mask[1:, : args.prompt // 4] = 0  # left padding on every row but the first
    options.update(compile_settings(args) if compiled else {})
    return prepare_generation(
        pair, ids, mask, f"decoder generation, batch {batch}", args, dtype, pad_token_id=0, **options
    )


def prepare_seq2seq_generation(args: argparse.Namespace, *, compiled: bool = False) -> Prepared:
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
    pair = (reference, convert_from_hf(reference))
    options = compile_settings(args) if compiled else {}
    return prepare_generation(pair, ids, mask, "seq2seq generation", args, torch.float32, **options)


def benchmarks(args: argparse.Namespace) -> list[Benchmark]:
    """The table's rows, in order. Training rows count model FLOP/s against the bf16 GEMM peak (bf16 rows only);
    generation rows count new tok/s against the weight-products floor."""
    bf16, real_vocab = torch.bfloat16, args.real_vocab
    rows = [
        Benchmark("decoder training step (fp32)", prepare_decoder_training, dict(precision="fp32")),
        Benchmark("decoder training step (bf16)", prepare_decoder_training, dict(precision="bf16"), "gemm"),
        Benchmark(
            f"decoder training step (bf16, vocab {real_vocab:,})",
            prepare_decoder_training,
            dict(precision="bf16", vocab=real_vocab),
            "gemm",
        ),
        Benchmark(
            f"decoder training step (bf16, vocab {real_vocab:,}, coreformer without the fused loss)",
            prepare_decoder_training,
            dict(precision="bf16", vocab=real_vocab, fused_loss=False),
            "gemm",
        ),
        Benchmark(
            f"long-sequence training step (bf16, vocab {real_vocab:,}, {args.long_batch} x {args.long_seq})",
            prepare_decoder_training,
            dict(precision="bf16", vocab=real_vocab, batch=args.long_batch, seq=args.long_seq),
            "gemm",
        ),
        Benchmark("encoder inference, variable-length padded batch", prepare_encoder_inference),
        Benchmark("encoder inference, bf16 weights", prepare_encoder_inference, dict(dtype=bf16)),
        Benchmark("decoder generation, batch 1", prepare_decoder_generation, dict(batch=1), "floor"),
        Benchmark("decoder generation, batch 8", prepare_decoder_generation, dict(batch=8), "floor"),
        Benchmark(
            "decoder generation, batch 8, static cache",
            prepare_decoder_generation,
            dict(batch=8, cache_implementation="static"),
            "floor",
        ),
        Benchmark(
            "decoder generation, batch 1, bf16 weights", prepare_decoder_generation, dict(batch=1, dtype=bf16), "floor"
        ),
        Benchmark("seq2seq generation", prepare_seq2seq_generation, {}, "floor"),
    ]
    if args.compiled_rows:
        rows += [
            Benchmark(
                f"decoder training step (bf16, vocab {real_vocab:,}, torch.compile)",
                prepare_decoder_training,
                dict(precision="bf16", vocab=real_vocab, compiled=True),
                "gemm",
            ),
            Benchmark(
                "decoder generation, batch 1, compiled static cache",
                prepare_decoder_generation,
                dict(batch=1, compiled=True),
                "floor",
            ),
            Benchmark(
                "decoder generation, batch 8, compiled static cache",
                prepare_decoder_generation,
                dict(batch=8, compiled=True),
                "floor",
            ),
            Benchmark(
                "seq2seq generation, compiled static cache", prepare_seq2seq_generation, dict(compiled=True), "floor"
            ),
        ]
    return rows


def memory_of_benchmark(benchmark: Benchmark, args: argparse.Namespace) -> dict[str, float]:
    """Peak MiB of each model's call in `benchmark`, in a fresh process (run by `measure_memory`)."""
    LIBC.mallopt(M_MMAP_THRESHOLD, 64 * 1024)  # every allocation of 64 KiB or more: its own mapping, unmapped on free
    torch.set_num_threads(args.threads)
    prepared = benchmark.prepare(args, **benchmark.options)
    return {name: peak_memory_mib(run) for name, run in prepared.runs.items()}


def measure_memory(benchmark: Benchmark, args: argparse.Namespace) -> dict[str, float] | str:
    """Each model's peak MiB in `benchmark`, measured in a fresh process (a process that already ran other
    rows keeps pages they freed), or the reason it cannot be measured here."""
    if LIBC is None or not Path("/proc/self/clear_refs").exists():
        return "needs Linux (glibc's mallopt and /proc/self/clear_refs)"
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(memory_of_benchmark, (benchmark, args))


def run_benchmark(benchmark: Benchmark, args: argparse.Namespace) -> dict:
    prepared = benchmark.prepare(args, **benchmark.options)
    times = interleaved(prepared.runs, args.repeats, args.device)
    result = row(benchmark.label, prepared.units, prepared.unit, times)
    ours = prepared.ours
    if benchmark.limit == "gemm":
        # Model FLOP/s of the step (6N + attention, as the pretraining run's MFU), against the GEMM peak measured here:
        # the `_peak_fraction` fields are MFU with the measured bf16 peak, not the spec sheet's, as the denominator.
        result.update(parameters=ours.num_parameters(), batch=prepared.batch, seq=prepared.seq)
        result["flops_per_token"] = flops_per_token(ours.config, ours.num_parameters(), prepared.seq)
        for name in ("reference", "coreformer"):
            result[f"{name}_peak_fraction"] = result[f"{name}_per_s"] * result["flops_per_token"] / args.bf16_peak
    elif benchmark.limit == "floor":
        floor = weight_products_floor(ours, prepared.batch, 20, args.device)
        result["weight_products_floor_per_s"] = prepared.batch / floor
        for name in ("reference", "coreformer"):
            result[f"{name}_floor_fraction"] = result[f"{name}_per_s"] / result["weight_products_floor_per_s"]
    del prepared, times
    memory = measure_memory(benchmark, args) if args.memory else "not measured (--no-memory)"
    if isinstance(memory, str):
        result["peak_memory_skipped"] = memory
    else:
        result.update({f"{name}_peak_mib": mib for name, mib in memory.items()})
    return result


def large_decoder_training(args: argparse.Namespace) -> dict:
    """The bf16 training step of a GPT-2-small-shape decoder (training/configs/decoder-base.yaml: 124M parameters),
    with its shapes and torch's fused AdamW (CPU and CUDA kernels since torch 2.4)."""
    shape = argparse.Namespace(**{**vars(args), **args.large_decoder})
    label = (
        f"GPT-2 small shape training step ({shape.layers} x {shape.width}, vocab {shape.vocab}, "
        f"{shape.train_batch} x {shape.train_seq} tokens, bf16, fused AdamW)"
    )
    return run_benchmark(
        Benchmark(label, prepare_decoder_training, dict(precision="bf16", fused_adamw=True), "gemm"), shape
    )


def share_of_limit(r: dict) -> str:
    """ "55% / 58%": each model's share of the row's physical limit, or "" where the row has none."""
    for kind in ("peak", "floor"):
        if f"coreformer_{kind}_fraction" in r:
            return f"{r[f'reference_{kind}_fraction']:.0%} / {r[f'coreformer_{kind}_fraction']:.0%}"
    return ""


def peak_memory(r: dict) -> str:
    if "coreformer_peak_mib" not in r:
        return r.get("peak_memory_skipped", "")
    ratio = r["coreformer_peak_mib"] / r["reference_peak_mib"] if r["reference_peak_mib"] > 0 else float("nan")
    return f"{r['reference_peak_mib']:,.0f} / {r['coreformer_peak_mib']:,.0f} ({ratio:.2f}x)"


def markdown(rows: list[dict], machine: str, bf16_peak: float, label: str | None) -> str:
    notes = []
    lines = [
        f"Machine: {machine}" + (f" ({label})" if label else ""),
        "",
        "| benchmark | transformers | coreformer | speedup | share of limit, transformers / coreformer "
        "| peak MiB, transformers / coreformer | spread (s) transformers / coreformer |",
        "|---|---|---|---|---|---|---|",
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
            f"| {r['speedup']:.2f}x | {share_of_limit(r)} | {peak_memory(r)} | {spread} |"
        )
    legend = [
        "",
        "Share of limit: training rows, model FLOP/s over the measured bf16 GEMM peak; generation rows, new tok/s over "
        "the weight-products floor. Peak MiB: the rise of resident memory during one call (after a warm-up call), "
        "each model in a fresh process.",
    ]
    return "\n".join(lines + legend + [""] + notes)


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


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (about a minute)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes, one repeat: checks the harness, times nothing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/compare.json"))
    parser.add_argument("--label", help='how the run was taken, printed with the table, e.g. "measured under load"')
    parser.add_argument(
        "--compiled-rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch.compile rows: the training step, and static-cache generate() with a compile config",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the compiled rows, the same for both models (the tests use aot_eager: it "
        "traces the same graphs without inductor's C++ build)",
    )
    parser.add_argument(
        "--only", nargs="+", metavar="TEXT", help="run only the rows whose label contains one of these texts"
    )
    parser.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="peak memory of every row, each model in a fresh process (Linux)",
    )
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
    return parser.parse_args()


def resolve_device(args: argparse.Namespace) -> None:
    """args.device becomes a torch.device (refused with the fix where CUDA is asked for and absent); the large tables
    default to on where it is a GPU."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda: torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda}). "
            "Run on a machine with an NVIDIA GPU and a CUDA build of torch, or use --device cpu."
        )
    args.device = torch.device(args.device)
    if args.large_rows is None:
        args.large_rows = args.device.type == "cuda"


def reference_shapes(device: torch.device) -> dict:
    """The reference setting: 6 layers, 384 wide, vocab 8192, training batch 8 x 256."""
    return dict(
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
            train_batch=8 if device.type == "cuda" else 1,
            train_seq=1024,
        ),
        attention_shape=(4, 12, 4096, 64) if device.type == "cuda" else (1, 12, 1024, 64),  # (B, H, L, D)
        real_vocab=50257,  # GPT-2's own vocabulary, where the logits dominate a small model's memory
        long_batch=2,
        long_seq=1024,
    )


# --quick: small shapes, under a minute; --tiny: toy shapes that check the harness and time nothing.
QUICK_SHAPES = dict(
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
    real_vocab=4096,
    long_batch=1,
    long_seq=256,
)
TINY_SHAPES = dict(
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
    real_vocab=257,
    long_batch=1,
    long_seq=64,
)


def resolve_shapes(args: argparse.Namespace) -> None:
    """The run's shapes and repeats onto args: the reference setting, or --quick's / --tiny's smaller ones."""
    shapes = reference_shapes(args.device)
    if args.quick:
        shapes.update(QUICK_SHAPES)
        args.repeats = min(args.repeats, 3)
    if args.tiny:
        shapes.update(TINY_SHAPES)
        args.repeats = 1
    vars(args).update(shapes)
    args.threads = torch.get_num_threads()


def start_report(args: argparse.Namespace) -> dict:
    """The machine, its measured bf16 GEMM peak (onto args, for the shares of the limit) and the settings."""
    device = device_name(args.device)
    args.bf16_peak = bf16_gemm_peak(256 if args.tiny else 8192 if args.device.type == "cuda" else 2048, args.device)
    print(f"measured bf16 GEMM peak: {args.bf16_peak / 1e9:,.0f} GFLOP/s", flush=True)
    report = {
        "machine": f"{device}, torch {torch.__version__}",
        "device": device,
        "bf16_gemm_peak_flops": args.bf16_peak,
        "rows": [],
    }
    if args.label:
        report["label"] = args.label
    report["settings"] = {k: v for k, v in vars(args).items() if k != "output"}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    return report


def run_rows(args: argparse.Namespace, report: dict) -> str:
    """Every selected row (`--only`) into report["rows"], the JSON rewritten after each; returns their table."""
    rows = report["rows"]
    for benchmark in benchmarks(args):
        if args.only and not any(text in benchmark.label for text in args.only):
            continue
        rows.append(run_benchmark(benchmark, args))
        print(f"  {benchmark.label}: {rows[-1]['speedup']:.2f}x, {peak_memory(rows[-1])}", flush=True)
        # Written after every row, so a long run that is stopped keeps the rows it finished.
        args.output.write_text(json.dumps(report, indent=2, default=str))
    return markdown(rows, report["machine"], args.bf16_peak, args.label)


def run_large_tables(args: argparse.Namespace, report: dict) -> list[str]:
    """The 124M training step (MFU) and the attention core per backend, each with its table."""
    report["large_decoder_training"] = training = large_decoder_training(args)
    print(f"  {training['benchmark']}: {training['speedup']:.2f}x", flush=True)
    report["attention"] = attention = attention_core(args)
    return [
        training_markdown(training, report["device"], args.bf16_peak),
        attention_markdown(attention, report["device"]),
    ]


def main() -> None:
    args = parse_arguments()
    resolve_device(args)
    resolve_shapes(args)
    report = start_report(args)
    tables = [run_rows(args, report)]
    if args.large_rows:
        tables += run_large_tables(args, report)
    print("\n" + "\n\n".join(tables))
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
