"""Differential attention (Ye et al. 2024, "Differential Transformer", eq. 1-3), laid out as transformers' DiffLlama.

Each differential head i pairs two query heads, i and i + H/2, with two key heads, g and g + H_kv/2 (g = i's group),
and reads one value twice as wide, [v_g, v_{g + H_kv/2}] (2D):

    query heads   q_0 ... q_{H/2-1} | q_{H/2} ... q_{H-1}       first maps | second maps
    key heads     k_0 ... k_{H_kv/2-1} | k_{H_kv/2} ... k_{H_kv-1}
    values        every query head reads [v_g, v_{g + H_kv/2}] of its pair's group g (2D wide)

    head_i = (1 - λ_init) · RMSNorm( softmax(q_i k_gᵀ/√D) [v] - λ · softmax(q_{i+H/2} k_{g+H_kv/2}ᵀ/√D) [v] )
    λ      = exp(λ_q1 · λ_k1) - exp(λ_q2 · λ_k2) + λ_init,   λ_init = 0.8 - 0.6 · exp(-0.3 · layer index)

The softmaxes are the configured backend's (eager, sdpa, flex_attention): `project` widens the values to 2D, the
backend attends as for any layer, and `combine` subtracts the second half of the heads from the first, normalises each
(B, T, H/2, 2D) head (RMSNorm without weight, `layer_norm_eps`) and scales it. The cache holds the plain keys and
values. Flash attention is refused (its kernels need values as wide as the keys).
"""

import math
from typing import Any

import torch
from torch import nn
from transformers.utils.generic import is_flash_attention_requested

from .layer_kernel import LayerKernel

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def lambda_init(layer_idx: int) -> float:
    """λ_init of the layer at 0-based `layer_idx` (Ye et al. 2024, sec. 2.1; DiffLlama's `lambda_init_fn`)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


class DifferentialKernel(LayerKernel):
    """The "differential" layer type: λ's vectors as parameters, values widened, the two maps' outputs combined."""

    cached_keys = True  # it runs while decoding too, over every cached key

    def build(self, attention: Any) -> None:
        # Checkpoint keys `self_attn.lambda_q1` ..., DiffLlama's names.
        for name in LAMBDAS:
            setattr(attention, name, nn.Parameter(torch.empty(attention.head_dim)))
        attention.lambda_init = lambda_init(attention.layer_idx)

    def init_weights(self, attention: Any) -> None:
        for name in LAMBDAS:
            nn.init.normal_(getattr(attention, name), 0.0, attention.config.lambda_std_dev)

    def project(self, attention: Any, key: Any, value: Any, padding_mask: Any) -> tuple[Any, Any, Any]:
        """(B, H_kv, S, D) values -> (B, H_kv, S, 2D): key head j reads [v_m, v_{m + H_kv/2}], m = j mod H_kv/2."""
        implementation = attention.config._attn_implementation
        if is_flash_attention_requested(requested_attention_implementation=implementation):
            raise ValueError(
                f"'differential' layers attend to values twice as wide as their keys, which {implementation} does "
                f"not take: use attn_implementation='sdpa', 'flex_attention' or 'eager'."
            )
        first, second = value.chunk(2, dim=1)  # (B, H_kv/2, S, D) each
        wide = torch.cat([first, second], dim=-1)  # (B, H_kv/2, S, 2D)
        return key, wide.repeat(1, 2, 1, 1), padding_mask  # (B, H_kv, S, 2D)

    def combine(self, attention: Any, output: Any) -> Any:
        """(B, T, H, 2D) per-query-head outputs -> (B, T, H, D): the H/2 differential heads of 2D, laid out flat."""
        if output.shape[2] != attention.num_heads:  # tensor parallelism: this rank holds a slice of the heads
            raise ValueError(
                f"'differential' layers pair query head i with head i + {attention.num_heads // 2} (and the key "
                f"heads alike), which tensor parallelism splits across ranks ({output.shape[2]} of "
                f"{attention.num_heads} heads here): load the model without tp_plan, or use 'full' layers."
            )
        first, second = output.chunk(2, dim=2)  # (B, T, H/2, 2D) each: the first and the second maps
        lam = self.lam(attention, output.dtype)
        heads = first - lam * second  # (B, T, H/2, 2D)
        heads = nn.functional.rms_norm(heads, (heads.shape[-1],), eps=attention.config.layer_norm_eps)
        heads = (1 - attention.lambda_init) * heads
        return heads.reshape(*output.shape[:3], attention.head_dim)  # (B, T, H/2, 2D) -> (B, T, H, D)

    @staticmethod
    def lam(attention: Any, dtype: torch.dtype) -> torch.Tensor:
        """λ = exp(λ_q1 · λ_k1) - exp(λ_q2 · λ_k2) + λ_init, a scalar: each product summed in fp32, as DiffLlama."""
        first = torch.exp(torch.sum(attention.lambda_q1 * attention.lambda_k1, dtype=torch.float32)).to(dtype)
        second = torch.exp(torch.sum(attention.lambda_q2 * attention.lambda_k2, dtype=torch.float32)).to(dtype)
        return first - second + attention.lambda_init
