"""What training needs to know about each model family, in ONE table (until coreformer.families holds it).

    FAMILIES                     family name -> FamilyFacts (config class, description, tokenizer, special tokens)
    family_of(config)            a loaded config -> its family name, or None for a non-coreformer config
    head_class(family, auto)     the coreformer class an Auto class builds for the family ("AutoModelForMaskedLM")

The head classes are read from the Auto registration `coreformer/__init__.py` performs, so the head table exists
once; the special tokens (in id order: the trained vocabularies put them first) and the tokenizer kind are the
facts `tokenizer_training` builds tokenizers from. Nothing here imports torch or the training loops.
"""

from dataclasses import dataclass

import transformers

from ..configuration_coreformer import CoreformerDecoderConfig, CoreformerEncoderConfig, CoreformerSeq2SeqConfig


@dataclass(frozen=True)
class FamilyFacts:
    name: str
    config_class: type
    description: str  # for cards: "BERT-style encoder"
    default_objective: str  # objectives registry name, used when --objective is not given
    tokenizer_kind: str  # "wordpiece" | "byte-level-bpe"
    special_tokens: dict[str, str]  # role -> token, in id order
    model_input_names: tuple[str, ...]
    template: tuple[str, str] | None  # the tokenizer's post-processor (single, pair); None adds no special tokens
    config_token_roles: tuple[str, ...]  # special tokens whose ids the config carries (`{role}_id`)
    decoder_start_token: str | None = None  # the role whose id starts decoding (BART: eos)


FAMILIES: dict[str, FamilyFacts] = {
    "encoder": FamilyFacts(
        name="encoder",
        config_class=CoreformerEncoderConfig,
        description="BERT-style encoder",
        default_objective="masked-lm",
        tokenizer_kind="wordpiece",
        special_tokens={
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
        },
        model_input_names=("input_ids", "token_type_ids", "attention_mask"),  # only the encoder has token types
        template=("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),  # token_type_ids 1 on the second segment (BERT)
        config_token_roles=("pad_token",),  # BERT has no bos/eos; [CLS]/[SEP]/[MASK] live on the tokenizer
    ),
    "decoder": FamilyFacts(
        name="decoder",
        config_class=CoreformerDecoderConfig,
        description="GPT-style decoder",
        default_objective="causal-lm",
        tokenizer_kind="byte-level-bpe",
        special_tokens={"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        model_input_names=("input_ids", "attention_mask"),
        template=None,  # packing inserts </s> between documents itself
        config_token_roles=("pad_token", "bos_token", "eos_token"),
    ),
    "seq2seq": FamilyFacts(
        name="seq2seq",
        config_class=CoreformerSeq2SeqConfig,
        description="BART-style encoder-decoder",
        default_objective="denoising",
        tokenizer_kind="byte-level-bpe",
        special_tokens={
            "bos_token": "<s>",
            "pad_token": "<pad>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "mask_token": "<mask>",
        },
        model_input_names=("input_ids", "attention_mask"),
        template=("<s> $A </s>", "<s> $A </s> </s> $B </s>"),  # BART / RoBERTa pair layout; no token types
        config_token_roles=("pad_token", "bos_token", "eos_token"),
        decoder_start_token="eos_token",
    ),
}

_BY_MODEL_TYPE = {facts.config_class.model_type: name for name, facts in FAMILIES.items()}


def family_of(config: transformers.PretrainedConfig) -> str | None:
    """The family of a loaded config (by its model_type), None for a config that is not coreformer's."""
    return _BY_MODEL_TYPE.get(config.model_type)


def head_class(family: str, auto_class: str) -> type:
    """The coreformer model class `transformers.<auto_class>` builds for `family` (registered by `import coreformer`).

    Raises:
        KeyError: the family has no such head.
    """
    # Importing any coreformer.training module imported coreformer/__init__.py first, which registered the heads.
    mapping = getattr(transformers, auto_class)._model_mapping
    return mapping[FAMILIES[family].config_class]
