"""THE table of attention layer types (`config.layer_types`): one entry per type, so a new type is one entry.

    type      mask the stack builds                    sparse kernel (sdpa, nothing     transformers' cache layer
                                                       cached, not packed)
    full      causal / bidirectional                   -                                full_attention
    sliding   ... AND |q - k| <= sliding_window        sliding_window_attention         sliding_attention
    strided   ... AND (|q - k| < s or s | q - k)       strided_attention                full_attention
    lowrank   (B, S) padding mask (Linformer rows)     -                                full_attention (never cached)
    linear    (B, S) padding mask (feature maps)       -                                coreformer_linear_attention

The configuration validates names and parameters against this table and translates it for transformers' caches; the
stack builds each type's mask from it and decides, once per forward and per layer, whether the sparse kernel runs;
`Attention` calls the kernel it is handed. What a type computes beyond its mask (Linformer's projections, the feature
maps) lives in `Attention` and in `linear_attention.py`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .linear_attention import LINEAR_CACHE_LAYER
from .sparse_attention import sliding_window_attention, strided_attention

# transformers' mask functions: (batch, head, query position, key position) -> whether the key is visible.
MaskFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sliding_window_overlay(window: int) -> MaskFunction:
    """Band mask: a query sees keys at most `window` positions away (ANDed with causality in decoders)."""

    def allowed(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window

    return allowed


def strided_overlay(stride: int) -> MaskFunction:
    """Sparse Transformer strided pattern (Child et al. 2019, sec. 4.2): A(1) the `stride` nearest positions,
    A(2) every position a multiple of `stride` away."""

    def allowed(batch_idx, head_idx, q_idx, kv_idx):
        distance = (q_idx - kv_idx).abs()
        return (distance < stride) | (distance % stride == 0)

    return allowed


def sliding_kernel(window: int, query, key, value, **shared) -> torch.Tensor:
    """`sliding_window_attention` with the type's parameter (first, to be bound) as its window."""
    return sliding_window_attention(query, key, value, window=window, **shared)


def strided_kernel(stride: int, query, key, value, **shared) -> torch.Tensor:
    """`strided_attention` with the type's parameter (first, to be bound) as its stride."""
    return strided_attention(query, key, value, stride=stride, **shared)


@dataclass(frozen=True)
class LayerType:
    """One attention layer type.

    Attributes:
        cache_layer: the layer type transformers' caches build for it (`get_text_config` translates to these).
        saved_name: how config.json spells it for transformers' generic config (which validates the names).
        parameter: the config field the type needs (a positive integer), or None.
        overlay: builds the mask function ANDed into transformers' causal/bidirectional mask from that parameter;
            None for "full". Ignored when `padding_mask_only`.
        padding_mask_only: the layer takes the (B, S) boolean padding mask itself, never a built mask.
        sparse_kernel: (parameter, query, key, value, *, causal, padding_mask, scaling, dropout) -> (B, T, H, D),
            run under sdpa when nothing but padding constrains the keys; None where there is none.
        causal: whether the type may sit in a causal stack.
        transformers_window: the `sliding_window` passed to attention functions, in transformers' convention (the
            window counts the query itself, as Mistral/Qwen2 pass it), from the parameter; None if not a window.
        rope_theta_field: the config field holding the rotary base of this type's layers (`None` there falls back
            to `rope_theta`): sliding layers read `local_rope_theta`, as ModernBERT's local layers have their own.
    """

    cache_layer: str
    saved_name: str
    parameter: str | None = None
    overlay: Callable[[int], MaskFunction] | None = None
    padding_mask_only: bool = False
    sparse_kernel: Callable[..., torch.Tensor] | None = None
    causal: bool = True
    transformers_window: Callable[[int], int] | None = None
    rope_theta_field: str = "rope_theta"


LAYER_TYPES: dict[str, LayerType] = {
    "full": LayerType("full_attention", "full_attention"),
    "sliding": LayerType(
        "sliding_attention",
        "sliding_attention",
        parameter="sliding_window",
        overlay=sliding_window_overlay,
        sparse_kernel=sliding_kernel,
        transformers_window=lambda window: window + 1,
        rope_theta_field="local_rope_theta",
    ),
    # Every key may be needed later: the stride pattern reaches back indefinitely, so the cache keeps them all.
    "strided": LayerType(
        "full_attention", "full_attention", parameter="stride", overlay=strided_overlay, sparse_kernel=strided_kernel
    ),
    # Linformer's projection mixes all positions along the sequence: bidirectional only, never cached.
    "lowrank": LayerType(
        "full_attention", "full_attention", parameter="lowrank_k", padding_mask_only=True, causal=False
    ),
    "linear": LayerType(LINEAR_CACHE_LAYER, "linear_attention", padding_mask_only=True),
}
