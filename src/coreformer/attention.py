"""THE attention core: one `Attention` class for every use in every family.

    use                      is_causal  keys/values from   mask built by                cache
    encoder self-attention   False      hidden_states      create_bidirectional_mask    none
    decoder self-attention   True       hidden_states      create_causal_mask           DynamicCache / StaticCache
    cross-attention          False      encoder output     create_bidirectional_mask    EncoderDecoderCache, once

The family is chosen by `is_causal` and by where keys/values come from, never by a subclass. The score computation
is dispatched through transformers' `ALL_ATTENTION_FUNCTIONS` (sdpa, flex_attention, flash_attention_2, ...) with
`eager_attention_forward` below as the reference that also returns the attention probabilities.

Each layer also has a type (`config.layer_types`, the table in `layer_types.py`). Some types differ only in the mask
the stack builds for them; a type that computes more has a kernel (`layer_kernel.LayerKernel`) that this core calls
at fixed points: extra weights at construction, the whole layer for a token mixer that attends over no keys (Gated
DeltaNet), keys/values projected before the scores, the scores themselves instead of the backend, its own
probabilities, the heads combined after the scores (differential attention).
Whether a kernel runs is decided once per forward by the stack's plan (`forward_plan.LayerPlan.kernel`): sparse
kernels that compute what their mask computes run under sdpa without a cache, the others on every call.

Three options of every layer sit around the score computation (config fields, all off by default):

    qk_norm          RMSNorm over each query and key head before the rotary angles   Qwen3, Qwen3-Next
    attention_gate   output * sigmoid(gate) before o_proj, gate projected by q_proj  Qiu et al. 2025, Qwen3-Next
    attention_sinks  a learned logit per head joins the softmax, with no value      GPT-OSS

QK-norm and the gate are outside the attention call, so every backend (and vLLM's replacement for it) computes them.
A sink joins the softmax itself: `eager_attention_forward` adds its column to the scores, as GPT-OSS's eager does;
sdpa and flex_attention, which have no sink, attend to one more key instead (`sink_column`).
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .compat import paged_keys_values
from .configuration_coreformer import CoreformerConfig
from .forward_plan import LayerPlan, Unpadding
from .layer_types import LAYER_TYPES
from .linear_attention import LinearAttentionStateLayer


def repeat_kv(states: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Repeat each key/value head for the query heads of its group: (B, H_kv, S, D) -> (B, H_kv * groups, S, D)."""
    if num_groups == 1:
        return states
    batch, kv_heads, length, head_dim = states.shape
    states = states[:, :, None].expand(batch, kv_heads, num_groups, length, head_dim)  # (B, H_kv, G, S, D)
    return states.reshape(batch, kv_heads * num_groups, length, head_dim)


def eager_attention_forward(
    module: "Attention",
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scaling + mask) V, written out so the probabilities can be returned.

    Args:
        query: (B, H, T, D); key, value: (B, H_kv, S, D).
        attention_mask: additive float mask broadcastable to (B, H, T, S), or a boolean mask (True = attend).

    Returns:
        output (B, T, H, D) and probabilities (B, H, T, S).
    """
    key = repeat_kv(key, module.num_key_value_groups)
    probs = softmax_probabilities(query, key, attention_mask, scaling, getattr(module, "sinks", None))
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    value = repeat_kv(value, module.num_key_value_groups)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, T, H, D)
    return output, probs


def softmax_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(Q Kᵀ · scaling + mask): (B, H, T, D) queries, (B, H, S, D) keys -> (B, H, T, S) in the query's dtype.
    The mask is additive (float) or boolean (True = attend), broadcastable to (B, H, T, S). `sinks`: (H,) logits
    joining each row's softmax with no value (GPT-OSS's eager: their column is dropped, so a row sums to <= 1)."""
    # Scores and softmax in fp32 whatever the compute dtype: a bf16 score near 1e3 is only known to ±4, enough to
    # reorder a peaked softmax, and bf16 exponentials lose the small probabilities.
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    if sinks is not None:
        sink_logits = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, T, 1)
        probs = nn.functional.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)
        return probs[..., :-1].to(query.dtype)  # the sink's column dropped: (B, H, T, S)
    return nn.functional.softmax(scores, dim=-1).to(query.dtype)


def sink_column(
    module: "Attention",
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Any,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor, Any, dict]:
    """GPT-OSS's attention sinks for a backend that has none: one more key, zero, with a zero value, whose score is
    the head's sink logit. The softmax over the S + 1 scores is GPT-OSS's softmax(cat([scores, sinks])), and the zero
    value drops the sink's share from the output, as GPT-OSS drops its column:

        keys    k_0  ...  k_{S-1}  | 0
        values  v_0  ...  v_{S-1}  | 0
        score   q·k_j · scaling + mask_j  | sink_h    sdpa: the sink is the extra column of the additive mask;
                                                      flex: a score bias there (score_mod cannot add a column)

    (B, H, T, D) queries, (B, H_kv, S, D) keys/values, the backend's mask and the attention kwargs -> those with the
    sink's column. Eager reads `module.sinks` itself; any other backend is refused by name (flash attention's
    `s_aux` sinks need kernels this core does not dispatch to).

    Why a column rather than eager for sink layers: the backend still runs fused, and the one tensor added is sdpa's
    per-head mask, (B, H, T, S + 1), the size of eager's scores alone (eager also holds the probabilities).
    transformers' own flex path renormalises by the log-sum-exp instead (`s_aux`), which it refuses on CPU.
    """
    implementation = module.config._attn_implementation
    if implementation == "eager":
        return key, value, mask, kwargs
    if implementation not in ("sdpa", "flex_attention"):
        raise ValueError(
            f"this model has attention_sinks=True, a logit joining each softmax, which the {implementation!r} "
            f"attention function does not add: use attn_implementation='sdpa', 'flex_attention' or 'eager'."
        )
    keys = key.shape[2]
    key = torch.cat([key, key.new_zeros(*key.shape[:2], 1, key.shape[3])], dim=2)  # (B, H_kv, S + 1, D)
    value = torch.cat([value, value.new_zeros(*value.shape[:2], 1, value.shape[3])], dim=2)
    if implementation == "flex_attention" and mask is not None and not isinstance(mask, torch.Tensor):
        # A BlockMask: the same visible keys and the sink's column, scored by transformers' `position_bias` hook.
        batch, heads, length = query.shape[:3]
        sink_bias = torch.cat([module.sinks.new_zeros(1, heads, 1, keys), module.sinks.view(1, heads, 1, 1)], -1)
        kwargs = {**kwargs, "position_bias": sink_bias.to(query.dtype).expand(batch, heads, length, keys + 1)}
        return key, value, sink_block_mask(mask, query, keys), kwargs
    mask = additive_sink_mask(mask, module.sinks, query, keys, causal=module.is_causal and implementation == "sdpa")
    if implementation == "flex_attention":  # a dense mask reaches flex's scores per head only as a score bias
        return key, value, None, {**kwargs, "position_bias": mask}
    return key, value, mask, kwargs


def additive_sink_mask(
    mask: torch.Tensor | None, sinks: torch.Tensor, query: torch.Tensor, keys: int, *, causal: bool
) -> torch.Tensor:
    """The backend's mask over S keys (None, boolean with True = attend, or additive; broadcastable to (B, H, T, S))
    -> the additive (B, H, T, S + 1) mask whose last column is each head's sink logit, in the query's dtype. `causal`:
    what a None mask stands for under sdpa (transformers' `is_causal` path: causal from the first key when T > 1)."""
    batch, heads, length = query.shape[:3]
    dtype = query.dtype
    if mask is None:
        mask = torch.ones(length, keys, dtype=torch.bool, device=query.device)
        if causal and length > 1:  # sdpa's is_causal aligns the diagonal at the first key (a static cache's prefill)
            mask = mask.tril()
        mask = mask[None, None]  # (1, 1, T, S)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    mask = mask.to(dtype).expand(max(batch, mask.shape[0]), heads, length, keys)
    sink = sinks.to(dtype).view(1, heads, 1, 1).expand(mask.shape[0], heads, length, 1)
    return torch.cat([mask, sink], dim=-1)  # (B, H, T, S + 1)


def sink_block_mask(block_mask: Any, query: torch.Tensor, keys: int) -> Any:
    """flex_attention's BlockMask over S keys -> the same over S + 1 keys, the last (the sink's) visible to every
    query. Built again from its mask function, once per layer call."""
    from torch.nn.attention.flex_attention import create_block_mask

    visible = block_mask.mask_mod

    def with_sink(batch_idx, head_idx, q_idx, kv_idx):
        # The mask function may index per-key tensors (padding): ask it about a real key only.
        return (kv_idx == keys) | visible(batch_idx, head_idx, q_idx, kv_idx.clamp(max=keys - 1))

    batch, heads = block_mask.shape[:2]
    return create_block_mask(
        with_sink, batch, heads, query.shape[2], keys + 1, device=query.device, BLOCK_SIZE=block_mask.BLOCK_SIZE
    )


def self_attention_cache(past_key_values: Cache | None) -> Cache | None:
    """The cache self-attention reads and writes: the self-attention side of an EncoderDecoderCache."""
    if isinstance(past_key_values, EncoderDecoderCache):
        return past_key_values.self_attention_cache
    return past_key_values


def heads_first(states: torch.Tensor, unpadding: Unpadding | None = None) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, T, D); unpadded (N, H, D) states are padded first."""
    if unpadding is not None:
        states = unpadding.pad(states)  # (N, H, D) -> (B, L, H, D)
    return states.transpose(1, 2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021, eq. 34). query/key: (B, H, T, D); cos/sin: (B, T, R), R ≤ D: with
    `partial_rotary_factor` the first R channels of each head rotate and the rest pass unchanged (Qwen3-Next,
    GPT-NeoX)."""
    rotated = cos.shape[-1]
    if rotated < query.shape[-1]:
        (query, query_pass), (key, key_pass) = (x.split((rotated, x.shape[-1] - rotated), dim=-1) for x in (query, key))
        query, key = apply_rotary(query, key, cos, sin)
        return torch.cat([query, query_pass], dim=-1), torch.cat([key, key_pass], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D), broadcast over heads
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


class Attention(nn.Module):
    """Multi-head (optionally grouped-query) scaled dot-product attention.

    self-attention:  attn(x, attention_mask=m)
    cross-attention: attn(x, key_value_states=encoder_out, attention_mask=m)
    """

    def __init__(
        self,
        config: CoreformerConfig,
        layer_idx: int,
        *,
        is_causal: bool,
        is_cross_attention: bool = False,
        layer_type: str = "full",
    ):
        super().__init__()
        if is_causal and is_cross_attention:
            raise ValueError("cross-attention sees the whole encoder output: it cannot be causal")
        if is_cross_attention and layer_type != "full":
            raise ValueError("cross-attention is always full attention over the encoder output")
        self.config = config
        self.layer_idx = layer_idx
        # transformers' sdpa/flash paths read `module.is_causal`: an encoder left at True would silently turn causal.
        self.is_causal = is_causal
        self.is_cross_attention = is_cross_attention
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout

        bias = config.attention_bias
        # Gated attention (Qiu et al. 2025): q_proj also projects each head's gate, laid out as Qwen3-Next's, per head
        # its head_dim query rows then its gate rows (head_dim "elementwise", 1 "headwise").
        self.gate_width = {None: 0, "elementwise": self.head_dim, "headwise": 1}[config.attention_gate]
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * (self.head_dim + self.gate_width), bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        # QK-norm (Qwen3's q_norm / k_norm): RMSNorm over each head's channels, before the rotary angles.
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.layer_norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.layer_norm_eps) if config.qk_norm else None
        # GPT-OSS's attention sinks: a learned logit per query head in each softmax (`sink_column`). An attribute only
        # when on: transformers' attention functions (paged eager) add `module.sinks` wherever the attribute exists.
        self.has_sinks = config.attention_sinks
        if self.has_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads))

        self.layer_type = layer_type
        kind = LAYER_TYPES[layer_type]
        # Passed to every attention function as in-library sliding models (Mistral, Qwen2) pass it: the window in
        # transformers' convention (the query counted in), None for every other layer (and cross-attention).
        self.sliding_window = (
            kind.transformers_window(getattr(config, kind.parameter)) if kind.transformers_window else None
        )
        # What the type computes beyond its mask (`layer_kernel.py`); it runs where the forward plan says.
        self.kernel = kind.kernel(config) if kind.kernel else None
        if self.kernel is not None:
            self.kernel.build(self)

    def _split_heads(
        self, states: torch.Tensor, projection: nn.Linear, unpadding: Unpadding | None = None
    ) -> torch.Tensor:
        """(B, T, hidden) -> (B, heads, T, head_dim); unpadded (N, hidden) states are projected, then padded."""
        projected = projection(states)
        # Heads from the projected width, not from the module: under tensor parallelism a colwise-sharded projection
        # keeps its full `out_features` but returns this rank's heads only. Explicit so that empty batches reshape too.
        heads = projected.shape[-1] // self.head_dim
        return heads_first(projected.view(*projected.shape[:-1], heads, self.head_dim), unpadding)

    def _queries(
        self, hidden_states: torch.Tensor, unpadding: Unpadding | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, hidden) (or unpadded (N, hidden)) -> queries (B, H, T, D) and, with `attention_gate`, the gate
        logits in the layout of the input's tokens, (B, T, H, G) (or (N, H, G)), for `_gated`; else None."""
        if not self.gate_width:
            return self._split_heads(hidden_states, self.q_proj, unpadding), None
        projected = self.q_proj(hidden_states)
        heads = projected.shape[-1] // (self.head_dim + self.gate_width)  # this rank's heads, as in `_split_heads`
        # Qwen3-Next: torch.chunk(q_proj(x).view(..., H, 2 * D), 2, dim=-1); headwise: a width of D + 1.
        per_head = projected.view(*projected.shape[:-1], heads, self.head_dim + self.gate_width)  # (..., H, D + G)
        query, gate = per_head.split((self.head_dim, self.gate_width), dim=-1)  # (..., H, D), (..., H, G)
        return heads_first(query, unpadding), gate

    def _gated(self, output: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Gated attention (Qiu et al. 2025, Qwen3-Next): (..., H*D) heads' outputs * sigmoid(gate) (..., H, G)."""
        if gate is None:
            return output
        heads = output.unflatten(-1, (-1, self.head_dim))  # (..., H*D) -> (..., H, D)
        return (heads * torch.sigmoid(gate)).flatten(-2)  # G = D: per channel, G = 1: per head

    def _keys_values(
        self, source: torch.Tensor | None, past_key_values: Cache | None, unpadding: Unpadding | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Cache | None]:
        """Project keys/values from `source`, or reuse them from a cross-attention cache that already holds them."""
        cache = past_key_values
        if self.is_cross_attention:
            # Only an EncoderDecoderCache has room for cross-attention; with any other cache, recompute each step.
            is_encoder_decoder_cache = isinstance(past_key_values, EncoderDecoderCache)
            cache = past_key_values.cross_attention_cache if is_encoder_decoder_cache else None
            layer = cache.layers[self.layer_idx] if cache is not None and len(cache.layers) > self.layer_idx else None
            if getattr(layer, "is_sliding", False) or isinstance(layer, LinearAttentionStateLayer):
                raise ValueError(
                    "The cross-attention cache must keep every encoder key, but this one is laid out like the "
                    "decoder's sliding/linear layers. Pass EncoderDecoderCache(DynamicCache(config=...), "
                    "DynamicCache())."
                )
            if cache is not None and past_key_values.is_updated.get(self.layer_idx):
                # The encoder output does not change while decoding: its keys/values were computed on step one.
                layer = cache.layers[self.layer_idx]
                return layer.keys, layer.values, None
        else:
            cache = self_attention_cache(past_key_values)
        if source is None:
            raise ValueError("cross-attention needs `key_value_states` (the encoder output) on its first call")
        # No key projection (a kernel's `build` removed it, "lsh"): queries and keys are shared, set by `forward`.
        key = self._split_heads(source, self.k_proj, unpadding) if self.k_proj is not None else None
        if self.k_norm is not None and key is not None:  # before the cache, which keeps cross-attention's keys
            key = self.k_norm(key)
        return key, self._split_heads(source, self.v_proj, unpadding), cache

    def forward(
        self,
        hidden_states: torch.Tensor,
        plan: LayerPlan | None = None,
        key_value_states: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states: (B, T, hidden) queries (and keys/values for self-attention), or the (N, hidden) real
                tokens of a padded batch when `plan.unpadding` is set; the output then has the same layout.
            plan: what the stack decided for this layer in this forward (`forward_plan.LayerPlan`): the mask, whether
                the type's kernel runs, the rotary (cos, sin) (self-attention only), whether to return the
                probabilities and their eager-form mask. Default: no mask, no kernel, no positions.
            key_value_states: (B, S, hidden) encoder output for cross-attention.
            past_key_values: a `Cache` (an `EncoderDecoderCache` in seq2seq decoders) updated in place.
            **kwargs: passed on to the attention function (transformers' attention kwargs).

        Returns:
            output (B, T, hidden) and the attention probabilities (B, H, T, S) (S = k for Linformer's projected rows)
            when `plan.output_attentions`, or whenever the backend returns them (eager); else None. Where the code
            that ran does not produce them (sdpa, flex, a kernel, a registered function), they are recomputed beside
            it from the same queries and keys, before attention dropout.
        """
        plan = LayerPlan() if plan is None else plan
        if plan.kernel and self.kernel is not None:
            mixed = self.kernel.mix(self, hidden_states, plan, self_attention_cache(past_key_values))
            if mixed is not None:  # a token mixer that attends over no keys: no map to return
                return mixed, None
        query, gate, key, value, cache = self._projections(hidden_states, key_value_states, past_key_values, plan)
        output, key, value, mask = self._cached_or_computed(query, key, value, plan, past_key_values, cache, kwargs)
        weights = None
        if output is None:
            # The backend call sits in `forward` itself, as in transformers' own models: vLLM's Transformers backend
            # finds each layer's attention by reading this method's source for one call of a function looked up in
            # ALL_ATTENTION_FUNCTIONS, and replaces it with its own paged attention (`vllm_serving.py`).
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            if plan.attention_kwargs:  # position ids and varlen arguments, as Llama passes them (cross: varlen only)
                kwargs = {**plan.attention_kwargs, **kwargs}
            attended_key, attended_value = key, value
            if self.has_sinks:  # not cached: the backend attends to one more key (eager: none)
                attended_key, attended_value, mask, kwargs = sink_column(self, query, key, value, mask, kwargs)
            output, weights = attention_interface(
                self,
                query,
                attended_key,
                attended_value,
                mask,
                dropout=self.attention_dropout if self.training else 0.0,
                scaling=self.scaling,
                sliding_window=self.sliding_window,
                **kwargs,
            )
        if plan.kernel and self.kernel is not None:  # differential attention: the two maps' outputs subtracted
            output = self.kernel.combine(self, output)
        if plan.output_attentions and weights is None:
            weights = self._probabilities(query, key, plan)
        if plan.unpadding is not None:
            output = plan.unpadding.unpad(output)  # (B, T, H, D) -> (N, H, D)
        if output.dim() > hidden_states.dim():
            output = output.flatten(-2)  # (..., H, D) -> (..., H*D)
        else:  # vLLM's attention function returns its flattened row's heads joined: (T, H*D) -> (1, T, H*D)
            output = output.view(*hidden_states.shape[:-1], -1)
        return self.o_proj(self._gated(output, gate)), weights

    def _projections(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None,
        past_key_values: Cache | None,
        plan: LayerPlan,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, Cache | None]:
        """The layer input -> (B, H, T, D) queries with their rotary angles, the gate logits (or None), the
        (B, H_kv, S, D) keys and values to cache, and the cache layer's owner for this attention (the self- or
        cross-attention side of an EncoderDecoderCache). A kernel may compute the queries and what the cache holds
        itself (`LayerKernel.inputs`: multi-head latent attention's latents)."""
        if plan.kernel and self.kernel is not None:
            inputs = self.kernel.inputs(self, hidden_states, plan, apply_rotary)
            if inputs is not None:
                query, key, value = inputs
                return query, None, key, value, self_attention_cache(past_key_values)
        query, gate = self._queries(hidden_states, plan.unpadding)  # (B, H, T, D), gate logits or None
        if self.q_norm is not None:
            query = self.q_norm(query)
        source = key_value_states if self.is_cross_attention else hidden_states
        # Cross-attention keys come from the (padded) encoder output, whatever the queries' layout.
        key, value, cache = self._keys_values(
            source, past_key_values, None if self.is_cross_attention else plan.unpadding
        )  # (B, H_kv, S, D)
        key = query if key is None else key
        if plan.position_embeddings is not None and not self.is_cross_attention:
            query, key = apply_rotary(query, key, *plan.position_embeddings)
        return query, gate, key, value, cache

    def _cached_or_computed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: LayerPlan,
        past_key_values: Cache | None,
        cache: Cache | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Everything of this layer before the backend's scores: the cache update and the type's kernel. (B, H, T, D)
        queries -> (output, keys, values, mask): the output (B, T, H, D) where the kernel (or an empty batch) computed
        it, else None for `forward` to call the backend; the keys attended to (B, H_kv, S, D: cached, or a kernel's
        projected rows), their values and the mask. `kwargs`: the attention kwargs, which continuous batching's paged
        cache fills in place."""
        mask = plan.mask
        if query.shape[0] == 0:  # an empty batch (e.g. a data shard's remainder): kernels reject it, there is no work
            return query.transpose(1, 2), key, value, mask
        kernel = self.kernel if plan.kernel else None
        if plan.kernel and kernel is None:
            raise ValueError(f"'{self.layer_type}' layers have no kernel; the plan must not ask for one.")
        if plan.paged:  # continuous batching's cache (the plan runs no kernel)
            key, value = paged_keys_values(cache, key, value, self.layer_idx, kwargs)
        elif cache is not None and not (kernel is not None and kernel.keeps_cache):
            cached_key, cached_value = cache.update(key, value, self.layer_idx)
            if self.is_cross_attention:
                past_key_values.is_updated[self.layer_idx] = True
            # A prefill into an empty cache gets back the same keys, copied head-major; the kernels that run on
            # prefills only read the token-major projections as views, so they keep those (a copy of each at 16k
            # tokens otherwise). Kernels that run while decoding (`cached_keys`) read every cached key.
            if kernel is None or kernel.cached_keys:
                key, value = cached_key, cached_value
        if kernel is not None:
            key, value, mask = kernel.project(self, key, value, mask)
            groups = self.num_key_value_groups
            output = kernel.attend(self, query, repeat_kv(key, groups), repeat_kv(value, groups), mask, cache, plan)
            if output is not None:
                return output, key, value, mask
        return None, key, value, mask

    def _probabilities(self, query: torch.Tensor, key: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        """The attention probabilities of this layer, recomputed beside the code that produced its output:
        (B, H, T, D) queries and the (B, H_kv, S, D) keys it attended to -> (B, H, T, S), in the query's dtype.

        A kernel that is not a softmax over keys writes its own (`LayerKernel.probabilities`); every other layer
        reuses eager's scores and softmax (fp32) with the plan's eager-form mask.
        """
        key = repeat_kv(key, self.num_key_value_groups)
        if self.kernel is not None:
            probabilities = self.kernel.probabilities(self, query, key, plan)
            if probabilities is not None:
                return probabilities
        sinks = self.sinks if self.has_sinks else None
        return softmax_probabilities(query, key, plan.probability_mask, self.scaling, sinks)
