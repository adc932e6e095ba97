"""THE attention core: one `Attention` class for every use in every family.

    use                      is_causal  keys/values from   mask built by                cache
    encoder self-attention   False      hidden_states      create_bidirectional_mask    none
    decoder self-attention   True       hidden_states      create_causal_mask           DynamicCache / StaticCache
    cross-attention          False      encoder output     create_bidirectional_mask    EncoderDecoderCache, once

The family is chosen by `is_causal` and by where keys/values come from, never by a subclass. The score computation
is dispatched through transformers' `ALL_ATTENTION_FUNCTIONS` (sdpa, flex_attention, flash_attention_2, ...) with
`eager_attention_forward` below as the reference that also returns the attention probabilities.

Each layer also has a type (`config.layer_types`). "full", "sliding" and "strided" differ only in the mask the stack
builds for them; under sdpa without a cache, sliding and strided layers instead get the padding mask and run sparse
kernels that never form an L x L matrix (`sliding_window_attention`, `strided_attention`, both over `BandChunks`).
"lowrank" (Linformer) projects keys/values along the sequence before the same dispatch; "linear" replaces softmax
by a kernel feature map (`linear_attention`), with `LinearAttentionStateLayer` as its cache.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    STATIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    EncoderDecoderCache,
)
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
    # Scores and softmax in fp32 whatever the compute dtype: a bf16 score near 1e3 is only known to ±4, enough to
    # reorder a peaked softmax, and bf16 exponentials lose the small probabilities.
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = nn.functional.softmax(scores, dim=-1).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, T, H, D)
    return output, probs


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


class _OverlappingWindows(torch.autograd.Function):
    """Windows of `span` rows every `step` rows of a (S, H, D) stream, as one strided view (no copy):
    (S, H, D) -> (count, H, span, D).

    The backward adds each window's gradient back in ceil(span / step) pieces; within a piece the windows cover
    disjoint rows, so each piece is one in-place add. Autograd's own backward for overlapping views (unfold,
    as_strided) is a generic scatter that took a quarter of the band kernel's time at L=8192.
    """

    @staticmethod
    def forward(ctx, stream: torch.Tensor, count: int, span: int, step: int) -> torch.Tensor:
        ctx.shape, ctx.count, ctx.span, ctx.step = stream.shape, count, span, step
        return _windows_view(stream, count, span, step)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_stream = grad.new_zeros(ctx.shape)
        for start in range(0, ctx.span, ctx.step):
            width = min(ctx.step, ctx.span - start)
            _windows_view(grad_stream[start:], ctx.count, width, ctx.step).add_(grad[:, :, start : start + width])
        return grad_stream, None, None, None


def _windows_view(stream: torch.Tensor, count: int, span: int, step: int) -> torch.Tensor:
    """(S, H, D) contiguous -> (count, H, span, D) view: window j holds rows [j·step, j·step + span)."""
    heads, head_dim = stream.shape[1:]
    return stream.as_strided((count, heads, span, head_dim), (step * heads * head_dim, head_dim, heads * head_dim, 1))


class BandChunks(NamedTuple):
    """A (B, T) batch cut into chunks of c queries, each with only the keys/values its band can reach: c + w of them
    (c + 2w in an encoder), as in Longformer's chunked local attention (Beltagy et al. 2020). Band attention then
    costs O(L·w) time and memory and never forms an L x L matrix.

    The rows of the batch are laid end to end as one token stream, so that the chunks' keys are overlapping windows
    of that stream (a view, not a copy); keys from a neighbouring row or from the stream's padding are masked.

    queries: (J, H, c, D) with J = B · ceil(T / c); keys, values: (J, H, span, D).
    allowed: (J, 1, c, span) boolean, True where the query may see the key: inside the band, a real token of the
    same row, and always the query itself (so that no row is empty; padding queries get a defined, unused output).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    allowed: torch.Tensor
    batch: int
    length: int

    @classmethod
    def build(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        window: int,
        causal: bool,
        padding_mask: torch.Tensor | None,
        chunk_size: int | None = None,
    ) -> "BandChunks":
        """query, key, value: (B, H, T, D); padding_mask: (B, T), True for real tokens, or None."""
        batch, heads, length, _ = query.shape
        chunk = chunk_size or max(window, 64)
        per_row = -(-length // chunk)
        count = batch * per_row
        before, after = window, (0 if causal else window)
        span = chunk + before + after

        def stream(states: torch.Tensor, margin: tuple[int, int]) -> torch.Tensor:
            # (B, H, T, D) -> (B, T', H, D), T' = per_row · c -> (margin + B · T' + margin, H, D)
            states = nn.functional.pad(states.transpose(1, 2), (0, 0, 0, 0, 0, per_row * chunk - length))
            return nn.functional.pad(states.reshape(count * chunk, heads, -1), (0, 0, 0, 0, *margin))

        queries = stream(query, (0, 0)).view(count, chunk, heads, -1).transpose(1, 2)  # (J, H, c, D)
        keys = _OverlappingWindows.apply(stream(key, (before, after)), count, span, chunk)  # (J, H, span, D)
        values = _OverlappingWindows.apply(stream(value, (before, after)), count, span, chunk)

        device = query.device
        # Query t of a chunk sits at window position t + w: distance = query - key position, 0 for itself.
        distance = torch.arange(chunk, device=device)[:, None] + before - torch.arange(span, device=device)
        band = (distance <= window) & ((distance >= 0) if causal else (distance >= -window))  # (c, span)
        # Which stream position holds a real token, and of which row (-1 for the stream's margins).
        real = padding_mask.bool() if padding_mask is not None else query.new_ones(batch, length, dtype=torch.bool)
        real = nn.functional.pad(real, (0, per_row * chunk - length), value=False).flatten()
        real = nn.functional.pad(real, (before, after), value=False)  # (margin + B · T' + margin,)
        row = torch.arange(batch, device=device).repeat_interleave(per_row * chunk)
        row = nn.functional.pad(row, (before, after), value=-1)
        chunk_row = torch.arange(count, device=device) // per_row
        same_row = row.as_strided((count, span), (chunk, 1)) == chunk_row[:, None]  # (J, span)
        visible = real.as_strided((count, span), (chunk, 1)) & same_row
        allowed = (band & visible[:, None, None, :]) | (distance == 0)  # (J, 1, c, span)
        return cls(queries, keys, values, allowed, batch, length)

    def to_chunks(self, states: torch.Tensor) -> torch.Tensor:
        """Token-order tensors in the chunks' layout: (B, T, H, X) -> (J, H, c, X)."""
        count, _, chunk = self.queries.shape[:3]
        states = nn.functional.pad(states, (0, 0, 0, 0, 0, count // self.batch * chunk - self.length))
        return states.reshape(count, chunk, *states.shape[2:]).transpose(1, 2)

    def to_sequence(self, chunked: torch.Tensor) -> torch.Tensor:
        """Per-chunk results back in token order: (J, H, c, X) -> (B, T, H, X)."""
        count, heads, chunk, width = chunked.shape
        per_row = count // self.batch
        chunked = chunked.transpose(1, 2).reshape(self.batch, per_row * chunk, heads, width)
        return chunked[:, : self.length]


def sliding_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    window: int,
    causal: bool,
    padding_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Band attention in O(L·w) time and memory: each query sees the keys at most `window` positions away (only
    earlier ones when causal), over `BandChunks`, with sdpa inside each chunk.

    Computes exactly what the dense band mask does, without ever forming an L x L score or mask matrix.

    Args:
        query: (B, H, T, D); key, value: (B, H, T, D) (key/value heads already repeated).
        window: keys at most `window` positions away are visible.
        padding_mask: (B, T) boolean, True for real tokens, or None.

    Returns:
        (B, T, H, D)
    """
    chunks = BandChunks.build(
        query, key, value, window=window, causal=causal, padding_mask=padding_mask, chunk_size=chunk_size
    )
    output = nn.functional.scaled_dot_product_attention(
        chunks.queries, chunks.keys, chunks.values, attn_mask=chunks.allowed, dropout_p=dropout, scale=scaling
    )  # (J, H, c, D)
    return chunks.to_sequence(output)


def _far_part(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with its log-sum-exp, so that it can join another softmax:
    (..., T, D) queries, (..., S, D) keys/values, (..., T, S) mask -> output (..., T, D), lse (..., T, 1)."""
    # Scores in fp32 whatever the compute dtype, as in eager_attention_forward. A masked score is the most negative
    # float rather than -inf, so that a row with no visible key stays finite (its result is then masked out).
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, torch.finfo(dtype).min)
    output = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
    return output, torch.logsumexp(scores, dim=-1, keepdim=True)


def strided_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    stride: int,
    causal: bool,
    padding_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Sparse Transformer strided attention (Child et al. 2019, sec. 4.2) in O(L·(s + L/s)): a query sees the keys
    less than s positions away (A1) and every key a multiple of s away (A2), only earlier ones when causal.

    Each part is computed where it is dense, then joined exactly:
      A2 \\ {query}: tokens regrouped by residue class t mod s, (B, H, T, D) -> (B, H, s, T/s, D), where it is dense
          attention within each class minus the diagonal; it yields an output o2 and log-sum-exp lse2 per query.
      A1, the band |q - k| < s: `BandChunks` with window s - 1 and sdpa, plus one extra key per query that stands
          for all of A2: score lse2 (a key [0, lse2] against the query [q, 1/scaling]) and value o2. Its softmax
          weight is then Z2 / (Z1 + Z2), so the output is exactly softmax over A1 ∪ A2, gradients included.
    With attention dropout, A2 is dropped as one unit per query (still unbiased), not key by key.

    Args:
        query: (B, H, T, D); key, value: (B, H, T, D) (key/value heads already repeated).
        padding_mask: (B, T) boolean, True for real tokens, or None.

    Returns:
        (B, T, H, D)
    """
    batch, heads, length, head_dim = query.shape
    per_class = -(-length // stride)
    padded = per_class * stride

    def by_residue(states: torch.Tensor) -> torch.Tensor:
        # (B, H, T, X) -> (B, H, T/s, s, X) -> (B, H, s, T/s, X): class r holds positions r, r + s, r + 2s, ...
        states = nn.functional.pad(states, (0, 0, 0, padded - length))
        return states.view(batch, heads, per_class, stride, states.shape[-1]).transpose(2, 3)

    def from_residue(states: torch.Tensor) -> torch.Tensor:
        # (B, H, s, T/s, X) -> (B, H, T/s, s, X) -> (B, T, H, X)
        states = states.transpose(2, 3).reshape(batch, heads, padded, states.shape[-1])
        return states[:, :, :length].transpose(1, 2)

    real = padding_mask.bool() if padding_mask is not None else query.new_ones(batch, length, dtype=torch.bool)
    real = nn.functional.pad(real, (0, padded - length), value=False).view(batch, per_class, stride).transpose(1, 2)
    index = torch.arange(per_class, device=query.device)
    others = (index[None, :] < index[:, None]) if causal else (index[None, :] != index[:, None])  # (T/s, T/s)
    far_allowed = others & real[:, None, :, None, :]  # (B, 1, s, T/s, T/s)
    far, far_lse = _far_part(by_residue(query), by_residue(key), by_residue(value), far_allowed, scaling)
    far, far_lse = from_residue(far), from_residue(far_lse)  # (B, T, H, D), (B, T, H, 1)
    has_far = from_residue(far_allowed.any(-1, keepdim=True).expand(batch, heads, -1, -1, -1))  # (B, T, H, 1)

    # The band part over keys with one more dimension: [k, 0] for tokens, [0, lse2] for the extra key (masked out
    # where A2 is empty, with a harmless 0 in its place). Values get a zero column too: torch's fused CPU kernel
    # needs keys and values of one width (otherwise sdpa falls back to the unfused math).
    extra_column = query.new_zeros(batch, heads, length, 1)
    chunks = BandChunks.build(
        torch.cat([query, extra_column + 1 / scaling], dim=-1),
        torch.cat([key, extra_column], dim=-1),
        torch.cat([value, extra_column], dim=-1),
        window=stride - 1,
        causal=causal,
        padding_mask=padding_mask,
        chunk_size=chunk_size,
    )
    far_key = torch.cat([far.new_zeros(*far.shape[:-1], head_dim), far_lse.where(has_far, 0).to(key.dtype)], -1)
    keys = torch.cat([chunks.keys, chunks.to_chunks(far_key)], dim=2)  # (J, H, span + c, D + 1)
    far_value = torch.cat([far, far.new_zeros(*far.shape[:-1], 1)], -1)
    values = torch.cat([chunks.values, chunks.to_chunks(far_value)], dim=2)  # (J, H, span + c, D + 1)
    chunk = chunks.queries.shape[2]
    own = torch.eye(chunk, dtype=torch.bool, device=query.device)  # query t of a chunk sees extra key t only
    far_visible = own & chunks.to_chunks(has_far[:, :, :1])  # (J, 1, c, c)
    allowed = torch.cat([chunks.allowed, far_visible], dim=-1)  # (J, 1, c, span + c)
    output = nn.functional.scaled_dot_product_attention(
        chunks.queries, keys, values, attn_mask=allowed, dropout_p=dropout, scale=scaling
    )  # (J, H, c, D + 1)
    return chunks.to_sequence(output[..., :head_dim])


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1: a positive feature map (Katharopoulos et al. 2020, sec. 3.2.1)."""
    return nn.functional.elu(x) + 1


def performer_feature_map(x: torch.Tensor, projection: torch.Tensor, is_query: bool) -> torch.Tensor:
    """FAVOR+ positive random features (Choromanski et al. 2021, Lemma 1): φ(x) = exp(Wx - |x|²/2) / √m, so that
    E[φ(q)·φ(k)] = exp(q·k / √d) once q and k are scaled by d^-1/4. x: (B, H, T, D), projection: (D, m)."""
    x = x * x.shape[-1] ** -0.25
    logits = x @ projection - x.pow(2).sum(-1, keepdim=True) / 2  # (B, H, T, m)
    if is_query:
        # A per-query constant cancels between numerator and normaliser: subtract the max for a safe exp. Keys get
        # none, since a data-dependent key constant would change between cached decoding steps.
        logits = logits - logits.amax(-1, keepdim=True).detach()
    return torch.exp(logits) / math.sqrt(projection.shape[-1])


def linear_attention(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernelised attention φ(Q) (φ(K)ᵀ V) / φ(Q) Σφ(K) in O(L) (Katharopoulos et al. 2020, eq. 4-6).

    Values carry an extra column of ones, so one product gives both the numerator and the normaliser. Causal
    attention scans chunks: exact quadratic attention inside a chunk, plus the running state Σ φ(k) [v, 1]ᵀ of all
    earlier chunks (eq. 9-10), which is also what the cache keeps for O(1) decoding.

    Args:
        query_features, key_features: (B, H, T, m) feature-mapped queries/keys (padding keys already zeroed).
        value: (B, H, T, D).
        state: (B, H, m, D + 1) running state from earlier tokens (causal decoding), or None.

    Returns:
        output (B, T, H, D) and the state after these tokens, (B, H, m, D + 1).
    """
    dtype = value.dtype
    # Sums over thousands of positions: accumulate in fp32 whatever the compute dtype.
    query_features, key_features = query_features.float(), key_features.float()
    value = torch.cat([value.float(), value.new_ones(*value.shape[:-1], 1, dtype=torch.float32)], dim=-1)
    batch, heads, length, features = key_features.shape
    if state is None:
        state = value.new_zeros(batch, heads, features, value.shape[-1])
    if not causal:
        state = state + key_features.transpose(-2, -1) @ value  # (B, H, m, D + 1)
        output = query_features @ state
    else:
        outputs = []
        for start in range(0, length, chunk_size):
            q = query_features[:, :, start : start + chunk_size]
            k = key_features[:, :, start : start + chunk_size]
            v = value[:, :, start : start + chunk_size]
            within = torch.tril(q @ k.transpose(-2, -1))  # (B, H, c, c): causal inside the chunk
            outputs.append(within @ v + q @ state)
            state = state + k.transpose(-2, -1) @ v
        output = torch.cat(outputs, dim=2)
    numerator, normaliser = output[..., :-1], output[..., -1:]
    # A query that sees no key (padding) has normaliser 0: give it a zero output instead of NaN.
    output = numerator / normaliser.clamp_min(1e-6)
    return output.transpose(1, 2).to(dtype), state  # (B, T, H, D)


class LinearAttentionStateLayer(CacheLayerMixin):
    """Cache of a "linear" layer: the running state Σ φ(k) [v, 1]ᵀ (B, H, m, D + 1) and the tokens it has seen.

    Registered under the layer type "coreformer_linear_attention", which the config's `get_text_config` hands to
    transformers, so `DynamicCache(config=...)`, `StaticCache(config=...)` and generate() build it themselves.
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state: torch.Tensor | None = None
        self.num_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("a linear-attention layer caches a running state, not keys and values")

    def update_state(self, state: torch.Tensor, num_new_tokens: int) -> None:
        self.state, self.is_initialized = state, True
        self.num_tokens += num_new_tokens

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.num_tokens, self.is_initialized = None, 0, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(0, beam_idx.to(self.state.device))

    def offload(self) -> None:
        if self.state is not None:
            self.state = self.state.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        pass


# The same running state serves dynamic and static caches.
DYNAMIC_LAYER_TYPE_MAPPING["coreformer_linear_attention"] = LinearAttentionStateLayer
STATIC_LAYER_TYPE_MAPPING["coreformer_linear_attention"] = LinearAttentionStateLayer


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
        heads = projection.out_features // self.head_dim  # explicit, so that empty batches reshape too
        projected = projection(states)
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
            unpadding (keyword): set by the stack when `hidden_states` holds only the real tokens of a padded batch,
                (N, hidden); the output is then (N, hidden) too.

        Returns:
            output (B, T, hidden) and attention probabilities (B, H, T, S) when the backend returns them (eager).
        """
        unpadding: Unpadding | None = kwargs.pop("unpadding", None)
        query = self._split_heads(hidden_states, self.q_proj, unpadding)  # (B, H, T, D)
        source = key_value_states if self.is_cross_attention else hidden_states
        # Cross-attention keys come from the (padded) encoder output, whatever the queries' layout.
        key, value, cache = self._keys_values(
            source, past_key_values, None if self.is_cross_attention else unpadding
        )  # (B, H_kv, S, D)

        if position_embeddings is not None and not self.is_cross_attention:
            query, key = apply_rotary(query, key, *position_embeddings)
        output, weights = self._attend(query, key, value, attention_mask, past_key_values, cache, **kwargs)
        if unpadding is not None:
            output = unpadding.unpad(output)  # (B, T, H, D) -> (N, H, D)
        output = output.flatten(-2)  # (..., H, D) -> (..., H*D)
        return self.o_proj(output), weights

    def _attend(self, query, key, value, attention_mask, past_key_values, cache, **kwargs):
        """Scores and weighted values for this layer's type: (B, H, T, D) queries -> (B, T, H, D), weights."""
        dropout = self.attention_dropout if self.training else 0.0
        if query.shape[0] == 0:  # an empty batch (e.g. a data shard's remainder): kernels reject it, there is no work
            return query.transpose(1, 2), None
        if self.layer_type == "linear":
            return self._linear_forward(query, key, value, attention_mask, cache), None
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
            if self.is_cross_attention:
                past_key_values.is_updated[self.layer_idx] = True
        if self.layer_type == "lowrank":
            key, value = self._project_sequence(key, value, attention_mask)
            attention_mask = None  # the projected rows mix all (real) positions: nothing left to mask
        pattern = self.layer_type in ("sliding", "strided")
        if pattern and (attention_mask is None or getattr(attention_mask, "ndim", 0) == 2):
            # The stack hands sliding/strided layers their 2D padding mask when the sparse kernels apply (see
            # CoreformerStack.build_masks): sdpa without a cache, documents not packed.
            key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)
            shared = dict(causal=self.is_causal, padding_mask=attention_mask, scaling=self.scaling, dropout=dropout)
            if self.layer_type == "sliding":
                output = sliding_window_attention(query, key, value, window=self.config.sliding_window, **shared)
            else:
                output = strided_attention(query, key, value, stride=self.config.stride, **shared)
            return output, None
        attention_fn: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        return attention_fn(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)
