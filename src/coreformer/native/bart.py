"""BART <-> coreformer seq2seq: post-norm encoder and decoder, learned positions stored from row 2, an embedding
LayerNorm on each stack, optional sqrt(d) embedding scale, a shared embedding tied to the LM head.

    BartModel                               CoreformerSeq2SeqModel
    BartForConditionalGeneration            CoreformerSeq2SeqForConditionalGeneration (final_logits_bias kept;
                                            written as zeros for a model that has none)
    BartForSequenceClassification           CoreformerSeq2SeqForSequenceClassification

BART looks position p up in row p + 2; coreformer in row p + position_offset. A coreformer model with a smaller offset
is written with zero rows in front (rows BART never reads), so reading it back gives position_offset=2 and those
rows: the same function. Activation dropout and layerdrop have no coreformer field (training-time only).
"""

import torch
from transformers import BartConfig, PreTrainedConfig, PreTrainedModel

from ..configuration_coreformer import CoreformerConfig, CoreformerSeq2SeqConfig
from ..modeling_seq2seq import (
    CoreformerSeq2SeqForConditionalGeneration,
    CoreformerSeq2SeqForSequenceClassification,
    CoreformerSeq2SeqModel,
)
from .base import (
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
from .requirements import Requirement, all_layers, equals, plain_block, plain_heads, pooled_classifier

OFFSET = 2  # BartLearnedPositionalEmbedding.offset
_STACK = r"(encoder|decoder)\.layers\.(\d+)"
BASE_RULES: tuple[Rule, ...] = (
    (r"shared\.weight", "shared.weight"),
    (r"(encoder|decoder)\.embed_tokens\.weight", r"\1.embed_tokens.weight"),
    (r"(encoder|decoder)\.embed_positions\.weight", r"\1.embed_positions.weight"),
    (rf"(encoder|decoder)\.layernorm_embedding\.{WB}", r"\1.embedding_norm.\2"),
    (rf"{_STACK}\.self_attn\.([qkv])_proj\.{WB}", r"\1.layers.\2.self_attn.\3_proj.\4"),
    (rf"{_STACK}\.self_attn\.out_proj\.{WB}", r"\1.layers.\2.self_attn.o_proj.\3"),
    (rf"{_STACK}\.self_attn_layer_norm\.{WB}", r"\1.layers.\2.self_attn_norm.\3"),
    (rf"decoder\.layers\.(\d+)\.encoder_attn\.([qkv])_proj\.{WB}", r"decoder.layers.\1.cross_attn.\2_proj.\3"),
    (rf"decoder\.layers\.(\d+)\.encoder_attn\.out_proj\.{WB}", r"decoder.layers.\1.cross_attn.o_proj.\2"),
    (rf"decoder\.layers\.(\d+)\.encoder_attn_layer_norm\.{WB}", r"decoder.layers.\1.cross_attn_norm.\2"),
    (rf"{_STACK}\.fc1\.{WB}", r"\1.layers.\2.mlp.up_proj.\3"),
    (rf"{_STACK}\.fc2\.{WB}", r"\1.layers.\2.mlp.down_proj.\3"),
    (rf"{_STACK}\.final_layer_norm\.{WB}", r"\1.layers.\2.mlp_norm.\3"),
)
HEADS = {
    "BartModel": HeadConversion(CoreformerSeq2SeqModel),
    "BartForConditionalGeneration": HeadConversion(
        CoreformerSeq2SeqForConditionalGeneration,
        ((r"lm_head\.weight", "lm_head.weight"), (r"final_logits_bias", "final_logits_bias")),
        (("final_logits_bias", True),),  # a buffer, never trained, as in BART
    ),
    "BartForSequenceClassification": HeadConversion(
        CoreformerSeq2SeqForSequenceClassification,
        ((rf"classification_head\.(dense|out_proj)\.{WB}", r"classifier.\1.\2"),),
        (("classifier_dropout_before_dense", True),),  # BartClassificationHead: dropout, dense, dropout
    ),
}
# Flags of fairseq-era (m)BART configs that transformers 5's BartModel ignores, with their plain values: a checkpoint
# that sets them was trained as another network, which neither transformers' BART nor coreformer reproduces.
_PLAIN_FLAGS = {
    "normalize_before": False,
    "add_final_layer_norm": False,
    "static_position_embeddings": False,
    "add_bias_logits": False,
    "normalize_embedding": True,
}


def _refuse_unequal_stacks(config: PreTrainedConfig) -> None:
    """coreformer has one num_attention_heads and one intermediate_size for both stacks; no fairseq-era flags."""
    for encoder_field, decoder_field, ours in (
        ("encoder_attention_heads", "decoder_attention_heads", "num_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim", "intermediate_size"),
    ):
        if getattr(config, encoder_field) != getattr(config, decoder_field):
            option = (
                f"{encoder_field}={getattr(config, encoder_field)} != {decoder_field}={getattr(config, decoder_field)}"
            )
            raise unsupported("BART", option, f"(coreformer has one {ours} for both stacks)")
    for flag, plain_value in _PLAIN_FLAGS.items():
        value = getattr(config, flag, plain_value)
        if value != plain_value:
            raise unsupported("BART", f"{flag}={value!r}", "(not a plain post-norm BART)")


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerSeq2SeqConfig:
    config = model.config
    _refuse_unequal_stacks(config)
    return CoreformerSeq2SeqConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        num_attention_heads=config.encoder_attention_heads,
        intermediate_size=config.encoder_ffn_dim,
        hidden_act=check_activation("BART", config.activation_function),
        max_position_embeddings=config.max_position_embeddings,
        position_embedding_type="learned",
        position_offset=OFFSET,
        type_vocab_size=0,
        norm_position="post",
        layer_norm_eps=1e-5,  # BART builds nn.LayerNorm(d_model) with torch's default eps
        embedding_layernorm=True,
        final_norm=False,
        scale_embedding=config.scale_embedding,
        # activation_dropout and layerdrop have no coreformer field: training-time only, dropped.
        hidden_dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        classifier_dropout=config.classifier_dropout,
        lm_head_transform=False,
        lm_head_bias=False,  # BART's logits bias is final_logits_bias, a buffer: see its head's rules
        classifier_dense=True,
        classifier_bias=True,
        initializer_range=config.init_std,
        use_cache=config.use_cache,
        **read_common_fields(config, "decoder_start_token_id"),
    )


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    return BartConfig(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.num_attention_heads,
        decoder_attention_heads=config.num_attention_heads,
        encoder_ffn_dim=config.intermediate_size,
        decoder_ffn_dim=config.intermediate_size,
        activation_function=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=0.0,
        classifier_dropout=classifier_dropout(config),
        init_std=config.initializer_range,
        scale_embedding=config.scale_embedding,
        use_cache=config.use_cache,
        decoder_start_token_id=config.decoder_start_token_id,
        forced_eos_token_id=None,  # generation settings travel in generation_config.json
        **write_common_fields(config),
    )


def adapt_positions(config: CoreformerConfig, state_dict: StateDict) -> StateDict:
    """Zero rows in front of each position table, up to BART's offset of 2 (see the module docstring)."""
    missing = OFFSET - config.position_offset
    if missing == 0:
        return state_dict
    adapted = dict(state_dict)
    for name, table in state_dict.items():
        if name.endswith("embed_positions.weight"):
            adapted[name] = torch.cat([table.new_zeros(missing, table.shape[1]), table])  # (max + 2, hidden)
    return adapted


BART = NativeArchitecture(
    name="bart",
    family="seq2seq",
    heads=HEADS,
    base_rules=BASE_RULES,
    read_config=read_config,
    write_config=write_config,
    requirements=(
        *plain_block("BART", "post"),
        Requirement("position_offset", lambda value, config: value <= OFFSET, "BART stores positions from 2"),
        equals("embedding_layernorm", True, "BART normalises its embeddings"),
        equals("final_norm", False, "BART has no final norm"),
        equals("layer_norm_eps", 1e-5, "BART's LayerNorms use torch's default eps"),
        equals("type_vocab_size", 0, "BART has no token types"),
        Requirement("layer_types", all_layers("full"), "every encoder layer full attention"),
        Requirement("decoder_layer_types", all_layers("full"), "every decoder layer full attention"),
        *plain_heads("BART", lm_transform=False, lm_bias=False),
        *pooled_classifier("BART", dense=True),
    ),
    zero_filled=(r"final_logits_bias",),
    adapt_weights=adapt_positions,
)
