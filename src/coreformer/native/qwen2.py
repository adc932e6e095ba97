"""Qwen2 <-> coreformer decoder: Llama (llama.py) with q/k/v biases and none on o_proj, sliding layers where
`layer_types` says so.

    Qwen2{Model,ForCausalLM,ForSequenceClassification,ForTokenClassification}
        -> the CoreformerDecoder heads of the same task (see llama.py)

coreformer's `attention_bias` covers q, k, v and o. Reading: all-zero q/k/v biases (a model written from coreformer
without biases) are dropped; otherwise o_proj gets a zero bias, which adds nothing (exact, but fine-tuning then trains
it). Writing: only a model without attention biases, whose q/k/v biases are written as zeros.
"""

import re

from transformers import PreTrainedConfig, PreTrainedModel, Qwen2Config

from ..configuration_coreformer import GENERIC_LAYER_TYPES, CoreformerConfig, CoreformerDecoderConfig
from .base import StateDict
from .requirements import DECODER_POOLING, NO_TOKEN_TYPES, Requirement, all_layers, equals, standard_head_dim
from .rotary_decoders import (
    llama_architecture,
    read_llama_config,
    sliding_fields,
    transformers_window,
    written_llama_fields,
)

QKV_BIAS = re.compile(r"(.*\.self_attn\.)([qkv])_proj\.bias")


def biases_are_zero(model: PreTrainedModel) -> bool:
    """Whether every q/k/v bias of a Qwen2 model is zero: then coreformer needs no attention biases at all."""
    return all(not tensor.any() for name, tensor in model.state_dict().items() if QKV_BIAS.fullmatch(name) is not None)


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerDecoderConfig:
    config = model.config
    translated = read_llama_config(model, "Qwen2", **sliding_fields(config, list(config.layer_types)))
    translated.attention_bias = not biases_are_zero(model)
    return translated


def prepare_weights(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """Drop all-zero q/k/v biases, or give o_proj a zero bias (see the module docstring)."""
    if biases_are_zero(model):
        return {name: tensor for name, tensor in state_dict.items() if QKV_BIAS.fullmatch(name) is None}
    prepared = dict(state_dict)
    for name in state_dict:
        match = QKV_BIAS.fullmatch(name)
        if match is not None and match[2] == "q":
            output = state_dict[f"{match[1]}o_proj.weight"]
            prepared[f"{match[1]}o_proj.bias"] = output.new_zeros(output.shape[0])
    return prepared


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    sliding = "sliding" in config.layer_types
    return Qwen2Config(
        **written_llama_fields(config),
        use_sliding_window=sliding,
        sliding_window=transformers_window(config) if sliding else None,
        layer_types=[GENERIC_LAYER_TYPES[layer_type] for layer_type in config.layer_types],
    )


QWEN2 = llama_architecture(
    "qwen2",
    "Qwen2",
    "Qwen2",
    read_config=read_config,
    write_config=write_config,
    requirements=(
        equals("attention_bias", False, "Qwen2's q/k/v biases are written as zeros, and it has no o_proj bias"),
        equals("mlp_bias", False, "Qwen2 has no MLP biases"),
        Requirement("head_dim", standard_head_dim, "Qwen2's heads are hidden_size / num_attention_heads wide"),
        NO_TOKEN_TYPES,
        Requirement("layer_types", all_layers("full", "sliding"), "Qwen2 has full and sliding layers only"),
        DECODER_POOLING,
    ),
    prepare_weights=prepare_weights,
    zero_filled=(r".*\.self_attn\.[qkv]_proj\.bias",),
)
