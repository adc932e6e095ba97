"""Qwen3-Next (dense) <-> coreformer decoder: Llama's block (llama.py) with Gated DeltaNet layers beside gated,
QK-normed full attention layers.

    Qwen3Next{Model,ForCausalLM,ForSequenceClassification,ForTokenClassification}
        -> the CoreformerDecoder heads of the same task: "linear_attention" layers are "gated_deltanet"
           (gated_deltanet.py), "full_attention" layers "full" with attention_gate="elementwise" and qk_norm

What differs from Llama's layout, each converted exactly:

    native                                        coreformer
    layers.i.linear_attn.in_proj_qkvz             self_attn.in_proj_qkv, in_proj_z   rows regrouped (below)
    layers.i.linear_attn.in_proj_ba               self_attn.in_proj_b, in_proj_a
    layers.i.linear_attn.{conv1d,dt_bias,A_log,norm}   self_attn.{...}               the same
    layers.i.linear_attn.out_proj                 self_attn.o_proj
    every Qwen3NextRMSNorm weight w (layers' input / post-attention norms, q_norm, k_norm, the final norm)
                                                  1 + w: it computes x̂ · (1 + w) in fp32, as coreformer's x̂ · w'

Qwen3-Next lays its fused projections out per key head g, [q_g | k_g | v_g | z_g] and [b_g | a_g], each v_g, z_g, b_g
and a_g holding that key head's H_v / H_k value heads; coreformer keeps all queries, then all keys, then all values
(`in_proj_qkv`, as Qwen3.5 splits them) and z, b, a apart. Only the dense configuration converts (no experts, or every
layer in `mlp_only_layers`); mixture-of-experts layers are refused. Its rotary positions turn the first
`partial_rotary_factor` of each head (a quarter by default), coreformer's field of the same name.
"""

import re

import torch
from transformers import PreTrainedConfig, PreTrainedModel, Qwen3NextConfig

from ..configuration_coreformer import CoreformerConfig, CoreformerDecoderConfig
from .base import StateDict, unsupported
from .requirements import DECODER_POOLING, NO_TOKEN_TYPES, Requirement, all_layers, equals
from .rotary_decoders import llama_architecture, read_llama_config, written_llama_fields

QWEN3_NEXT_LAYER_TYPES = {"linear_attention": "gated_deltanet", "full_attention": "full"}  # its names -> ours
WRITTEN_LAYER_TYPES = {ours: theirs for theirs, ours in QWEN3_NEXT_LAYER_TYPES.items()}
# Qwen3NextRMSNorm weights, which scale by 1 + w.
OFFSET_NORM = re.compile(
    r"((model\.)?norm|(.*\.)?layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm))\.weight"
)
FUSED = re.compile(r"(.*\.linear_attn\.)in_proj_(qkvz|ba)\.weight")
MIXER_PARTS = "in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|conv1d|norm"


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerDecoderConfig:
    config = model.config
    experts = [i for i in range(config.num_hidden_layers) if i not in config.mlp_only_layers]
    if config.num_experts and experts:
        raise unsupported(
            "Qwen3-Next",
            f"num_experts={config.num_experts} on layers {experts}",
            "(mixture-of-experts MLPs; the dense configuration, num_experts=0 or every layer in mlp_only_layers, "
            "converts)",
        )
    unknown = sorted(set(config.layer_types) - set(QWEN3_NEXT_LAYER_TYPES))
    if unknown:
        raise unsupported("Qwen3-Next", f"layer_types with {unknown}", "(token mixers)")
    rope = dict(config.rope_parameters or {})
    return read_llama_config(
        model,
        "Qwen3-Next",
        layer_types=[QWEN3_NEXT_LAYER_TYPES[kind] for kind in config.layer_types],
        attention_gate="elementwise",
        qk_norm=True,
        partial_rotary_factor=rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)),
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        mlp_bias=False,
    )


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    written = written_llama_fields(config)
    written["rope_parameters"] |= {"partial_rotary_factor": config.partial_rotary_factor}
    sizes = config.gated_deltanet_sizes()
    return Qwen3NextConfig(
        **written,
        head_dim=config.head_dim,
        attention_bias=config.attention_bias,
        layer_types=[WRITTEN_LAYER_TYPES[kind] for kind in config.layer_types],
        linear_num_key_heads=sizes["key_heads"],
        linear_num_value_heads=sizes["value_heads"],
        linear_key_head_dim=sizes["key_dim"],
        linear_value_head_dim=sizes["value_dim"],
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        num_experts=0,  # every MLP dense
    )


def mixer_sizes(config: PreTrainedConfig) -> tuple[int, int, int, int]:
    """(key heads, value heads per key head, key width, value width) of Qwen3-Next's linear layers."""
    key_heads = config.linear_num_key_heads
    return (
        key_heads,
        config.linear_num_value_heads // key_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )


def prepare_weights(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """Qwen3-Next's layout -> coreformer's (the module docstring's table), under native names."""
    key_heads, group, key_dim, value_dim = mixer_sizes(model.config)
    prepared: StateDict = {}
    for name, tensor in state_dict.items():
        fused = FUSED.fullmatch(name)
        if fused is not None and fused[2] == "qkvz":
            per_key_head = tensor.unflatten(0, (key_heads, -1))  # (H_k, 2 D_k + 2 G D_v, hidden)
            q, k, v, z = per_key_head.split((key_dim, key_dim, group * value_dim, group * value_dim), dim=1)
            prepared[f"{fused[1]}in_proj_qkv.weight"] = torch.cat([x.flatten(0, 1) for x in (q, k, v)])
            prepared[f"{fused[1]}in_proj_z.weight"] = z.flatten(0, 1)
        elif fused is not None:
            b, a = tensor.unflatten(0, (key_heads, 2 * group)).split((group, group), dim=1)  # (H_k, G, hidden) each
            prepared[f"{fused[1]}in_proj_b.weight"], prepared[f"{fused[1]}in_proj_a.weight"] = (
                b.flatten(0, 1),
                a.flatten(0, 1),
            )
        elif OFFSET_NORM.fullmatch(name) is not None:
            prepared[name] = 1 + tensor
        else:
            prepared[name] = tensor
    return prepared


def restore_weights(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """The inverse of `prepare_weights`: coreformer's layout, under native names -> Qwen3-Next's."""
    key_heads, group, key_dim, value_dim = mixer_sizes(model.config)
    restored: StateDict = {}
    for name, tensor in state_dict.items():
        split = re.fullmatch(r"(.*\.linear_attn\.)in_proj_(qkv|z|b|a)\.weight", name)
        if split is not None and split[2] == "qkv":
            prefix = split[1]
            q, k, v = tensor.split(
                (key_heads * key_dim, key_heads * key_dim, tensor.shape[0] - 2 * key_heads * key_dim)
            )
            z = state_dict[f"{prefix}in_proj_z.weight"]
            per_key_head = [x.unflatten(0, (key_heads, -1)) for x in (q, k, v, z)]  # (H_k, ·, hidden) each
            restored[f"{prefix}in_proj_qkvz.weight"] = torch.cat(per_key_head, dim=1).flatten(0, 1)
            b, a = (state_dict[f"{prefix}in_proj_{part}.weight"].unflatten(0, (key_heads, group)) for part in "ba")
            restored[f"{prefix}in_proj_ba.weight"] = torch.cat([b, a], dim=1).flatten(0, 1)
        elif split is not None:
            continue  # written with in_proj_qkv
        elif OFFSET_NORM.fullmatch(name) is not None:
            restored[name] = tensor - 1
        else:
            restored[name] = tensor
    return restored


QWEN3_NEXT = llama_architecture(
    "qwen3_next",
    "Qwen3Next",
    "Qwen3-Next",
    read_config=read_config,
    write_config=write_config,
    requirements=(
        equals("mlp_bias", False, "Qwen3-Next has no MLP biases"),
        equals("qk_norm", True, "Qwen3-Next normalises every query and key head"),
        equals("attention_gate", "elementwise", "Qwen3-Next gates every attention channel"),
        NO_TOKEN_TYPES,
        Requirement(
            "layer_types",
            all_layers("gated_deltanet", "full"),
            "Qwen3-Next's layers are Gated DeltaNet and full attention",
        ),
        DECODER_POOLING,
    ),
    attention_options=("qk_norm", "attention_gate", "partial_rotary_factor"),
    prepare_weights=prepare_weights,
    restore_weights=restore_weights,
    extra_rules=(
        (r"layers\.(\d+)\.self_attn\.([qk]_norm)\.weight", r"decoder.layers.\1.self_attn.\2.weight"),
        (rf"layers\.(\d+)\.linear_attn\.({MIXER_PARTS})\.weight", r"decoder.layers.\1.self_attn.\2.weight"),
        (r"layers\.(\d+)\.linear_attn\.(dt_bias|A_log)", r"decoder.layers.\1.self_attn.\2"),
        (r"layers\.(\d+)\.linear_attn\.out_proj\.weight", r"decoder.layers.\1.self_attn.o_proj.weight"),
    ),
)
