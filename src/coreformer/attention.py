"""THE attention core: one `Attention` class for every use in every family.

    use                      is_causal  keys/values from   mask built by                cache
    encoder self-attention   False      hidden_states      create_bidirectional_mask    none
    decoder self-attention   True       hidden_states      create_causal_mask           DynamicCache / StaticCache
    cross-attention          False      encoder output     create_bidirectional_mask    EncoderDecoderCache, once

The family is chosen by `is_causal` and by where keys/values come from, never by a subclass. The score computation
is dispatched through transformers' `ALL_ATTENTION_FUNCTIONS` (sdpa, flex_attention, flash_attention_2, ...) with
`eager_attention_forward` below as the reference that also returns the attention probabilities.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_coreformer import CoreformerConfig


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
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    # Softmax in fp32 whatever the compute dtype: bf16 exponentials lose the small probabilities.
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, T, H, D)
    return output, probs


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

    def __init__(self, config: CoreformerConfig, layer_idx: int, *, is_causal: bool, is_cross_attention: bool = False):
        super().__init__()
        if is_causal and is_cross_attention:
            raise ValueError("cross-attention sees the whole encoder output: it cannot be causal")
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

    def _split_heads(self, states: torch.Tensor, projection: nn.Linear) -> torch.Tensor:
        """(B, T, hidden) -> (B, heads, T, head_dim)."""
        return projection(states).view(*states.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def _keys_values(
        self, source: torch.Tensor | None, past_key_values: Cache | None
    ) -> tuple[torch.Tensor, torch.Tensor, Cache | None]:
        """Project keys/values from `source`, or reuse them from a cross-attention cache that already holds them."""
        cache = past_key_values
        if self.is_cross_attention:
            # Only an EncoderDecoderCache has room for cross-attention; with any other cache, recompute each step.
            is_encoder_decoder_cache = isinstance(past_key_values, EncoderDecoderCache)
            cache = past_key_values.cross_attention_cache if is_encoder_decoder_cache else None
            if cache is not None and past_key_values.is_updated.get(self.layer_idx):
                # The encoder output does not change while decoding: its keys/values were computed on step one.
                layer = cache.layers[self.layer_idx]
                return layer.keys, layer.values, None
        elif isinstance(past_key_values, EncoderDecoderCache):
            cache = past_key_values.self_attention_cache
        if source is None:
            raise ValueError("cross-attention needs `key_value_states` (the encoder output) on its first call")
        return self._split_heads(source, self.k_proj), self._split_heads(source, self.v_proj), cache

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states: (B, T, hidden) queries (and keys/values for self-attention).
            attention_mask: the mask built once per forward by the stack for the configured backend.
            key_value_states: (B, S, hidden) encoder output for cross-attention.
            position_embeddings: rotary (cos, sin), each (B, T, head_dim); self-attention only.
            past_key_values: a `Cache` (an `EncoderDecoderCache` in seq2seq decoders) updated in place.

        Returns:
            output (B, T, hidden) and attention probabilities (B, H, T, S) when the backend returns them (eager).
        """
        batch, q_len = hidden_states.shape[:2]
        query = self._split_heads(hidden_states, self.q_proj)  # (B, H, T, D)
        source = key_value_states if self.is_cross_attention else hidden_states
        key, value, cache = self._keys_values(source, past_key_values)  # (B, H_kv, S, D)

        if position_embeddings is not None and not self.is_cross_attention:
            query, key = apply_rotary(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
            if self.is_cross_attention:
                past_key_values.is_updated[self.layer_idx] = True

        attention_fn: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, weights = attention_fn(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(output.reshape(batch, q_len, -1)), weights  # (B, T, H, D) -> (B, T, hidden)
