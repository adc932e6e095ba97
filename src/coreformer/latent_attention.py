"""Multi-head latent attention (DeepSeek-AI 2024, DeepSeek-V2 sec. 2.1; laid out as transformers' DeepseekV3Attention):
keys and values expanded from a small latent per token, which is what the cache holds.

    x ──kv_a_proj_with_mqa──> [ latent (kv_lora_rank) | k_rot (head_dim) ]      one per token: what the cache holds
           latent ──kv_a_layernorm──kv_b_proj──> per head [ k_nope (qk_nope_head_dim) | v (v_head_dim) ]
           key_h = [ k_nope_h | rope(k_rot) ]        the rotary key shared by every head
    x ──q_proj (or q_a_proj, q_a_layernorm, q_b_proj)──> per head [ q_nope | q_rot ]
           query_h = [ q_nope_h | rope(q_rot_h) ]
    out = o_proj( softmax(query keyᵀ / sqrt(qk_nope_head_dim + head_dim)) v )

Under sdpa the values are padded with zero columns to the keys' width, so that torch's fused kernels run (narrower
values fall back to a kernel holding every score), and the padding is dropped from the output (`combine`), as
transformers pads DeepSeek's values for flash attention.

`head_dim` is the rotary part of a head (DeepSeek-V3's `qk_rope_head_dim`, which its config also calls head_dim), so
the stack's rotary table serves these layers as any other. The kernel computes the queries and the latents from the
layer input (`inputs`); the core caches the latents as a layer's keys and values, (B, 1, S, kv_lora_rank) and
(B, 1, S, head_dim), in transformers' own dynamic and static cache layers; `project` expands every cached latent into
the keys and values the configured backend (eager, sdpa, flex_attention) attends to. Per token the cache holds
kv_lora_rank + head_dim numbers, against 2 · num_key_value_heads · head_dim for a full layer.

The two latent norms are RMSNorms with DeepSeek-V3's eps, 1e-6, whatever `layer_norm_eps` is.
"""

from typing import Any

import torch
from torch import nn
from transformers.utils.generic import is_flash_attention_requested

from .layer_kernel import LayerKernel

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which its attention's latent norms keep


class LatentKernel(LayerKernel):
    """The "mla" layer type: DeepSeek-V3's projections, the latents cached, keys and values expanded per call."""

    cached_keys = True  # it runs while decoding too, over every cached latent

    def build(self, attention: Any) -> None:
        config = attention.config
        hidden, heads, bias = config.hidden_size, attention.num_heads, config.attention_bias
        attention.rope_dim = attention.head_dim
        attention.nope_dim = config.qk_nope_head_dim or attention.head_dim
        attention.value_dim = config.v_head_dim or attention.nope_dim
        attention.latent_dim = config.kv_lora_rank
        query_dim = attention.nope_dim + attention.rope_dim
        # Checkpoint keys `self_attn.q_a_proj` ..., DeepSeek-V3's names; the core's k/v projections are not used.
        attention.k_proj = attention.v_proj = None
        if config.q_lora_rank is None:
            attention.q_proj = nn.Linear(hidden, heads * query_dim, bias=False)
        else:
            attention.q_proj = None
            attention.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            attention.q_a_layernorm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            attention.q_b_proj = nn.Linear(config.q_lora_rank, heads * query_dim, bias=False)
        attention.kv_a_proj_with_mqa = nn.Linear(hidden, attention.latent_dim + attention.rope_dim, bias=bias)
        attention.kv_a_layernorm = nn.RMSNorm(attention.latent_dim, eps=LATENT_NORM_EPS)
        attention.kv_b_proj = nn.Linear(
            attention.latent_dim, heads * (attention.nope_dim + attention.value_dim), bias=False
        )
        attention.o_proj = nn.Linear(heads * attention.value_dim, hidden, bias=bias)
        attention.num_key_value_groups = 1  # every query head has its own expanded key and value
        attention.scaling = query_dim**-0.5

    def inputs(self, attention: Any, hidden_states: Any, plan: Any, rotary: Any) -> tuple[Any, Any, Any]:
        """The layer input -> (B, H, T, nope + rope) queries, the (B, 1, S, kv_lora_rank) latents and the
        (B, 1, S, head_dim) rotary keys, the last two for the cache."""
        if attention.q_proj is not None:
            query = attention.q_proj(hidden_states)
        else:
            query = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(hidden_states)))
        query = heads_first(query.unflatten(-1, (-1, attention.nope_dim + attention.rope_dim)), plan)  # (B, H, T, ·)
        if query.shape[1] != attention.num_heads:  # tensor parallelism split q_proj but not the latents
            raise ValueError(
                f"'mla' layers expand every head's keys from one latent, which tensor parallelism does not split "
                f"({query.shape[1]} of {attention.num_heads} query heads here): load the model without tp_plan, or "
                f"use 'full' layers."
            )
        compressed = attention.kv_a_proj_with_mqa(hidden_states)  # (..., kv_lora_rank + head_dim)
        latent, key_rot = compressed.split((attention.latent_dim, attention.rope_dim), dim=-1)
        latent = heads_first(attention.kv_a_layernorm(latent).unsqueeze(-2), plan)  # (B, 1, S, kv_lora_rank)
        key_rot = heads_first(key_rot.unsqueeze(-2), plan)  # (B, 1, S, head_dim): one key for every head
        query_nope, query_rot = query.split((attention.nope_dim, attention.rope_dim), dim=-1)
        if plan.position_embeddings is not None:
            query_rot, key_rot = rotary(query_rot, key_rot, *plan.position_embeddings)
        return torch.cat([query_nope, query_rot], dim=-1), latent, key_rot

    def project(self, attention: Any, key: Any, value: Any, padding_mask: Any) -> tuple[Any, Any, Any]:
        """The cached (B, 1, S, kv_lora_rank) latents and (B, 1, S, head_dim) rotary keys -> (B, H, S, nope + rope)
        keys and (B, H, S, v_head_dim) values."""
        implementation = attention.config._attn_implementation
        if is_flash_attention_requested(requested_attention_implementation=implementation):
            raise ValueError(
                f"'mla' layers attend with values of another width than their keys, which {implementation} does not "
                f"take: use attn_implementation='sdpa', 'flex_attention' or 'eager'."
            )
        latent, key_rot = key, value
        expanded = attention.kv_b_proj(latent.squeeze(1))  # (B, S, H * (nope + v))
        heads = expanded.shape[-1] // (attention.nope_dim + attention.value_dim)
        expanded = expanded.unflatten(-1, (heads, -1)).transpose(1, 2)  # (B, H, S, nope + v)
        key_nope, value = expanded.split((attention.nope_dim, attention.value_dim), dim=-1)
        key = torch.cat([key_nope, key_rot.expand(-1, heads, -1, -1)], dim=-1)  # (B, H, S, nope + rope)
        if implementation == "sdpa" and value.shape[-1] < key.shape[-1]:
            # torch's fused sdpa kernels take values as wide as the keys; narrower ones fall back to the math kernel,
            # which holds the (B, H, T, S) scores (2.6 GB against 20 MB at 8,192 tokens, 4 heads of 128). Zero columns
            # added to each value give zero output columns, which `combine` drops: the same output.
            value = nn.functional.pad(value, (0, key.shape[-1] - value.shape[-1]))  # (B, H, S, nope + rope)
        return key, value, padding_mask

    def combine(self, attention: Any, output: Any) -> Any:
        """(B, T, H, ·) -> (B, T, H, v_head_dim): the zero columns `project` gave the values dropped."""
        return output[..., : attention.value_dim]


def heads_first(states: torch.Tensor, plan: Any) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, T, D); the unpadded (N, H, D) real tokens of `plan.unpadding` are padded first."""
    if plan.unpadding is not None:
        states = plan.unpadding.pad(states)  # (N, H, D) -> (B, L, H, D)
    return states.transpose(1, 2)
