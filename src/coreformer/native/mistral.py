"""Mistral <-> coreformer decoder: Llama (llama.py) without biases, every layer sliding when `sliding_window` is set.

    Mistral{Model,ForCausalLM,ForSequenceClassification,ForTokenClassification}
        -> the CoreformerDecoder heads of the same task (see llama.py)

transformers' window counts the query itself, coreformer's `sliding_window` the keys before it: one less.
"""

from transformers import MistralConfig, PreTrainedConfig, PreTrainedModel

from ..configuration_coreformer import CoreformerConfig, CoreformerDecoderConfig
from .requirements import DECODER_POOLING, NO_TOKEN_TYPES, Requirement, all_layers, equals
from .rotary_decoders import (
    llama_architecture,
    read_llama_config,
    sliding_fields,
    transformers_window,
    written_llama_fields,
)


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerDecoderConfig:
    config = model.config
    layers = ["sliding_attention" if config.sliding_window is not None else "full_attention"] * config.num_hidden_layers
    return read_llama_config(model, "Mistral", **sliding_fields(config, layers))


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    return MistralConfig(
        **written_llama_fields(config), head_dim=config.head_dim, sliding_window=transformers_window(config)
    )


MISTRAL = llama_architecture(
    "mistral",
    "Mistral",
    "Mistral",
    read_config=read_config,
    write_config=write_config,
    requirements=(
        equals("attention_bias", False, "Mistral has no attention biases"),
        equals("mlp_bias", False, "Mistral has no MLP biases"),
        NO_TOKEN_TYPES,
        Requirement("layer_types", all_layers("sliding"), "Mistral slides the window on every layer"),
        DECODER_POOLING,
    ),
)
