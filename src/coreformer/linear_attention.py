"""Linear attention ("linear" layers): softmax replaced by a kernel feature map, O(L) time and an O(1) decode state.

feature maps     elu(x) + 1 (Katharopoulos et al. 2020), FAVOR+ positive random features (Performer)
linear_attention φ(Q) (φ(K)ᵀ [V, 1]) normalised, chunked when causal or packed, returning the running state
LinearAttentionStateLayer   the cache layer that keeps that state (registered with transformers' caches)
LinearKernel     the "linear" layer type's kernel: random features, the O(L) forward with its cache, probabilities
"""

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING, CacheLayerMixin

from .layer_kernel import LayerKernel

# The cache layer type under which transformers' caches build a `LinearAttentionStateLayer` (the "linear" entry of
# layer_types.py names it).
LINEAR_CACHE_LAYER = "coreformer_linear_attention"


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
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernelised attention φ(Q) (φ(K)ᵀ V) / φ(Q) Σφ(K) in O(L) (Katharopoulos et al. 2020, eq. 4-6).

    Values carry an extra column of ones, so one product gives both the numerator and the normaliser. Causal
    attention scans chunks: exact quadratic attention inside a chunk, plus the running state Σ φ(k) [v, 1]ᵀ of all
    earlier chunks (eq. 9-10), which is also what the cache keeps for O(1) decoding.

    Packed rows (`documents`): the running state restarts at each document, so that a query sums over the keys of its
    own document only; bidirectionally, a document's sum is its prefix sums plus its suffix sums (the same scan over
    the reversed row) less the token itself:

        row     | a a a a | b b b b b b |
        causal    ---->     ------>         the state is emptied where b starts
        reverse   <----     <------

    Args:
        query_features, key_features: (B, H, T, m) feature-mapped queries/keys (padding keys already zeroed).
        value: (B, H, T, D).
        state: (B, H, m, D + 1) running state from earlier tokens (causal decoding), or None.
        documents: (B, T) document ids of packed rows, or None.

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
    if causal or documents is not None:
        output, new_state = _scan(query_features, key_features, value, state, chunk_size, documents)
        if not causal:  # a document's keys before and after each query, the query itself counted once
            backward, _ = _scan(
                *(t.flip(2) for t in (query_features, key_features, value)),
                torch.zeros_like(state),
                chunk_size,
                documents.flip(1),
            )
            itself = (query_features * key_features).sum(-1, keepdim=True) * value  # (B, H, T, D + 1)
            output = output + backward.flip(2) - itself
        state = new_state
    else:
        state = state + key_features.transpose(-2, -1) @ value  # (B, H, m, D + 1)
        output = query_features @ state
    numerator, normaliser = output[..., :-1], output[..., -1:]
    # A query that sees no key (padding) has normaliser 0: give it a zero output instead of NaN.
    output = numerator / normaliser.clamp_min(1e-6)
    return output.transpose(1, 2).to(dtype), state  # (B, T, H, D)


def _scan(
    query_features: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    documents: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal chunked scan of `linear_attention` before normalising: (B, H, T, m) features, (B, H, T, D + 1)
    values with their ones column, (B, H, m, D + 1) state -> (B, H, T, D + 1) sums and the final state. With
    `documents` (B, T), a query sees the state only while its chunk's first document continues the state's, and a
    chunk passes on the keys of its last document only (plus the state, where that document began earlier)."""
    outputs = []
    current = documents[:, 0] if documents is not None else None  # (B,): the document the state holds
    for start in range(0, query_features.shape[2], chunk_size):
        q = query_features[:, :, start : start + chunk_size]
        k = key_features[:, :, start : start + chunk_size]
        v = value[:, :, start : start + chunk_size]
        within = torch.tril(q @ k.transpose(-2, -1))  # (B, H, c, c): causal inside the chunk
        if documents is None:
            outputs.append(within @ v + q @ state)
            state = state + k.transpose(-2, -1) @ v
            continue
        chunk = documents[:, start : start + chunk_size]  # (B, c)
        within = within * (chunk[:, None, :, None] == chunk[:, None, None, :])
        continues = (chunk == current[:, None])[:, None, :, None]  # (B, 1, c, 1): the state is this query's
        outputs.append(within @ v + (q * continues) @ state)
        last = chunk[:, -1]
        kept = (chunk == last[:, None])[:, None, :, None]  # (B, 1, c, 1): keys of the chunk's last document
        state = state * (last == current)[:, None, None, None] + (k * kept).transpose(-2, -1) @ v
        current = last
    return torch.cat(outputs, dim=2), state


class LinearAttentionStateLayer(CacheLayerMixin):
    """Cache of a "linear" layer: the running state Σ φ(k) [v, 1]ᵀ (B, H, m, D + 1) and the tokens it has seen.

    Registered under the layer type "coreformer_linear_attention", which the config's `get_text_config` hands to
    transformers, so `DynamicCache(config=...)`, `StaticCache(config=...)` and generate() build it themselves.

    A running state cannot drop tokens by itself. Assisted and prompt-lookup decoding verify several draft tokens in
    one forward and then `crop` the rejected ones, after asking the cache to record its past
    (`activate_past_recording`): while recording, the layer keeps the state before its last forward and that forward's
    key features and values, and a crop rebuilds the state from them (tokens of earlier forwards cannot be removed).
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state: torch.Tensor | None = None
        self.num_tokens = 0
        self.record_past = False
        # While recording: (state before the last forward, its key features (B, H, T, m), its values (B, H, T, D)).
        self.last_forward: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can put the state back (transformers 5.24 asks before assisted decoding crops)."""
        return self.record_past

    def activate_past_recording(self) -> None:
        self.record_past = True

    def record(self, key_features: torch.Tensor, value: torch.Tensor) -> None:
        """Keep what a crop of this forward's tokens needs, before `update_state` (only while recording)."""
        if self.record_past:
            self.last_forward = (self.state, key_features.float(), value.float())

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers' convention; a positive value is the length to
        keep, as releases before 5.18 also accepted), which must all come from the last forward."""
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, self.num_tokens - tokens_to_remove)
        if remove == 0:
            return
        last = self.last_forward[1].shape[2] if self.last_forward is not None else 0
        if not self.record_past or remove > last:
            raise RuntimeError(
                f"A 'linear' layer keeps a running state: it can take back only the tokens of its last forward "
                f"({last}) while recording its past (cache.activate_past_recording(), which assisted generation "
                f"calls), not {remove}."
            )
        before, key_features, value = self.last_forward
        keep = last - remove
        key_features, value = key_features[:, :, :keep], value[:, :, :keep]
        value = torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)  # (B, H, keep, D + 1)
        added = key_features.transpose(-2, -1) @ value  # (B, H, m, D + 1), as linear_attention accumulates it
        self.state = added if before is None else before + added
        self.num_tokens -= remove
        self.last_forward = (before, key_features, value[..., :-1])

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
        self.state, self.num_tokens, self.is_initialized, self.last_forward = None, 0, False, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(0, beam_idx.to(self.state.device))
        self.last_forward = None  # a beam reordering is no forward a crop can take back

    def offload(self) -> None:
        if self.state is not None:
            self.state = self.state.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        pass


# The same running state serves dynamic and static caches.
DYNAMIC_LAYER_TYPE_MAPPING[LINEAR_CACHE_LAYER] = LinearAttentionStateLayer
STATIC_LAYER_TYPE_MAPPING[LINEAR_CACHE_LAYER] = LinearAttentionStateLayer


class LinearKernel(LayerKernel):
    """The "linear" layer type: softmax replaced by the configured feature map (`linear_feature_map`), every call.

    Its cache layer keeps the running state, not keys/values, so the kernel reads and writes it itself.
    """

    keeps_cache = True

    def build(self, attention: nn.Module) -> None:
        config = attention.config
        if config.linear_feature_map == "performer":
            # Random features are part of the function: a persistent buffer, saved with the weights.
            attention.register_buffer("random_features", torch.empty(attention.head_dim, config.linear_num_features))

    def init_weights(self, attention: nn.Module) -> None:
        if hasattr(attention, "random_features"):
            init.copy_(attention.random_features, draw_random_features(attention.random_features))

    def features(self, attention: nn.Module, states: torch.Tensor, is_query: bool) -> torch.Tensor:
        """(B, H, T, D) -> (B, H, T, m) feature-mapped queries or keys."""
        if attention.config.linear_feature_map == "performer":
            return performer_feature_map(states.float(), attention.random_features.float(), is_query)
        return elu_feature_map(states)

    def attend(self, attention, query, key, value, padding_mask, cache, plan):
        layer_idx = attention.layer_idx
        layer = cache.layers[layer_idx] if cache is not None and len(cache.layers) > layer_idx else None
        if cache is not None and not isinstance(layer, LinearAttentionStateLayer):
            raise ValueError(
                "This layer is linear attention, which caches a running state: build the cache from the config "
                "(DynamicCache(config=model.config) or StaticCache(config=model.config, ...)) or let generate() do it."
            )
        if plan.output_attentions and layer is not None and layer.get_seq_length():
            raise ValueError(
                "output_attentions=True with a cached 'linear' layer: its cache keeps a running state, not the past "
                "keys, so the probabilities over earlier tokens no longer exist. Request attentions on a forward "
                "without a cache (use_cache=False), or on the prefill only."
            )
        key_features = self.features(attention, key, is_query=False)
        if padding_mask is not None:
            new_tokens = padding_mask[:, -key.shape[2] :]  # (B, T): the mask also covers cached tokens
            key_features = key_features * new_tokens[:, None, :, None].to(key_features.dtype)
        output, state = linear_attention(
            self.features(attention, query, is_query=True),
            key_features,
            value,
            causal=attention.is_causal,
            state=layer.state if layer is not None else None,
            documents=plan.documents,
        )
        if layer is not None:
            layer.record(key_features, value)
            layer.update_state(state, key.shape[2])
        return output

    def probabilities(self, attention, query, key, plan):
        """φ(q)·φ(k) / Σ φ(q)·φ(k) over the visible keys, which the O(L) form never forms."""
        padding_mask = plan.mask
        query_features = self.features(attention, query, is_query=True).float()  # (B, H, T, m)
        key_features = self.features(attention, key, is_query=False).float()  # (B, H, S, m)
        similarity = query_features @ key_features.transpose(2, 3)  # (B, H, T, S)
        length, keys = similarity.shape[-2:]
        visible = torch.ones(length, keys, dtype=torch.bool, device=query.device)
        if attention.is_causal:
            visible = visible.tril(keys - length)  # (T, S): query t sees keys up to its own position
        visible = visible[None, None]
        if padding_mask is not None:
            visible = visible & padding_mask[:, None, None, -keys:].bool()
        if plan.documents is not None:  # packed rows: no cache, so keys and queries are the same tokens
            visible = visible & (plan.documents[:, None, :, None] == plan.documents[:, None, None, :])
        similarity = similarity * visible
        return (similarity / similarity.sum(-1, keepdim=True).clamp_min(1e-6)).to(query.dtype)


def draw_random_features(features: torch.Tensor) -> torch.Tensor:
    """Orthogonal Gaussian features (Performer's ORF variant) shaped and typed like `features`, (head_dim, m)."""
    head_dim, count = features.shape
    num_blocks = -(-count // head_dim)
    blocks = [torch.linalg.qr(torch.randn(head_dim, head_dim))[0] for _ in range(num_blocks)]
    norms = torch.randn(count, head_dim).norm(dim=-1)  # chi-distributed row norms, as for Gaussian rows
    return (torch.cat(blocks, dim=1)[:, :count] * norms).to(features.dtype)
