"""GPT-NeoX <-> coreformer decoder: with a sequential residual and rotary positions on whole heads it is a GPT-2
block with rotary positions (the decoder presets): LayerNorm pre-norm with a final norm, biased ungated MLP,
optional attention biases, no embedding norm.

    GPTNeoXModel                            CoreformerDecoderModel
    GPTNeoXForCausalLM                      CoreformerDecoderForCausalLM
    GPTNeoXForSequenceClassification        CoreformerDecoderForSequenceClassification (score -> classifier.out_proj)
    GPTNeoXForTokenClassification           CoreformerDecoderForTokenClassification

Partial rotary (`partial_rotary_factor`, Pythia's 0.25) is coreformer's field of the same name. Refused:
use_parallel_residual=True. The fused query_key_value is laid out per head,
[heads, 3, head_dim] (its forward views the output as (..., heads, 3 * head_dim) and chunks the last dim).
"""

import re

import torch
from transformers import GPTNeoXConfig, PreTrainedConfig, PreTrainedModel

from ..configuration_coreformer import CoreformerConfig, CoreformerDecoderConfig
from .base import (
    SAME_NAME_CLASSIFIER,
    WB,
    NativeArchitecture,
    Rule,
    StateDict,
    classifier_dropout,
    decoder_heads,
    unsupported,
    write_common_fields,
)
from .requirements import (
    DECODER_COMMON,
    equals,
    every_block_normed,
    plain_heads,
    pooled_classifier,
    rotary_layernorm_block,
)
from .rotary_decoders import rotary_decoder_fields

# After `unfuse`: the fused query_key_value split into q/k/v pseudo-names.
BASE_RULES: tuple[Rule, ...] = (
    (r"embed_in\.weight", "decoder.embed_tokens.weight"),
    (rf"layers\.(\d+)\.input_layernorm\.{WB}", r"decoder.layers.\1.self_attn_norm.\2"),
    (rf"layers\.(\d+)\.attention\.([qkv])_proj\.{WB}", r"decoder.layers.\1.self_attn.\2_proj.\3"),
    (rf"layers\.(\d+)\.attention\.dense\.{WB}", r"decoder.layers.\1.self_attn.o_proj.\2"),
    (rf"layers\.(\d+)\.post_attention_layernorm\.{WB}", r"decoder.layers.\1.mlp_norm.\2"),
    (rf"layers\.(\d+)\.mlp\.dense_h_to_4h\.{WB}", r"decoder.layers.\1.mlp.up_proj.\2"),
    (rf"layers\.(\d+)\.mlp\.dense_4h_to_h\.{WB}", r"decoder.layers.\1.mlp.down_proj.\2"),
    (rf"final_layer_norm\.{WB}", r"decoder.norm.\1"),
)


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerDecoderConfig:
    config = model.config
    if config.use_parallel_residual:
        raise unsupported(
            "GPT-NeoX", "use_parallel_residual=True", "(attention and MLP read the same input, added in parallel)"
        )
    rope = dict(config.rope_parameters or {})
    return CoreformerDecoderConfig(
        partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
        **rotary_decoder_fields(config, "GPT-NeoX"),
        norm_type="layernorm",
        layer_norm_eps=config.layer_norm_eps,
        attention_bias=config.attention_bias,
        mlp_bias=True,  # GPTNeoXMLP's two Linear layers always have biases
        hidden_dropout=config.hidden_dropout,
        classifier_dropout=config.classifier_dropout,
    )


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    native = GPTNeoXConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        layer_norm_eps=config.layer_norm_eps,
        use_parallel_residual=False,  # coreformer's blocks add attention, then the MLP reads the sum
        rope_parameters={
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
        attention_bias=config.attention_bias,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        classifier_dropout=classifier_dropout(config),
        initializer_range=config.initializer_range,
        use_cache=config.use_cache,
        **write_common_fields(config),
    )
    # The pre-v5 names of the rotary fields, which transformers 5 no longer writes and llama.cpp's
    # convert_hf_to_gguf.py reads from config.json for GPTNeoXForCausalLM; transformers reads rope_parameters first.
    native.rotary_pct = config.partial_rotary_factor
    native.rotary_emb_base = config.rope_theta
    return native


FUSED_QKV = re.compile(r"(.*\.attention\.)query_key_value\.(weight|bias)")
SPLIT_QKV = re.compile(r"(.*\.attention\.)([qkv])_proj\.(weight|bias)")


def unfuse(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """Split query_key_value's per-head rows [heads, 3, head_dim] into q/k/v pseudo-names of [heads, head_dim]."""
    heads = model.config.num_attention_heads
    unfused = {}
    for name, tensor in state_dict.items():
        match = FUSED_QKV.fullmatch(name)
        if match is None:
            unfused[name] = tensor
            continue
        per_head = tensor.reshape(heads, 3, -1, *tensor.shape[1:])  # (3 * hidden, ...) -> (heads, 3, head_dim, ...)
        for index, part in enumerate("qkv"):
            unfused[f"{match[1]}{part}_proj.{match[2]}"] = per_head[:, index].reshape(-1, *tensor.shape[1:])
    return unfused


def fuse(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """The inverse of `unfuse`: q/k/v rows interleaved per head into query_key_value."""
    heads = model.config.num_attention_heads
    fused = {}
    for name, tensor in state_dict.items():
        match = SPLIT_QKV.fullmatch(name)
        if match is None:
            fused[name] = tensor
            continue
        if match[2] != "q":
            continue  # gathered with q below
        parts = [state_dict[f"{match[1]}{part}_proj.{match[3]}"] for part in "qkv"]
        rest = tensor.shape[1:]
        per_head = torch.stack([part.reshape(heads, -1, *rest) for part in parts], dim=1)  # (heads, 3, head_dim, ...)
        fused[f"{match[1]}query_key_value.{match[3]}"] = per_head.reshape(-1, *rest)  # (3 * hidden, ...)
    return fused


GPT_NEOX = NativeArchitecture(
    name="gpt_neox",
    family="decoder",
    # Its token classifier: a dropout (config.classifier_dropout) and a biased `classifier`, as coreformer's.
    heads=decoder_heads("GPTNeoX", SAME_NAME_CLASSIFIER),
    base_rules=BASE_RULES,
    read_config=read_config,
    write_config=write_config,
    requirements=(
        *every_block_normed("GPT-NeoX"),
        *rotary_layernorm_block("GPT-NeoX", embedding_norm=False, gated=False),
        equals("norm_bias", True, "GPT-NeoX's LayerNorms have biases"),
        equals("mlp_bias", True, "GPT-NeoX has MLP biases"),
        *DECODER_COMMON,
        *plain_heads("GPT-NeoX", lm_transform=False, lm_bias=False),
        *pooled_classifier("GPT-NeoX", dense=False),
    ),
    prepare_weights=unfuse,
    restore_weights=fuse,
    attention_options=("partial_rotary_factor",),
)
