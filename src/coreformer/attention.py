"""THE attention core: one `Attention` class for every use in every family.

    use                      is_causal  keys/values from   mask built by                cache
    encoder self-attention   False      hidden_states      create_bidirectional_mask    none
    decoder self-attention   True       hidden_states      create_causal_mask           DynamicCache / StaticCache
    cross-attention          False      encoder output     create_bidirectional_mask    EncoderDecoderCache, once

The family is chosen by `is_causal` and by where keys/values come from, never by a subclass. The score computation
is dispatched through transformers' `ALL_ATTENTION_FUNCTIONS` (sdpa, flex_attention, flash_attention_2, ...) with
`eager_attention_forward` below as the reference that also returns the attention probabilities.

Each layer also has a type (`config.layer_types`). "full", "sliding" and "strided" differ only in the mask the stack
builds for them; under sdpa without a cache, sliding and strided layers instead run the sparse kernels of
`sparse_attention.py`, which never form an L x L matrix. "lowrank" (Linformer) projects keys/values along the
sequence before the same dispatch; "linear" replaces softmax by a kernel feature map (`linear_attention.py`).
"""

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_coreformer import CoreformerConfig
from .layer_types import LAYER_TYPES
from .linear_attention import LinearAttentionStateLayer, elu_feature_map, linear_attention, performer_feature_map


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
    probs = softmax_probabilities(query, repeat_kv(key, module.num_key_value_groups), attention_mask, scaling)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    value = repeat_kv(value, module.num_key_value_groups)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, T, H, D)
    return output, probs


def softmax_probabilities(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """softmax(Q Kᵀ · scaling + mask): (B, H, T, D) queries, (B, H, S, D) keys -> (B, H, T, S) in the query's dtype.
    The mask is additive (float) or boolean (True = attend), broadcastable to (B, H, T, S)."""
    # Scores and softmax in fp32 whatever the compute dtype: a bf16 score near 1e3 is only known to ±4, enough to
    # reorder a peaked softmax, and bf16 exponentials lose the small probabilities.
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    return nn.functional.softmax(scores, dim=-1).to(query.dtype)


class Unpadding(NamedTuple):
    """Where the real tokens of a right- or left-padded (B, L) batch sit, so that the position-wise work (projections,
    MLPs, norms) runs on those N tokens alone: ModernBERT's unpadding (Warner et al. 2024); measured 1.7x for a 6 x 384
    encoder on CPU, forward and forward+backward, with 53% real tokens. Scores still see the padded (B, L) layout and
    the usual mask, so every backend and layer type works.

    indices: (N,) flat positions b * L + t of the real tokens.
    """

    indices: torch.Tensor
    batch: int
    length: int

    @classmethod
    def from_padding_mask(cls, padding_mask: torch.Tensor) -> "Unpadding":
        """padding_mask: (B, L), nonzero for real tokens."""
        return cls(padding_mask.flatten().nonzero().squeeze(1), *padding_mask.shape)

    def unpad(self, states: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (N, ...)"""
        return states.reshape(self.batch * self.length, *states.shape[2:]).index_select(0, self.indices)

    def pad(self, states: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, L, ...), zeros at the padding."""
        padded = states.new_zeros(self.batch * self.length, *states.shape[1:]).index_copy(0, self.indices, states)
        return padded.view(self.batch, self.length, *states.shape[1:])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021, eq. 34). query/key: (B, H, T, D); cos/sin: (B, T, D)."""
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
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

        self.layer_type = layer_type
        kind = LAYER_TYPES[layer_type]
        # Passed to every attention function as in-library sliding models (Mistral, Qwen2) pass it: the window in
        # transformers' convention (the query counted in), None for every other layer (and cross-attention).
        self.sliding_window = (
            kind.transformers_window(getattr(config, kind.parameter)) if kind.transformers_window else None
        )
        # The type's sparse kernel with its parameter bound; it runs when the stack decides so (`sparse_kernel`).
        self.kernel = partial(kind.sparse_kernel, getattr(config, kind.parameter)) if kind.sparse_kernel else None
        if layer_type == "lowrank":
            # Linformer's E and F (Wang et al. 2020, eq. 7): length n = max_position_embeddings -> k rows.
            self.k_seq_proj = nn.Linear(config.max_position_embeddings, config.lowrank_k, bias=False)
            self.v_seq_proj = nn.Linear(config.max_position_embeddings, config.lowrank_k, bias=False)
        if layer_type == "linear" and config.linear_feature_map == "performer":
            # Random features are part of the function: a persistent buffer, saved with the weights.
            self.register_buffer("random_features", torch.empty(self.head_dim, config.linear_num_features))

    def draw_random_features(self) -> torch.Tensor:
        """Orthogonal Gaussian features (Performer's ORF variant), (head_dim, m); drawn by `_init_weights`."""
        features = self.random_features.shape[1]
        num_blocks = -(-features // self.head_dim)
        blocks = [torch.linalg.qr(torch.randn(self.head_dim, self.head_dim))[0] for _ in range(num_blocks)]
        norms = torch.randn(features, self.head_dim).norm(dim=-1)  # chi-distributed row norms, as for Gaussian rows
        return (torch.cat(blocks, dim=1)[:, :features] * norms).to(self.random_features.dtype)

    def _features(self, states: torch.Tensor, is_query: bool) -> torch.Tensor:
        if self.config.linear_feature_map == "performer":
            return performer_feature_map(states.float(), self.random_features.float(), is_query)
        return elu_feature_map(states)

    def _project_sequence(
        self, key: torch.Tensor, value: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Linformer: (B, H, S, D) keys/values -> (B, H, k, D), mixing positions with E/F cut to the first S columns."""
        length = key.shape[2]
        if padding_mask is not None:
            keep = padding_mask[:, None, :, None].to(key.dtype)  # padded positions must not leak into the rows
            key, value = key * keep, value * keep
        project_k = self.k_seq_proj.weight[:, :length].to(key.dtype)  # (k, S)
        project_v = self.v_seq_proj.weight[:, :length].to(value.dtype)
        return project_k @ key, project_v @ value  # (B, H, k, D)

    def _linear_forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, padding_mask: torch.Tensor | None, cache
    ) -> torch.Tensor:
        key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)
        key_features = self._features(key, is_query=False)
        if padding_mask is not None:
            new_tokens = padding_mask[:, -key.shape[2] :]  # (B, T): the mask also covers cached tokens
            key_features = key_features * new_tokens[:, None, :, None].to(key_features.dtype)
        layer = cache.layers[self.layer_idx] if cache is not None and len(cache.layers) > self.layer_idx else None
        if cache is not None and not isinstance(layer, LinearAttentionStateLayer):
            raise ValueError(
                "This layer is linear attention, which caches a running state: build the cache from the config "
                "(DynamicCache(config=model.config) or StaticCache(config=model.config, ...)) or let generate() do it."
            )
        output, state = linear_attention(
            self._features(query, is_query=True),
            key_features,
            value,
            causal=self.is_causal,
            state=layer.state if layer is not None else None,
        )
        if layer is not None:
            layer.update_state(state, key.shape[2])
        return output

    def _split_heads(
        self, states: torch.Tensor, projection: nn.Linear, unpadding: Unpadding | None = None
    ) -> torch.Tensor:
        """(B, T, hidden) -> (B, heads, T, head_dim); unpadded (N, hidden) states are projected, then padded."""
        projected = projection(states)
        # Heads from the projected width, not from the module: under tensor parallelism a colwise-sharded projection
        # keeps its full `out_features` but returns this rank's heads only. Explicit so that empty batches reshape too.
        heads = projected.shape[-1] // self.head_dim
        if unpadding is not None:
            projected = unpadding.pad(projected)  # (N, heads * head_dim) -> (B, L, heads * head_dim)
        return projected.view(*projected.shape[:-1], heads, self.head_dim).transpose(1, 2)

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
        elif isinstance(past_key_values, EncoderDecoderCache):
            cache = past_key_values.self_attention_cache
        if source is None:
            raise ValueError("cross-attention needs `key_value_states` (the encoder output) on its first call")
        key = self._split_heads(source, self.k_proj, unpadding)
        return key, self._split_heads(source, self.v_proj, unpadding), cache

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        sparse_kernel: bool = False,
        output_attentions: bool = False,
        probability_mask: torch.Tensor | None = None,
        unpadding: Unpadding | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states: (B, T, hidden) queries (and keys/values for self-attention).
            attention_mask: the mask built once per forward by the stack for this layer's type and the backend; for
                "lowrank" and "linear" layers, the (B, S) boolean padding mask (or None).
            key_value_states: (B, S, hidden) encoder output for cross-attention.
            position_embeddings: rotary (cos, sin), each (B, T, head_dim); self-attention only.
            past_key_values: a `Cache` (an `EncoderDecoderCache` in seq2seq decoders) updated in place.
            sparse_kernel: run this layer type's sparse kernel (`layer_types.py`) instead of the configured backend;
                decided by the stack (`CoreformerStack.sparse_kernel_types`), which then hands the (B, S) padding mask.
            output_attentions: return the attention probabilities. Where the code that ran does not produce them
                (sdpa, flex, a sparse kernel, a registered function), they are recomputed beside it from the same
                queries and keys with `probability_mask`, so the output itself is what it is without them.
            probability_mask: this layer's mask in eager's form (built by the stack when attentions are requested
                under another backend); for "lowrank"/"linear" layers, unused.
            unpadding: set by the stack when `hidden_states` holds only the real tokens of a padded batch,
                (N, hidden); the output is then (N, hidden) too.
            **kwargs: passed on to the attention function (transformers' attention kwargs).

        Returns:
            output (B, T, hidden) and the attention probabilities (B, H, T, S) (S = k for "lowrank") when
            `output_attentions`, or whenever the backend returns them (eager); else None. Recomputed probabilities
            are those before attention dropout.
        """
        query = self._split_heads(hidden_states, self.q_proj, unpadding)  # (B, H, T, D)
        source = key_value_states if self.is_cross_attention else hidden_states
        # Cross-attention keys come from the (padded) encoder output, whatever the queries' layout.
        key, value, cache = self._keys_values(
            source, past_key_values, None if self.is_cross_attention else unpadding
        )  # (B, H_kv, S, D)

        if position_embeddings is not None and not self.is_cross_attention:
            query, key = apply_rotary(query, key, *position_embeddings)
        if (
            output_attentions
            and self.layer_type == "linear"
            and cache is not None
            and cache.get_seq_length(self.layer_idx)
        ):
            raise ValueError(
                "output_attentions=True with a cached 'linear' layer: its cache keeps a running state, not the past "
                "keys, so the probabilities over earlier tokens no longer exist. Request attentions on a forward "
                "without a cache (use_cache=False), or on the prefill only."
            )
        output, weights, attended_key = self._attend(
            query, key, value, attention_mask, past_key_values, cache, sparse_kernel, **kwargs
        )
        if output_attentions and weights is None:
            weights = self._probabilities(query, attended_key, probability_mask, attention_mask)
        if unpadding is not None:
            output = unpadding.unpad(output)  # (B, T, H, D) -> (N, H, D)
        output = output.flatten(-2)  # (..., H, D) -> (..., H*D)
        return self.o_proj(output), weights

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None,
        cache: Cache | None,
        sparse_kernel: bool,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Scores and weighted values for this layer's type: (B, H, T, D) queries -> output (B, T, H, D), the
        probabilities (B, H, T, S) where the code that ran returns them (else None), and the keys it attended to
        (B, H_kv, S, D): cached, or Linformer's projected rows."""
        dropout = self.attention_dropout if self.training else 0.0
        if query.shape[0] == 0:  # an empty batch (e.g. a data shard's remainder): kernels reject it, there is no work
            return query.transpose(1, 2), None, key
        if self.layer_type == "linear":
            return self._linear_forward(query, key, value, attention_mask, cache), None, key
        if sparse_kernel and self.kernel is None:
            raise ValueError(f"'{self.layer_type}' layers have no sparse kernel; the stack must not ask for one.")
        if cache is not None:
            cached_key, cached_value = cache.update(key, value, self.layer_idx)
            if self.is_cross_attention:
                past_key_values.is_updated[self.layer_idx] = True
            # A prefill into an empty cache gets back the same keys, copied head-major; the kernels read the
            # token-major projections as views, so they keep those (a copy of each at 16k tokens otherwise).
            if not sparse_kernel:
                key, value = cached_key, cached_value
        if self.layer_type == "lowrank":
            key, value = self._project_sequence(key, value, attention_mask)
            attention_mask = None  # the projected rows mix all (real) positions: nothing left to mask
        if sparse_kernel:
            repeated_key = repeat_kv(key, self.num_key_value_groups)
            repeated_value = repeat_kv(value, self.num_key_value_groups)
            output = self.kernel(
                query,
                repeated_key,
                repeated_value,
                causal=self.is_causal,
                padding_mask=attention_mask,
                scaling=self.scaling,
                dropout=dropout,
            )
            return output, None, key
        attention_fn: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, weights = attention_fn(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return output, weights, key

    def _probabilities(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        probability_mask: torch.Tensor | None,
        padding_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The attention probabilities of this layer, recomputed beside the kernel that produced its output:
        (B, H, T, D) queries and the (B, H_kv, S, D) keys it attended to -> (B, H, T, S), in the query's dtype.

        Softmax layers reuse eager's scores and softmax (fp32) with the layer's mask in eager's form; "lowrank"
        layers see the k projected rows, unmasked; "linear" layers write out φ(q)·φ(k) / Σ φ(q)·φ(k) over the
        visible keys, which their O(L) form never forms.
        """
        key = repeat_kv(key, self.num_key_value_groups)
        if self.layer_type != "linear":
            mask = None if self.layer_type == "lowrank" else probability_mask
            return softmax_probabilities(query, key, mask, self.scaling)
        query_features = self._features(query, is_query=True).float()  # (B, H, T, m)
        key_features = self._features(key, is_query=False).float()  # (B, H, S, m)
        similarity = query_features @ key_features.transpose(2, 3)  # (B, H, T, S)
        length, keys = similarity.shape[-2:]
        visible = torch.ones(length, keys, dtype=torch.bool, device=query.device)
        if self.is_causal:
            visible = visible.tril(keys - length)  # (T, S): query t sees keys up to its own position
        visible = visible[None, None]
        if padding_mask is not None:
            visible = visible & padding_mask[:, None, None, -keys:].bool()
        similarity = similarity * visible
        return (similarity / similarity.sum(-1, keepdim=True).clamp_min(1e-6)).to(query.dtype)
