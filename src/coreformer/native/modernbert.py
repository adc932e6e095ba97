"""ModernBERT <-> coreformer encoder: rotary pre-norm GeGLU blocks without biases, alternating global ("full") and
local ("sliding") layers with a rotary base each, LayerNorms (biases optional) on the embeddings and at the end, no
attention norm in the first layer, and a prediction head (dense -> act -> norm) in front of every head.

    ModernBertModel                         CoreformerEncoderModel
    ModernBertForMaskedLM                   CoreformerEncoderForMaskedLM (head -> lm_head_transform)
    ModernBertFor{Sequence,Token}Class.,    CoreformerEncoderFor... (head -> head_transform, classifier_transform;
    ...ForQuestionAnswering, ...ForMultipleChoice   classifier_pooling "cls" / "mean")

Its local layers see `local_attention // 2` tokens on each side (`ModernBertConfig.sliding_window`), which is
coreformer's `sliding_window`. Dropouts (embedding_dropout, mlp_dropout, the attention output dropout) are
training-time only: coreformer's hidden_dropout takes embedding_dropout. Its multiple-choice head pools the first real
token, coreformer's the first token: the same for right-padded batches. `sparse_prediction` is not kept (the same
loss; logits for every token).

The fused weights: Wqkv is (3 * hidden, hidden) = [q; k; v] (its forward views the output as (..., 3, heads,
head_dim)); Wi is (2 * intermediate, hidden) = [input; gate], and ModernBERT computes act(input) * gate, so `input` is
coreformer's gate_proj (the activated half) and `gate` its up_proj.
"""

import re

import torch
from transformers import ModernBertConfig, PreTrainedConfig, PreTrainedModel

from ..configuration_coreformer import GENERIC_LAYER_TYPES, CoreformerConfig, CoreformerEncoderConfig
from ..modeling_encoder import (
    CoreformerEncoderForMaskedLM,
    CoreformerEncoderForMultipleChoice,
    CoreformerEncoderForQuestionAnswering,
    CoreformerEncoderForSequenceClassification,
    CoreformerEncoderForTokenClassification,
    CoreformerEncoderModel,
)
from .base import (
    SAME_NAME_CLASSIFIER,
    WB,
    HeadConversion,
    NativeArchitecture,
    Rule,
    StateDict,
    check_activation,
    classifier_dropout,
    read_common_fields,
    unsupported,
    write_common_fields,
)
from .requirements import (
    CLASSIFIERS,
    MASKED_LM,
    POOLED_CLASSIFIERS,
    POOLED_ENCODER_HEADS,
    Requirement,
    all_layers,
    equals,
    rotary_layernorm_block,
)

# After `unfuse`: Wqkv split into q/k/v pseudo-names, Wi into gate (the activated half) and up.
BASE_RULES: tuple[Rule, ...] = (
    (r"embeddings\.tok_embeddings\.weight", "encoder.embed_tokens.weight"),
    (rf"embeddings\.norm\.{WB}", r"encoder.embedding_norm.\1"),
    (rf"layers\.(\d+)\.attn_norm\.{WB}", r"encoder.layers.\1.self_attn_norm.\2"),
    (rf"layers\.(\d+)\.attn\.([qkv])_proj\.{WB}", r"encoder.layers.\1.self_attn.\2_proj.\3"),
    (rf"layers\.(\d+)\.attn\.Wo\.{WB}", r"encoder.layers.\1.self_attn.o_proj.\2"),
    (rf"layers\.(\d+)\.mlp_norm\.{WB}", r"encoder.layers.\1.mlp_norm.\2"),
    (rf"layers\.(\d+)\.mlp\.(gate|up)_proj\.{WB}", r"encoder.layers.\1.mlp.\2_proj.\3"),
    (rf"layers\.(\d+)\.mlp\.Wo\.{WB}", r"encoder.layers.\1.mlp.down_proj.\2"),
    (rf"final_norm\.{WB}", r"encoder.norm.\1"),
)

# Every head starts with ModernBERT's prediction head `head` (dense -> act -> norm): the MLM transform, or a
# classifier's `head_transform` (config.classifier_transform); `classifier` is the output projection.
HEAD = ((rf"head\.(dense|norm)\.{WB}", r"head_transform.\1.\2"),)
POOLED_OUTPUT = (rf"classifier\.{WB}", r"classifier.out_proj.\1")
HEADS = {
    "ModernBertModel": HeadConversion(CoreformerEncoderModel),
    "ModernBertForMaskedLM": HeadConversion(
        CoreformerEncoderForMaskedLM,
        ((rf"head\.(dense|norm)\.{WB}", r"lm_head_transform.\1.\2"), (rf"decoder\.{WB}", r"lm_head.\1")),
    ),
    "ModernBertForSequenceClassification": HeadConversion(
        CoreformerEncoderForSequenceClassification, (*HEAD, POOLED_OUTPUT)
    ),
    "ModernBertForTokenClassification": HeadConversion(
        CoreformerEncoderForTokenClassification, (*HEAD, *SAME_NAME_CLASSIFIER)
    ),
    "ModernBertForQuestionAnswering": HeadConversion(
        CoreformerEncoderForQuestionAnswering, (*HEAD, (rf"classifier\.{WB}", r"qa_outputs.\1"))
    ),
    "ModernBertForMultipleChoice": HeadConversion(CoreformerEncoderForMultipleChoice, (*HEAD, POOLED_OUTPUT)),
}

# ModernBERT's layer types -> coreformer's (its `layer_types` rule: global every `global_attn_every_n_layers`).
MODERNBERT_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _rope_thetas(config: PreTrainedConfig) -> tuple[float, float]:
    """(rope_theta of the global layers, of the local layers); scaled rotary variants are refused."""
    thetas = {}
    for kind in dict.fromkeys(config.layer_types):
        rope = dict(config.rope_parameters[kind])
        if rope.get("rope_type", "default") != "default":
            option = f"rope_parameters[{kind!r}].rope_type={rope['rope_type']!r}"
            raise unsupported("ModernBERT", option, "(scaled rotary frequencies)")
        thetas[MODERNBERT_LAYER_TYPES[kind]] = float(rope["rope_theta"])
    rope_theta = thetas.get("full", float(config.rope_parameters["full_attention"]["rope_theta"]))
    return rope_theta, thetas.get("sliding", rope_theta)


def _layer_types(config: PreTrainedConfig) -> list[str]:
    unknown = sorted(set(config.layer_types) - set(MODERNBERT_LAYER_TYPES))
    if unknown:
        raise unsupported("ModernBERT", f"layer_types with {unknown}", "(attention types)")
    return [MODERNBERT_LAYER_TYPES[kind] for kind in config.layer_types]


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerEncoderConfig:
    config = model.config
    hidden_act = check_activation("ModernBERT", config.hidden_activation)
    if config.classifier_activation != hidden_act:
        raise unsupported(
            "ModernBERT",
            f"classifier_activation={config.classifier_activation!r} != hidden_activation={hidden_act!r}",
            "(coreformer's head transforms use hidden_act)",
        )
    layer_types = _layer_types(config)
    rope_theta, local_rope_theta = _rope_thetas(config)
    return CoreformerEncoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=hidden_act,
        gated_mlp=True,  # Wi -> (input, gate): act(input) * gate, GeGLU with gelu
        max_position_embeddings=config.max_position_embeddings,
        position_embedding_type="rotary",
        rope_theta=rope_theta,
        local_rope_theta=None if local_rope_theta == rope_theta else local_rope_theta,
        layer_types=layer_types,
        sliding_window=config.sliding_window if "sliding" in layer_types else None,
        type_vocab_size=0,
        norm_type="layernorm",
        norm_position="pre",
        layer_norm_eps=config.norm_eps,
        norm_bias=config.norm_bias,
        embedding_layernorm=True,
        final_norm=True,
        first_layer_attention_norm=False,  # ModernBertEncoderLayer 0: attn_norm = nn.Identity()
        attention_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
        hidden_dropout=config.embedding_dropout,
        attention_dropout=config.attention_dropout,
        classifier_dropout=config.classifier_dropout,
        lm_head_transform=True,
        lm_head_bias=config.decoder_bias,
        head_transform_bias=config.classifier_bias,  # ModernBERT's classifier_bias is its prediction head's
        classifier_transform=True,
        classifier_pooling=config.classifier_pooling,
        classifier_dense=False,
        classifier_bias=True,  # the `classifier` Linear always has a bias
        initializer_range=config.initializer_range,
        **read_common_fields(config),
    )


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    sliding = "sliding" in config.layer_types
    return ModernBertConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        hidden_activation=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        norm_eps=config.layer_norm_eps,
        norm_bias=config.norm_bias,
        cls_token_id=config.bos_token_id,  # ModernBERT's defaults have cls = bos and sep = eos
        sep_token_id=config.eos_token_id,
        attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout,
        layer_types=[GENERIC_LAYER_TYPES[layer_type] for layer_type in config.layer_types],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": config.rope_theta_of("full")},
            "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_theta_of("sliding")},
        },
        local_attention=2 * config.sliding_window if sliding else 128,  # 128: ModernBERT's default, unused then
        embedding_dropout=config.hidden_dropout,
        mlp_bias=config.mlp_bias,
        mlp_dropout=0.0,
        decoder_bias=config.lm_head_bias,
        classifier_pooling=config.classifier_pooling or "cls",
        classifier_dropout=classifier_dropout(config),
        classifier_bias=config.head_transform_bias,  # the bias of ModernBERT's prediction head's dense layer
        classifier_activation=config.hidden_act,
        **write_common_fields(config),
    )


FUSED = re.compile(r"(.*\.)(attn\.Wqkv|mlp\.Wi)\.(weight|bias)")
SPLIT = re.compile(r"(.*\.)(attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)")
# fused name -> the pseudo-names of its row blocks, in order (see the module docstring).
PARTS = {
    "attn.Wqkv": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    "mlp.Wi": ("mlp.gate_proj", "mlp.up_proj"),
}


def unfuse(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """Split the fused Wqkv and Wi into the pseudo-names the rename rules understand."""
    unfused = {}
    for name, tensor in state_dict.items():
        match = FUSED.fullmatch(name)
        if match is None:
            unfused[name] = tensor
            continue
        parts = PARTS[match[2]]
        for part, chunk in zip(parts, tensor.chunk(len(parts), dim=0)):  # (n * out, ...) -> n x (out, ...)
            unfused[f"{match[1]}{part}.{match[3]}"] = chunk
    return unfused


def fuse(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """The inverse of `unfuse`: the row blocks concatenated back into Wqkv and Wi."""
    fused = {}
    for name, tensor in state_dict.items():
        match = SPLIT.fullmatch(name)
        if match is None:
            fused[name] = tensor
            continue
        for whole, parts in PARTS.items():
            if match[2] == parts[0]:  # gathered with the first part
                blocks = [state_dict[f"{match[1]}{part}.{match[3]}"] for part in parts]
                fused[f"{match[1]}{whole}.{match[3]}"] = torch.cat(blocks, dim=0)  # n x (out, ...) -> (n * out, ...)
    return fused


MODERNBERT = NativeArchitecture(
    name="modernbert",
    family="encoder",
    heads=HEADS,
    base_rules=BASE_RULES,
    read_config=read_config,
    write_config=write_config,
    requirements=(
        *rotary_layernorm_block("ModernBERT", embedding_norm=True, gated=True),  # GeGLU
        equals("first_layer_attention_norm", False, "ModernBERT's first layer has no attention norm"),
        equals("type_vocab_size", 0, "ModernBERT has no token types"),
        Requirement("layer_types", all_layers("full", "sliding"), "ModernBERT has global and local layers only"),
        equals("lm_head_transform", True, "ModernBERT's MLM head has its prediction head in front", MASKED_LM),
        Requirement(
            "classifier_pooling",
            lambda value, config: value in (None, "cls", "mean"),
            "ModernBERT pools 'cls' or 'mean'",
            POOLED_ENCODER_HEADS,
        ),
        equals("classifier_transform", True, "ModernBERT's classifiers have its prediction head in front", CLASSIFIERS),
        equals("classifier_dense", False, "ModernBERT's classifier has no tanh dense layer", POOLED_CLASSIFIERS),
        equals("classifier_bias", True, "ModernBERT's classifier has a bias", POOLED_CLASSIFIERS),
    ),
    prepare_weights=unfuse,
    restore_weights=fuse,
)
