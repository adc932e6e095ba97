"""GPT-2 <-> coreformer decoder: LayerNorm pre-norm with a final norm (ln_f), learned positions from 0, biases
everywhere, no embedding norm, a tied LM head; Conv1D weights and a fused c_attn.

    GPT2Model                               CoreformerDecoderModel
    GPT2LMHeadModel                         CoreformerDecoderForCausalLM
    GPT2ForSequenceClassification           CoreformerDecoderForSequenceClassification (score -> classifier.out_proj)
    GPT2ForTokenClassification              CoreformerDecoderForTokenClassification

GPT-2's Conv1D stores weights (in, out): reading transposes them to nn.Linear's (out, in) and splits c_attn
(hidden -> 3 * hidden) into q/k/v pseudo-names; writing does the reverse. `token_type_ids`, which GPT-2 looks up in its
token embedding, are ignored by the converted model.
"""

import torch
from transformers import GPT2Config, PreTrainedConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from ..configuration_coreformer import CoreformerConfig, CoreformerDecoderConfig
from .base import (
    SAME_NAME_CLASSIFIER,
    WB,
    NativeArchitecture,
    Rule,
    StateDict,
    check_activation,
    classifier_dropout,
    decoder_heads,
    read_common_fields,
    unsupported,
    write_common_fields,
)
from .requirements import DECODER_COMMON, equals, plain_block, plain_heads, pooled_classifier

# After `unfuse`: Conv1D weights transposed to (out, in), c_attn split into q/k/v pseudo-names.
BASE_RULES: tuple[Rule, ...] = (
    (r"wte\.weight", "decoder.embed_tokens.weight"),
    (r"wpe\.weight", "decoder.embed_positions.weight"),
    (rf"h\.(\d+)\.ln_1\.{WB}", r"decoder.layers.\1.self_attn_norm.\2"),
    (rf"h\.(\d+)\.attn\.([qkv])_proj\.{WB}", r"decoder.layers.\1.self_attn.\2_proj.\3"),
    (rf"h\.(\d+)\.attn\.c_proj\.{WB}", r"decoder.layers.\1.self_attn.o_proj.\2"),
    (rf"h\.(\d+)\.ln_2\.{WB}", r"decoder.layers.\1.mlp_norm.\2"),
    (rf"h\.(\d+)\.mlp\.c_fc\.{WB}", r"decoder.layers.\1.mlp.up_proj.\2"),
    (rf"h\.(\d+)\.mlp\.c_proj\.{WB}", r"decoder.layers.\1.mlp.down_proj.\2"),
    (rf"ln_f\.{WB}", r"decoder.norm.\1"),
)


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerDecoderConfig:
    """GPT-2: pre-norm with a final norm, learned positions, no embedding norm, tied LM head."""
    config = model.config
    if not config.scale_attn_weights:
        raise unsupported("GPT-2", "scale_attn_weights=False", "(unscaled attention scores)")
    if config.scale_attn_by_inverse_layer_idx:
        raise unsupported("GPT-2", "scale_attn_by_inverse_layer_idx=True", "(per-layer score scaling)")
    if config.reorder_and_upcast_attn:
        raise unsupported("GPT-2", "reorder_and_upcast_attn=True", "(keys scaled before the product)")
    if config.add_cross_attention:
        raise unsupported("GPT-2", "add_cross_attention=True", "(cross-attention in a GPT-2 decoder)")
    # GPT2ForTokenClassification's rule for its dropout (GPT2ForSequenceClassification has none: its head config).
    dropout = getattr(config, "classifier_dropout", None)
    if dropout is None:
        dropout = getattr(config, "hidden_dropout", None)
    return CoreformerDecoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        intermediate_size=config.n_inner if config.n_inner is not None else 4 * config.n_embd,
        hidden_act=check_activation("GPT-2", config.activation_function),
        max_position_embeddings=config.n_positions,
        position_embedding_type="learned",
        position_offset=0,
        type_vocab_size=0,
        norm_position="pre",
        layer_norm_eps=config.layer_norm_epsilon,
        embedding_layernorm=False,
        final_norm=True,
        # GPT-2 has one dropout on embeddings (embd_pdrop) and one on residual branches (resid_pdrop); coreformer
        # has hidden_dropout for both. Training-time only.
        hidden_dropout=config.resid_pdrop,
        attention_dropout=config.attn_pdrop,
        classifier_dropout=0.1 if dropout is None else dropout,
        lm_head_transform=False,
        lm_head_bias=False,
        classifier_dense=False,
        classifier_bias=False,
        initializer_range=config.initializer_range,
        use_cache=config.use_cache,
        **read_common_fields(config),
    )


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_embd=config.hidden_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        n_inner=config.intermediate_size,
        activation_function=config.hidden_act,
        n_positions=config.max_position_embeddings,
        layer_norm_epsilon=config.layer_norm_eps,
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        classifier_dropout=classifier_dropout(config),
        initializer_range=config.initializer_range,
        use_cache=config.use_cache,
        **write_common_fields(config),
    )


def _conv1d_names(model: PreTrainedModel) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, Conv1D)}


def unfuse(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """Conv1D weights (in, out) -> (out, in); c_attn split into q/k/v pseudo-names."""
    conv1d = _conv1d_names(model)
    unfused = {}
    for name, tensor in state_dict.items():
        module, _, kind = name.rpartition(".")
        if module in conv1d and kind == "weight":
            tensor = tensor.t()  # (in, out) -> (out, in)
        if module.endswith(".attn.c_attn"):
            stem = module.removesuffix("c_attn")
            for part, chunk in zip("qkv", tensor.chunk(3, dim=0)):  # (3 * hidden, ...) -> 3 x (hidden, ...)
                unfused[f"{stem}{part}_proj.{kind}"] = chunk
        else:
            unfused[name] = tensor
    return unfused


def fuse(model: PreTrainedModel, state_dict: StateDict) -> StateDict:
    """The inverse of `unfuse`: q/k/v pseudo-names concatenated into c_attn, Conv1D weights transposed back."""
    conv1d = _conv1d_names(model)
    fused = {}
    for name, tensor in state_dict.items():
        module, _, kind = name.rpartition(".")
        stem, _, projection = module.rpartition(".")
        if projection in ("q_proj", "k_proj", "v_proj") and stem.endswith(".attn"):
            if projection != "q_proj":
                continue  # gathered with q below
            parts = [state_dict[f"{stem}.{part}_proj.{kind}"] for part in "qkv"]
            module, tensor = f"{stem}.c_attn", torch.cat(parts, dim=0)  # 3 x (hidden, ...) -> (3 * hidden, ...)
        if module in conv1d and kind == "weight":
            tensor = tensor.t()  # (out, in) -> (in, out)
        fused[f"{module}.{kind}"] = tensor
    return fused


GPT2 = NativeArchitecture(
    name="gpt2",
    family="decoder",
    heads=decoder_heads("GPT2", SAME_NAME_CLASSIFIER, causal_lm="GPT2LMHeadModel"),
    base_rules=BASE_RULES,
    read_config=read_config,
    write_config=write_config,
    requirements=(
        *plain_block("GPT-2", "pre"),
        equals("position_offset", 0, "GPT-2 numbers positions from 0"),
        equals("final_norm", True, "GPT-2 has a final norm (ln_f)"),
        equals("embedding_layernorm", False, "GPT-2 has no embedding norm"),
        equals("scale_embedding", False, "GPT-2 does not scale embeddings"),
        *DECODER_COMMON,
        *plain_heads("GPT-2", lm_transform=False, lm_bias=False),
        *pooled_classifier("GPT-2", dense=False),
    ),
    prepare_weights=unfuse,
    restore_weights=fuse,
)
