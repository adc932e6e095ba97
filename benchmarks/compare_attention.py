"""The attention core's TFLOP/s under each attention backend transformers registers, forward and forward+backward
(causal, bf16): the table `benchmarks/compare.py --large-rows` adds beside its rows.

    attention_core(args) -> dict       every backend that runs on the device, timed; the others with the reason
    attention_markdown(result, device) its table
"""

import argparse
import statistics
from collections.abc import Callable

import torch
from measure import interleaved
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_flash_attn_4_available

from coreformer import CoreformerDecoderConfig
from coreformer.attention import Attention, eager_attention_forward

# A flash backend is only tried where its package is importable: transformers would otherwise fall back to fetching a
# kernel from the Hub.
FLASH_AVAILABLE = {
    "flash_attention_2": is_flash_attn_2_available,
    "flash_attention_3": is_flash_attn_3_available,
    "flash_attention_4": is_flash_attn_4_available,
}


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
