"""Sigmoid attention (Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid Self-Attention"): each
visible key weighted alone, with no normalisation over the keys:

    weights = sigmoid(Q Kᵀ / sqrt(d) + b) ⊙ visible,   b = -log n,   output = weights V

n is `config.sigmoid_length` (default `max_position_embeddings`): a constant, as the paper trains its language
models (b = -log n set once from the training sequence length; the authors' released language-model configurations
set a constant bias too), rather than the number of keys each query sees. A constant bias weights every key by its
score alone, so a token's output never depends on how many keys the row holds: a decoder's cached and uncached
forwards agree, padding changes nothing, and a packed document gets what it gets alone. (With n = the keys each
query sees, the first token of a causal row would get bias 0 and the last -log T: a bias that moves as the cache
grows, and a decoder trained on long rows would meet other biases on short prompts.)

No attention backend computes a sigmoid in place of its softmax, so this kernel computes the dense form under every
backend, reading the mask in eager's additive form (`LayerType.eager_mask`: causality, padding, documents, a static
cache's empty slots), where a masked score is the dtype's minimum and its sigmoid exactly 0.
"""

import math
from typing import Any

import torch
from torch import nn

from .layer_kernel import LayerKernel


class SigmoidKernel(LayerKernel):
    """The "sigmoid" layer type: dense sigmoid weights over every cached key."""

    cached_keys = True  # it runs while decoding too, over every cached key

    def probabilities(self, attention: Any, query: Any, key: Any, plan: Any) -> Any:
        return sigmoid_weights(attention, query, key, plan.mask)

    def attend(self, attention: Any, query: Any, key: Any, value: Any, mask: Any, cache: Any, plan: Any) -> Any:
        weights = sigmoid_weights(attention, query, key, mask)  # (B, H, T, S)
        weights = nn.functional.dropout(weights, p=attention.attention_dropout, training=attention.training)
        return torch.matmul(weights, value).transpose(1, 2)  # (B, H, T, D) -> (B, T, H, D)


def sigmoid_bias(config: Any) -> float:
    """b = -log n, n = `sigmoid_length` (or `max_position_embeddings`)."""
    length = config.sigmoid_length if config.sigmoid_length is not None else config.max_position_embeddings
    return -math.log(length)


def sigmoid_weights(attention: Any, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, H, T, D) queries, (B, H, S, D) keys, the eager-form additive mask broadcastable to (B, H, T, S) (None:
    every key visible) -> (B, H, T, S) weights in the query's dtype, computed in fp32 as eager's softmax is."""
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * attention.scaling  # (B, H, T, S)
    scores = scores + sigmoid_bias(attention.config)
    if mask is not None:
        scores = scores + mask  # the dtype's minimum at masked keys: their sigmoid is exactly 0
    return torch.sigmoid(scores).to(query.dtype)
