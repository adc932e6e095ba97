"""DeepSeek-V3 (dense) <-> coreformer decoder: Llama's block (llama.py) whose every layer is multi-head latent
attention ("mla", latent_attention.py).

    DeepseekV3{Model,ForCausalLM,ForSequenceClassification,ForTokenClassification}
        -> the CoreformerDecoder heads of the same task, every layer "mla"

Llama's weight names, plus each layer's latent projections under the same names on both sides (`self_attn.q_a_proj`,
`q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`). Only the dense configuration
converts: every layer's MLP dense (`first_k_dense_replace` >= `num_hidden_layers`); mixture-of-experts layers are
refused. DeepSeek-V3's `qk_rope_head_dim` is coreformer's `head_dim`. Its interleaved rotary layout
(`rope_interleave=True`, the default) rotates channel pairs (0, 1), (2, 3), ...; reading reorders those rows of the
query and key projections (evens, then odds), after which the usual rotary halves compute the same scores; exports
are written with `rope_interleave=False`.
"""

import re

import torch
from transformers import DeepseekV3Config, PreTrainedConfig, PreTrainedModel

from ..configuration_coreformer import CoreformerConfig, CoreformerDecoderConfig
from .base import WB, StateDict, unsupported
from .requirements import DECODER_POOLING, NO_TOKEN_TYPES, Requirement, all_layers, equals
from .rotary_decoders import llama_architecture, read_llama_config, written_llama_fields

LATENT_PROJECTIONS = "q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj"


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerDecoderConfig:
    config = model.config
    if (config.first_k_dense_replace or 0) < config.num_hidden_layers:
        raise unsupported(
            "DeepSeek-V3",
            f"first_k_dense_replace={config.first_k_dense_replace} < num_hidden_layers={config.num_hidden_layers}",
            "(mixture-of-experts MLPs; the dense configuration converts)",
        )
    return read_llama_config(
        model,
        "DeepSeek-V3",
        layer_types=["mla"] * config.num_hidden_layers,
        num_key_value_heads=config.num_attention_heads,  # every head expands its own keys from the latent
        head_dim=config.qk_rope_head_dim,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        v_head_dim=config.v_head_dim,
        mlp_bias=False,
    )


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    nope = config.qk_nope_head_dim or config.head_dim
    return DeepseekV3Config(
        **written_llama_fields(config),
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank,
        qk_rope_head_dim=config.head_dim,
        qk_nope_head_dim=nope,
        v_head_dim=config.v_head_dim or nope,
        first_k_dense_replace=config.num_hidden_layers,  # every MLP dense
        rope_interleave=False,
        attention_bias=config.attention_bias,
    )


def deinterleaved(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """Projection rows of interleaved rotary pairs along `dim` -> the same rows, even ones first, then odd ones: what
    `apply_rotary_pos_emb_interleave` does to the projected channels before rotating them by halves."""
    rotary = rows.shape[dim]
    order = torch.cat([torch.arange(0, rotary, 2), torch.arange(1, rotary, 2)]).to(rows.device)
    return rows.index_select(dim, order)


def prepare_weights(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """rope_interleave=True: reorder the rotary rows of the query and key projections (see the module docstring)."""
    config = model.config
    if not config.rope_interleave:
        return state_dict
    nope, rotary = config.qk_nope_head_dim, config.qk_rope_head_dim
    prepared = dict(state_dict)
    for name, tensor in state_dict.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            heads = tensor.unflatten(0, (-1, nope + rotary))  # (H, nope + rope, in)
            heads = torch.cat([heads[:, :nope], deinterleaved(heads[:, nope:], 1)], dim=1)
            prepared[name] = heads.flatten(0, 1)  # (H * (nope + rope), in)
        elif re.search(r"self_attn\.kv_a_proj_with_mqa\.(weight|bias)$", name):
            latent, rope = tensor.split((config.kv_lora_rank, rotary), dim=0)  # rows: latent, then the rotary key
            prepared[name] = torch.cat([latent, deinterleaved(rope, 0)], dim=0)
    return prepared


DEEPSEEK_V3 = llama_architecture(
    "deepseek_v3",
    "DeepseekV3",
    "DeepSeek-V3",
    read_config=read_config,
    write_config=write_config,
    requirements=(
        equals("mlp_bias", False, "DeepSeek-V3 has no MLP biases"),
        NO_TOKEN_TYPES,
        Requirement("layer_types", all_layers("mla"), "DeepSeek-V3's every layer is multi-head latent attention"),
        Requirement(
            "num_key_value_heads",
            lambda value, config: value == config.num_attention_heads,
            "DeepSeek-V3 expands every head's keys from the latent",
        ),
        DECODER_POOLING,
    ),
    prepare_weights=prepare_weights,
    extra_rules=((rf"layers\.(\d+)\.self_attn\.({LATENT_PROJECTIONS})\.{WB}", r"decoder.layers.\1.self_attn.\2.\3"),),
)
