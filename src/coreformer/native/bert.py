"""BERT <-> coreformer encoder: post-norm, learned absolute positions from 0, token types, an embedding LayerNorm,
an MLM transform, a pooler that becomes the sequence classifier's dense layer.

    BertModel                               CoreformerEncoderModel (the pooler is dropped; written back as zeros)
    BertForMaskedLM                         CoreformerEncoderForMaskedLM
    BertForSequenceClassification           CoreformerEncoderForSequenceClassification (pooler -> classifier.dense)
    BertForTokenClassification              CoreformerEncoderForTokenClassification
    BertForQuestionAnswering                CoreformerEncoderForQuestionAnswering
    BertForMultipleChoice                   CoreformerEncoderForMultipleChoice (pooler -> classifier.dense)

RoBERTa (roberta.py) is this architecture with positions numbered from padding_idx + 1: it reuses the weight names,
the config reader and writer and the encoder requirements below.
"""

from transformers import BertConfig, PreTrainedConfig, PreTrainedModel

from ..configuration_coreformer import CoreformerConfig, CoreformerEncoderConfig
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
    check_activation,
    read_common_fields,
    unsupported,
    write_common_fields,
)
from .requirements import (
    EVERY_LAYER_FULL,
    POOLED_ENCODER_HEADS,
    Requirement,
    equals,
    plain_block,
    plain_heads,
    pooled_classifier,
    pooling,
)

# Base-model weights, relative to the base model on both sides (BertModel keys / CoreformerEncoderModel keys).
BASE_RULES: tuple[Rule, ...] = (
    (r"embeddings\.word_embeddings\.weight", "encoder.embed_tokens.weight"),
    (r"embeddings\.position_embeddings\.weight", "encoder.embed_positions.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "encoder.token_type_embeddings.weight"),
    (rf"embeddings\.LayerNorm\.{WB}", r"encoder.embedding_norm.\1"),
    (rf"encoder\.layer\.(\d+)\.attention\.self\.query\.{WB}", r"encoder.layers.\1.self_attn.q_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.attention\.self\.key\.{WB}", r"encoder.layers.\1.self_attn.k_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.attention\.self\.value\.{WB}", r"encoder.layers.\1.self_attn.v_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.attention\.output\.dense\.{WB}", r"encoder.layers.\1.self_attn.o_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.{WB}", r"encoder.layers.\1.self_attn_norm.\2"),
    (rf"encoder\.layer\.(\d+)\.intermediate\.dense\.{WB}", r"encoder.layers.\1.mlp.up_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.output\.dense\.{WB}", r"encoder.layers.\1.mlp.down_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.output\.LayerNorm\.{WB}", r"encoder.layers.\1.mlp_norm.\2"),
)
DROP_POOLER: tuple[Rule, ...] = ((rf"pooler\.dense\.{WB}", None),)
POOLER = (r"pooler\.dense\.(weight|bias)",)  # written as zeros: pooler_output is then 0
QA_RULES: tuple[Rule, ...] = ((rf"qa_outputs\.{WB}", r"qa_outputs.\1"),)


def pooler_classifier_rules(prefix: str) -> tuple[Rule, ...]:
    """BERT's pooler (tanh dense on [CLS]) + classifier is our ClassificationHead's dense + out_proj."""
    return (
        (rf"{prefix}\.pooler\.dense\.{WB}", r"classifier.dense.\1"),
        (rf"classifier\.{WB}", r"classifier.out_proj.\1"),
    )


def read_encoder_config(config: PreTrainedConfig, is_mlm: bool, roberta: bool = False) -> CoreformerEncoderConfig:
    """BERT / RoBERTa: post-norm, learned absolute positions, token types, embedding LayerNorm, MLM transform."""
    name = "RoBERTa" if roberta else "BERT"
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        # transformers 5 dropped relative_key(_query) and silently ignores the field; the checkpoint was trained
        # with it, so neither model reproduces it.
        raise unsupported(name, f"position_embedding_type={position_type!r}", "(relative positions)")
    if config.is_decoder or config.add_cross_attention:
        raise unsupported(name, "is_decoder/add_cross_attention=True", "(a causal BERT decoder)")
    hidden_act = check_activation(name, config.hidden_act)
    if roberta and is_mlm and hidden_act != "gelu":
        # RobertaLMHead hard-codes erf gelu whatever hidden_act says; our MLM transform uses hidden_act.
        raise unsupported(name, f"hidden_act={hidden_act!r} with an MLM head", "(RobertaLMHead always uses gelu)")
    positions = {"max_position_embeddings": config.max_position_embeddings, "position_offset": 0}
    if roberta:
        if config.pad_token_id is None:
            raise unsupported(name, "pad_token_id=None", "(RoBERTa numbers positions from padding_idx + 1)")
        # RoBERTa numbers tokens from padding_idx + 1 (cumsum of non-padding); our learned positions are
        # arange + position_offset, the same for every non-padding token of a right-padded batch.
        offset = config.pad_token_id + 1
        positions = {"max_position_embeddings": config.max_position_embeddings - offset, "position_offset": offset}
    return CoreformerEncoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=hidden_act,
        **positions,
        position_embedding_type="learned",
        type_vocab_size=config.type_vocab_size,
        norm_position="post",
        layer_norm_eps=config.layer_norm_eps,
        embedding_layernorm=True,
        final_norm=False,
        hidden_dropout=config.hidden_dropout_prob,
        attention_dropout=config.attention_probs_dropout_prob,
        classifier_dropout=config.classifier_dropout,
        lm_head_transform=True,
        lm_head_bias=True,
        classifier_dense=True,
        classifier_bias=True,
        initializer_range=config.initializer_range,
        **read_common_fields(config),
    )


def written_fields(config: CoreformerConfig) -> dict:
    """The BERT / RoBERTa config fields but the size of the position table."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "hidden_dropout_prob": config.hidden_dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "type_vocab_size": config.type_vocab_size,
        "initializer_range": config.initializer_range,
        "layer_norm_eps": config.layer_norm_eps,
        "classifier_dropout": config.classifier_dropout,
        **write_common_fields(config),
    }


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    return BertConfig(**written_fields(config), max_position_embeddings=config.max_position_embeddings)


def encoder_requirements(native: str, *own: Requirement) -> tuple[Requirement, ...]:
    """A BERT-style encoder: post-norm plain blocks, `own` requirements (positions), embedding LayerNorm, token
    types, BERT's heads."""
    return (
        *plain_block(native, "post"),
        *own,
        equals("embedding_layernorm", True, "a LayerNorm on the embeddings"),
        equals("final_norm", False, "no final norm"),
        equals("scale_embedding", False, "embeddings unscaled"),
        Requirement(
            "type_vocab_size", lambda value, config: value >= 1, "token-type embeddings (type_vocab_size >= 1)"
        ),
        EVERY_LAYER_FULL,
        pooling("cls", "BERT", POOLED_ENCODER_HEADS),
        *plain_heads("BERT", lm_transform=True, lm_bias=True),
        *pooled_classifier("BERT", dense=True),
    )


def encoder_heads(prefix: str, masked_lm_rules: tuple[Rule, ...], **overrides: HeadConversion) -> dict:
    """The six BERT-style heads of `prefix` ("Bert", "Roberta"); `overrides` replace heads by their suffix."""
    heads = {
        "Model": HeadConversion(CoreformerEncoderModel, DROP_POOLER),
        "ForMaskedLM": HeadConversion(CoreformerEncoderForMaskedLM, masked_lm_rules),
        "ForSequenceClassification": HeadConversion(
            CoreformerEncoderForSequenceClassification, pooler_classifier_rules(prefix.lower())
        ),
        "ForTokenClassification": HeadConversion(CoreformerEncoderForTokenClassification, SAME_NAME_CLASSIFIER),
        "ForQuestionAnswering": HeadConversion(CoreformerEncoderForQuestionAnswering, QA_RULES),
        "ForMultipleChoice": HeadConversion(
            CoreformerEncoderForMultipleChoice, pooler_classifier_rules(prefix.lower())
        ),
    }
    heads.update(overrides)
    return {f"{prefix}{suffix}": head for suffix, head in heads.items()}


MASKED_LM_RULES: tuple[Rule, ...] = (
    (rf"cls\.predictions\.transform\.dense\.{WB}", r"lm_head_transform.dense.\1"),
    (rf"cls\.predictions\.transform\.LayerNorm\.{WB}", r"lm_head_transform.norm.\1"),
    (r"cls\.predictions\.decoder\.weight", "lm_head.weight"),
    # transformers ties decoder.bias to predictions.bias: both names fill the one lm_head.bias.
    (r"cls\.predictions\.(decoder\.)?bias", "lm_head.bias"),
)


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerEncoderConfig:
    return read_encoder_config(model.config, is_mlm)


BERT = NativeArchitecture(
    name="bert",
    family="encoder",
    heads=encoder_heads("Bert", MASKED_LM_RULES),
    base_rules=BASE_RULES,
    read_config=read_config,
    write_config=write_config,
    requirements=encoder_requirements("BERT", equals("position_offset", 0, "BERT numbers positions from 0")),
    zero_filled=POOLER,
)
