"""RoBERTa <-> coreformer encoder: BERT (bert.py) with positions numbered from padding_idx + 1, its own MLM head
names, and a sequence classifier with dropout in front of its dense layer.

    RobertaModel, RobertaFor{MaskedLM,SequenceClassification,TokenClassification,QuestionAnswering,MultipleChoice}
        -> the CoreformerEncoder heads of the same task (see bert.py)

RoBERTa numbers each token by the cumsum of non-padding tokens from padding_idx + 1; coreformer's learned positions
are arange + position_offset (= pad_token_id + 1): the same for every non-padding token of a right-padded batch.
"""

from transformers import PreTrainedConfig, PreTrainedModel, RobertaConfig

from ..configuration_coreformer import CoreformerConfig, CoreformerEncoderConfig
from ..modeling_encoder import CoreformerEncoderForSequenceClassification
from .base import WB, HeadConversion, NativeArchitecture, Rule
from .bert import BASE_RULES, POOLER, encoder_heads, encoder_requirements, read_encoder_config, written_fields
from .requirements import MASKED_LM, Requirement, equals

MASKED_LM_RULES: tuple[Rule, ...] = (
    (rf"lm_head\.dense\.{WB}", r"lm_head_transform.dense.\1"),
    (rf"lm_head\.layer_norm\.{WB}", r"lm_head_transform.norm.\1"),
    (r"lm_head\.decoder\.weight", "lm_head.weight"),
    (r"lm_head\.(decoder\.)?bias", "lm_head.bias"),
)
SEQUENCE_CLASSIFIER = HeadConversion(
    CoreformerEncoderForSequenceClassification,
    ((rf"classifier\.(dense|out_proj)\.{WB}", r"classifier.\1.\2"),),
    (("classifier_dropout_before_dense", True),),  # RobertaClassificationHead: dropout, dense, dropout
)


def read_config(model: PreTrainedModel, is_mlm: bool) -> CoreformerEncoderConfig:
    return read_encoder_config(model.config, is_mlm, roberta=True)


def write_config(config: CoreformerConfig) -> PreTrainedConfig:
    # RoBERTa's table also holds the rows below padding_idx + 1 (= coreformer's position_offset).
    return RobertaConfig(
        **written_fields(config), max_position_embeddings=config.max_position_embeddings + config.position_offset
    )


ROBERTA = NativeArchitecture(
    name="roberta",
    family="encoder",
    heads=encoder_heads("Roberta", MASKED_LM_RULES, ForSequenceClassification=SEQUENCE_CLASSIFIER),
    base_rules=BASE_RULES,
    read_config=read_config,
    write_config=write_config,
    requirements=encoder_requirements(
        "RoBERTa",
        Requirement(
            "position_offset",
            lambda value, config: config.pad_token_id is not None and value == config.pad_token_id + 1,
            "RoBERTa numbers positions from pad_token_id + 1",
        ),
        equals("hidden_act", "gelu", "RobertaLMHead always uses gelu", MASKED_LM),
    ),
    zero_filled=POOLER,
)
