"""Linear attention ("linear" layers): softmax replaced by a kernel feature map, O(L) time and an O(1) decode state.

feature maps     elu(x) + 1 (Katharopoulos et al. 2020), FAVOR+ positive random features (Performer)
linear_attention φ(Q) (φ(K)ᵀ [V, 1]) normalised, chunked when causal, returning the running state
LinearAttentionStateLayer   the cache layer that keeps that state (registered with transformers' caches)
"""

import math

import torch
from torch import nn
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING, CacheLayerMixin

# The cache layer type under which transformers' caches build a `LinearAttentionStateLayer`.
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
DYNAMIC_LAYER_TYPE_MAPPING[LINEAR_CACHE_LAYER] = LinearAttentionStateLayer
STATIC_LAYER_TYPE_MAPPING[LINEAR_CACHE_LAYER] = LinearAttentionStateLayer
