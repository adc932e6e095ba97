"""THE table of attention layer types (`config.layer_types`): one entry per type, so a new type is one entry.

    type      mask the stack builds                kernel (file)                            transformers' cache layer
    full      causal / bidirectional               -                                        full_attention (served)
    sliding   ... AND |q - k| <= sliding_window    band, O(L·w) (sparse_attention)          sliding_attention (served)
    strided   ... AND (|q - k| < s or s | q - k)   A1 + A2 parts (sparse_attention)         full_attention
    lowrank   (B, S) padding mask                  Linformer E/F (lowrank_attention)        full_attention, never cached
    linear    (B, S) padding mask                  feature maps, O(L) (linear_attention)    coreformer_linear_attention
    lsh       (B, S) padding mask                  hash, sort, chunks (lsh_attention)       full_attention
    block     ... AND q // b == k // b             blocks of b, O(L·b) (block_attention)    full_attention
    differential  causal / bidirectional           2 maps - λ (differential_attention)      full_attention
    sigmoid   causal / bidirectional, eager form   sigmoid(s - log n) (sigmoid_attention)   full_attention
    mla       causal / bidirectional               latents expanded (latent_attention)      full_attention, the latent
    gated_deltanet  (B, S) padding mask, causal only  delta rule, O(L) (gated_deltanet)       linear_attention (its own)

This file is free of torch: the configuration reads it (names, parameters, cache layers, validation) without loading
a kernel. Each kernel is named by a loader that imports its file on first use (`Attention.__init__`), so a new layer
type is its kernel file (a `layer_kernel.LayerKernel`) plus one entry here. Per forward the stack's plan
(`forward_plan.py`) builds each type's mask from this table and decides whether each kernel runs; `Attention` calls
the kernel's hooks. "Served" types are those transformers' own layer types compute exactly, which engines that build
attention from the layer type alone (continuous batching, vLLM) may run; `check_served` refuses the others by name.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .compat import INDEXED_ATTENTION
from .layer_kernel import LayerKernel

# transformers' mask functions: (batch, head, query position, key position) tensors -> whether the key is visible.
MaskFunction = Callable[[Any, Any, Any, Any], Any]


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


# Kernel loaders: config -> the type's kernel, importing its file only here (the config never calls them).
def sliding_kernel(config: Any) -> LayerKernel:
    from .sparse_attention import SparseKernel, sliding_window_attention

    return SparseKernel(sliding_window_attention, window=config.sliding_window)


def strided_kernel(config: Any) -> LayerKernel:
    from .sparse_attention import SparseKernel, strided_attention

    return SparseKernel(strided_attention, stride=config.stride)


def lowrank_kernel(config: Any) -> LayerKernel:
    from .lowrank_attention import LowRankKernel

    return LowRankKernel()


def linear_kernel(config: Any) -> LayerKernel:
    from .linear_attention import LinearKernel

    return LinearKernel()


def block_overlay(block_size: int) -> MaskFunction:
    """Block-diagonal mask: a query sees the keys of its own block of `block_size` positions (ANDed with causality
    in decoders). Not a band: the first token of a block sees only itself, the last sees the whole block."""

    def allowed(batch_idx, head_idx, q_idx, kv_idx):
        return q_idx // block_size == kv_idx // block_size

    return allowed


def block_document_overlay(block_size: int, documents: Any) -> MaskFunction:
    """The block mask on packed rows: blocks restart at each document's first token (`document_blocks`), and a
    query sees the keys of its own block, which are of its own document. `documents`: the (B, T) document ids."""
    from .block_attention import document_blocks

    blocks = document_blocks(documents, block_size)

    def allowed(batch_idx, head_idx, q_idx, kv_idx):
        return blocks[batch_idx, q_idx] == blocks[batch_idx, kv_idx]

    return allowed


def block_kernel(config: Any) -> LayerKernel:
    from .block_attention import block_attention
    from .sparse_attention import SparseKernel

    return SparseKernel(block_attention, block_size=config.block_size)


def lsh_kernel(config: Any) -> LayerKernel:
    from .lsh_attention import LshKernel

    return LshKernel()


def check_lsh(config: Any) -> None:
    for name in ("lsh_num_hashes", "lsh_num_buckets"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    if config.lsh_num_buckets % 2:
        raise ValueError(
            f"`lsh_num_buckets` must be even (angular LSH hashes to the argmax over [xR, -xR]), got "
            f"{config.lsh_num_buckets}."
        )
    if not isinstance(config.lsh_hash_seed, int) or config.lsh_hash_seed < 0:
        raise ValueError(f"`lsh_hash_seed` must be a non-negative integer, got {config.lsh_hash_seed!r}.")
    # The shared projection's output is what is hashed: a gate in its rows or a norm after it would change that.
    for option, value, off in (("attention_gate", config.attention_gate, None), ("qk_norm", config.qk_norm, False)):
        if value:
            raise ValueError(
                f"'lsh' layers hash what their shared query-key projection computes, which `{option}` would change: "
                f"set {option}={off}, or use another layer type."
            )
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(
            f"'lsh' layers share one projection for queries and keys, so each query head is its own key head: set "
            f"`num_key_value_heads` ({config.num_key_value_heads}) to `num_attention_heads` "
            f"({config.num_attention_heads}), or use another layer type for grouped-query attention."
        )


def differential_kernel(config: Any) -> LayerKernel:
    from .differential_attention import DifferentialKernel

    return DifferentialKernel()


def check_differential(config: Any) -> None:
    if config.num_key_value_heads % 2:
        raise ValueError(
            f"'differential' layers pair the first half of the key/value heads with the second (as DiffLlama), so "
            f"`num_key_value_heads` must be even, got {config.num_key_value_heads}: set it to an even number (it "
            f"divides `num_attention_heads`)."
        )
    if config.lambda_std_dev < 0:
        raise ValueError(f"`lambda_std_dev` must be >= 0, got {config.lambda_std_dev}.")


def sigmoid_kernel(config: Any) -> LayerKernel:
    from .sigmoid_attention import SigmoidKernel

    return SigmoidKernel()


def check_sigmoid(config: Any) -> None:
    length = config.sigmoid_length
    if length is not None and (not isinstance(length, int) or length < 1):
        raise ValueError(
            f"`sigmoid_length` (n of 'sigmoid' layers' bias -log n) must be a positive integer or None "
            f"(max_position_embeddings), got {length!r}."
        )


def mla_kernel(config: Any) -> LayerKernel:
    from .latent_attention import LatentKernel

    return LatentKernel()


def check_mla(config: Any) -> None:
    for name in ("q_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}` of 'mla' layers must be a positive integer or None, got {value!r}.")
    # The latents replace the core's projections: the options computed on those do not apply.
    for option, value, off in (("attention_gate", config.attention_gate, None), ("qk_norm", config.qk_norm, False)):
        if value:
            raise ValueError(
                f"'mla' layers project queries and keys through their latents, where `{option}` has no place: set "
                f"{option}={off}, or use another layer type."
            )
    if config.head_dim is not None and config.head_dim % 2:
        raise ValueError(
            f"'mla' layers rotate `head_dim` ({config.head_dim}) channels of each query and key (DeepSeek-V3's "
            f"qk_rope_head_dim): it must be even."
        )


def gated_deltanet_kernel(config: Any) -> LayerKernel:
    from .gated_deltanet import GatedDeltaNetKernel

    return GatedDeltaNetKernel()


def check_gated_deltanet(config: Any) -> None:
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}` of 'gated_deltanet' layers must be a positive integer or None, got {value!r}.")
    kernel = config.linear_conv_kernel_dim
    if not isinstance(kernel, int) or kernel < 1:
        raise ValueError(f"`linear_conv_kernel_dim` must be a positive integer, got {kernel!r}.")
    sizes = config.gated_deltanet_sizes()
    key_heads, value_heads = sizes["key_heads"], sizes["value_heads"]
    if value_heads % key_heads:
        raise ValueError(
            f"'gated_deltanet' layers give each query/key head the same number of value heads, as Qwen3-Next does: "
            f"`linear_num_value_heads` ({value_heads}) must be a multiple of `linear_num_key_heads` ({key_heads})."
        )
    for name in config.stack_layer_types():
        types = getattr(config, name) or []
        if types and all(layer_type == "gated_deltanet" for layer_type in types):
            raise ValueError(
                f"`{name}` has only 'gated_deltanet' layers, whose cache layer (transformers' 'linear_attention') "
                f"counts no tokens, so a cache would not know how long the sequence is: make at least one layer an "
                f"attention layer (Qwen3-Next: every fourth 'full')."
            )


def check_stride(config: Any) -> None:
    if config.stride < 2:
        raise ValueError(f"`stride` must be >= 2 (1 would be full attention), got {config.stride}.")


def check_lowrank_k(config: Any) -> None:
    if config.lowrank_k > config.max_position_embeddings:
        raise ValueError(
            f"`lowrank_k` ({config.lowrank_k}) projects sequences of up to max_position_embeddings "
            f"({config.max_position_embeddings}) tokens: it must not exceed that length."
        )


@dataclass(frozen=True)
class LayerType:
    """One attention layer type.

    Attributes:
        cache_layer: the layer type transformers' caches build for it (`get_text_config` translates to these).
        saved_name: how config.json spells it for transformers' generic config (which validates the names).
        parameter: the config field the type needs (a positive integer), or None.
        parameter_announces_type: serving engines read the parameter, when set, as the model holding layers of this
            type (vLLM's Transformers backend takes a `kv_lora_rank` for an MLA cache), so a config keeps it only
            where a layer of the type exists.
        overlay: builds the mask function ANDed into transformers' causal/bidirectional mask from that parameter;
            None for "full". Ignored when `padding_mask_only`.
        document_overlay: for a pattern laid out from the start of the sequence (blocks), the overlay of packed rows
            from the parameter and the (B, T) document ids, keeping each document's own layout and its keys alone;
            None where the pattern depends on q - k only (the plan ANDs "same document" into `overlay`).
        padding_mask_only: the layer takes the (B, S) boolean padding mask itself, never a built mask.
        eager_mask: the layer's kernel reads the mask in eager's dense form (float, additive) under every backend.
        kernel: config -> the type's `LayerKernel` (imported on first call); None where the mask says everything.
        dense_fallback: the kernel computes exactly what the mask computes (a sparse form of it), so the plan runs it
            only where it applies (sdpa, nothing cached) and the masked backend otherwise; without
            it the kernel runs on every call.
        not_causal: why the type cannot sit in a causal stack, or None where it can.
        not_bidirectional: why the type cannot sit in a bidirectional stack (an encoder's), or None where it can.
        packed_rows: whether the type keeps the documents of a packed row apart (`forward_plan.LayerPlan.documents`);
            a stack refuses such rows for a type that cannot.
        max_length_field: the config field bounding the input length the type accepts, or None.
        validate: further checks of the config, run where the type is used.
        transformers_window: the `sliding_window` passed to attention functions, in transformers' convention (the
            window counts the query itself, as Mistral/Qwen2 pass it), from the parameter; None if not a window.
        rope_theta_field: the config field holding the rotary base of this type's layers (`None` there falls back
            to `rope_theta`): sliding layers read `local_rope_theta`, as ModernBERT's local layers have their own.
        stateful: the cache layer holds a recurrent state that cannot take tokens back, so a model with such layers is
            stateful in transformers' sense (`_is_stateful`: no assisted decoding).
        served_as: the transformers layer type that computes exactly what this type computes in a causal stack, so
            that engines building each layer's attention from `get_text_config().layer_types` alone (continuous
            batching, vLLM) run it right; None where none does, and such engines are refused by name.
    """

    cache_layer: str
    saved_name: str
    parameter: str | None = None
    parameter_announces_type: bool = False
    overlay: Callable[[int], MaskFunction] | None = None
    document_overlay: Callable[[int, Any], MaskFunction] | None = None
    padding_mask_only: bool = False
    eager_mask: bool = False
    kernel: Callable[[Any], LayerKernel] | None = None
    dense_fallback: bool = False
    not_causal: str | None = None
    not_bidirectional: str | None = None
    packed_rows: bool = True
    max_length_field: str | None = None
    validate: Callable[[Any], None] | None = None
    transformers_window: Callable[[int], int] | None = None
    rope_theta_field: str = "rope_theta"
    stateful: bool = False
    served_as: str | None = None


LAYER_TYPES: dict[str, LayerType] = {
    "full": LayerType("full_attention", "full_attention", served_as="full_attention"),
    "sliding": LayerType(
        "sliding_attention",
        "sliding_attention",
        parameter="sliding_window",
        overlay=sliding_window_overlay,
        kernel=sliding_kernel,
        dense_fallback=True,
        transformers_window=lambda window: window + 1,
        rope_theta_field="local_rope_theta",
        served_as="sliding_attention",
    ),
    # Every key may be needed later: the stride pattern reaches back indefinitely, so the cache keeps them all.
    "strided": LayerType(
        "full_attention",
        "full_attention",
        parameter="stride",
        overlay=strided_overlay,
        kernel=strided_kernel,
        dense_fallback=True,
        validate=check_stride,
    ),
    # Linformer's E/F have one column per position up to max_position_embeddings, and mix all positions: never
    # cached, and not for packed rows (documents would mix).
    "lowrank": LayerType(
        "full_attention",
        "full_attention",
        parameter="lowrank_k",
        padding_mask_only=True,
        kernel=lowrank_kernel,
        not_causal="its projection mixes all positions along the sequence, so every output would see future tokens",
        packed_rows=False,
        max_length_field="max_position_embeddings",
        validate=check_lowrank_k,
    ),
    # The cache layer is registered with transformers' caches by linear_attention.py (`LINEAR_CACHE_LAYER`).
    "linear": LayerType(
        "coreformer_linear_attention",
        "linear_attention",
        padding_mask_only=True,
        kernel=linear_kernel,
    ),
    # Reformer (Kitaev et al. 2020): queries hashed into buckets, each attending to the nearest keys of its bucket.
    # It keeps every key (a bucket reaches back indefinitely); packed documents are sorted apart (by document, then
    # bucket). Saved under transformers' name for attention whose keys an index picks per query, in the spelling
    # every supported release accepts (`compat.INDEXED_ATTENTION`).
    "lsh": LayerType(
        "full_attention",
        INDEXED_ATTENTION,
        parameter="lsh_bucket_size",
        padding_mask_only=True,
        kernel=lsh_kernel,
        validate=check_lsh,
    ),
    # Non-overlapping windows, transformers' "window_attention" (ViT-style); every key is cached, as for strided.
    "block": LayerType(
        "full_attention",
        "window_attention",
        parameter="block_size",
        overlay=block_overlay,
        document_overlay=block_document_overlay,  # blocks restart at each document of a packed row
        kernel=block_kernel,
        dense_fallback=True,
    ),
    # Differential attention (Ye et al. 2024), as transformers' DiffLlama: the backend's softmaxes over the usual
    # mask, two query heads per differential head; the cache holds the plain keys and values.
    "differential": LayerType(
        "full_attention",
        "full_attention",
        kernel=differential_kernel,
        validate=check_differential,
    ),
    # Sigmoid attention (Ramapuram et al. 2024): no softmax for a backend to run, so its kernel computes the dense
    # scores under every backend, over the mask in eager's form (causality, padding, documents, a static cache's
    # empty slots); its bias is a constant, so every key is weighted alone and caches and packing are exact.
    "sigmoid": LayerType(
        "full_attention",
        "full_attention",
        eager_mask=True,
        kernel=sigmoid_kernel,
        validate=check_sigmoid,
    ),
    # Multi-head latent attention (DeepSeek-V2/V3): its kernel computes queries and latents from the layer input, the
    # core caches the latents (as transformers' DeepseekV3Attention does) and the backend attends to what they expand
    # to, over the usual mask.
    "mla": LayerType(
        "full_attention",
        "full_attention",
        parameter="kv_lora_rank",
        parameter_announces_type=True,
        kernel=mla_kernel,
        validate=check_mla,
    ),
    # Gated DeltaNet (Yang et al. 2025), as Qwen3-Next's linear layers: a recurrence over the tokens in order, so no
    # mask and no backend; its two states live in transformers' own "linear_attention" cache layer, which generate(),
    # DynamicCache and StaticCache build from the layer type alone.
    "gated_deltanet": LayerType(
        "linear_attention",
        "linear_attention",
        padding_mask_only=True,
        kernel=gated_deltanet_kernel,
        not_bidirectional="its recurrence and short convolution read the tokens in order, so a token never sees "
        "the ones after it",
        validate=check_gated_deltanet,
        stateful=True,
    ),
}


def check_served(layer_types: list[str], engine: str, instead: str) -> None:
    """Refuse, before any work, a stack that `engine` would run wrongly: it builds each layer's attention from
    transformers' layer type alone, which computes exactly only the types with a `served_as`. `instead`: what serves
    such a model (a sentence ending the message)."""
    unserved: dict[str, list[int]] = {}
    for index, name in enumerate(layer_types):
        if LAYER_TYPES[name].served_as is None:
            unserved.setdefault(name, []).append(index)
    if unserved:
        exact = " and ".join(repr(name) for name, layer_type in LAYER_TYPES.items() if layer_type.served_as)
        found = "; ".join(
            f"{name!r} ({'layer' if len(indices) == 1 else 'layers'} {', '.join(map(str, indices))})"
            for name, indices in unserved.items()
        )
        raise ValueError(
            f"{engine} runs only {exact} layers exactly (it builds each layer from transformers' layer type), but "
            f"this model has {found}: {instead}"
        )
