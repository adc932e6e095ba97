"""Llama <-> coreformer decoder: rotary positions, RMSNorm pre-norm blocks with a final norm, gated MLP,
grouped-query attention, optional attention and MLP biases, every layer full attention.

    LlamaModel                              CoreformerDecoderModel
    LlamaForCausalLM                        CoreformerDecoderForCausalLM
    LlamaForSequenceClassification          CoreformerDecoderForSequenceClassification (score -> classifier.out_proj)
    LlamaForTokenClassification             CoreformerDecoderForTokenClassification (score -> classifier)

The weight names, heads and block requirements are the Llama family's (rotary_decoders.py); scaled rotary variants
(linear, dynamic, YaRN, Llama 3) are refused.
"""

from transformers import LlamaConfig, PreTrainedConfig, PreTrainedModel

from ..configuration_coreformer import CoreformerConfig, CoreformerDecoderConfig
from .requirements import DECODER_COMMON
from .rotary_decoders import llama_architecture, read_llama_config, written_llama_fields


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerDecoderConfig:
    return read_llama_config(model, "Llama")


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    return LlamaConfig(
        **written_llama_fields(config),
        head_dim=config.head_dim,
        attention_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
    )


LLAMA = llama_architecture(
    "llama", "Llama", "Llama", read_config=read_config, write_config=write_config, requirements=DECODER_COMMON
)
