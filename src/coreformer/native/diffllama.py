"""DiffLlama <-> coreformer decoder: Llama (llama.py) whose every layer is differential attention (Ye et al. 2024).

    DiffLlama{Model,ForCausalLM,ForSequenceClassification,ForTokenClassification}
        -> the CoreformerDecoder heads of the same task, every layer "differential" (differential_attention.py)

Llama's weight names, plus each layer's λ vectors under the same names on both sides (`self_attn.lambda_q1`,
`lambda_k1`, `lambda_q2`, `lambda_k2`); DiffLlama's per-head RMSNorm has no weight and uses `rms_norm_eps`, which is
coreformer's `layer_norm_eps` too. DiffLlama has no MLP biases and no attention dropout (it refuses both).
"""

from transformers import DiffLlamaConfig, PreTrainedConfig, PreTrainedModel

from ..configuration_coreformer import CoreformerConfig, CoreformerDecoderConfig
from .requirements import DECODER_POOLING, NO_TOKEN_TYPES, Requirement, all_layers, equals
from .rotary_decoders import llama_architecture, read_llama_config, written_llama_fields


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerDecoderConfig:
    config = model.config
    layer_types = ["differential"] * config.num_hidden_layers
    return read_llama_config(model, "DiffLlama", layer_types=layer_types, lambda_std_dev=config.lambda_std_dev)


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    return DiffLlamaConfig(
        **written_llama_fields(config),
        head_dim=config.head_dim,
        attention_bias=config.attention_bias,
        lambda_std_dev=config.lambda_std_dev,
    )


DIFFLLAMA = llama_architecture(
    "diffllama",
    "DiffLlama",
    "DiffLlama",
    read_config=read_config,
    write_config=write_config,
    requirements=(
        equals("mlp_bias", False, "DiffLlama has no MLP biases"),
        equals("attention_dropout", 0.0, "DiffLlama has no attention dropout"),
        NO_TOKEN_TYPES,
        Requirement("layer_types", all_layers("differential"), "DiffLlama's every layer is differential attention"),
        DECODER_POOLING,
    ),
    extra_rules=((r"layers\.(\d+)\.self_attn\.(lambda_[qk][12])", r"decoder.layers.\1.self_attn.\2"),),
)
