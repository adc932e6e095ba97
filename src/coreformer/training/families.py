"""What training needs to know about each model family: the facts of `coreformer.families` (the one registry), plus
the few that only training uses.

    TRAINING_FACTS                  family name -> TrainingFacts (the registry's Family + training's own facts)
    family_of(config)               a loaded config -> its family name, or None for a non-coreformer config
    head_class(family, auto_class)  the coreformer class of the family's head for a transformers Auto class
    families_with_head(auto_class)  the families that register a head for an Auto class
    families_with_language_model(auto_class)   the families whose language-model head that Auto class is
    longest_input(config)           tokens a model's position table holds (None: rotary / no positions, no limit)

From the registry: config class, heads and their Auto classes, language-model head, special tokens (in id order),
model input names, description. Training's own: the default pretraining objective, the tokenizer kind and its
post-processor template, which special-token ids the config carries. Nothing here imports torch.
"""

import importlib
from dataclasses import dataclass

import transformers

from .. import configuration_coreformer
from .. import families as registry


@dataclass(frozen=True)
class TrainingFacts:
    family: registry.Family
    default_objective: str  # objectives registry name, used when --objective is not given
    tokenizer_kind: str  # "wordpiece" | "byte-level-bpe" (tokenizer_training's backends)
    template: tuple[str, str] | None  # the tokenizer's post-processor (single, pair); None adds no special tokens
    config_token_roles: tuple[str, ...]  # special tokens whose ids the config carries (`{role}_id`)
    decoder_start_token: str | None = None  # the role whose id starts decoding (BART: eos)

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def description(self) -> str:
        return self.family.description

    @property
    def config_class(self) -> type[transformers.PretrainedConfig]:
        return getattr(configuration_coreformer, self.family.config_class)

    @property
    def special_tokens(self) -> dict[str, str]:
        """role -> token, in id order (the trained vocabularies put them first)."""
        return dict(self.family.special_tokens)

    @property
    def model_input_names(self) -> tuple[str, ...]:
        return self.family.model_input_names


TRAINING_FACTS: dict[str, TrainingFacts] = {
    "encoder": TrainingFacts(
        registry.FAMILIES["encoder"],
        default_objective="masked-lm",
        tokenizer_kind="wordpiece",
        template=("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),  # token_type_ids 1 on the second segment (BERT)
        config_token_roles=("pad_token",),  # BERT has no bos/eos; [CLS]/[SEP]/[MASK] live on the tokenizer
    ),
    "decoder": TrainingFacts(
        registry.FAMILIES["decoder"],
        default_objective="causal-lm",
        tokenizer_kind="byte-level-bpe",
        template=None,  # packing inserts </s> between documents itself
        config_token_roles=("pad_token", "bos_token", "eos_token"),
    ),
    "seq2seq": TrainingFacts(
        registry.FAMILIES["seq2seq"],
        default_objective="denoising",
        tokenizer_kind="byte-level-bpe",
        template=("<s> $A </s>", "<s> $A </s> </s> $B </s>"),  # BART / RoBERTa pair layout; no token types
        config_token_roles=("pad_token", "bos_token", "eos_token"),
        decoder_start_token="eos_token",
    ),
}
assert set(TRAINING_FACTS) == set(registry.FAMILIES), "every registered family needs its training facts here"


def family_of(config: transformers.PretrainedConfig) -> str | None:
    """The family of a loaded config (by its model_type), None for a config that is not coreformer's."""
    family = registry.MODEL_TYPES.get(config.model_type)
    return family.name if family is not None else None


def head_class(family: str, auto_class: str) -> type:
    """The coreformer model class of `family`'s head for `auto_class` ("AutoModelForMaskedLM"); ValueError naming
    the family's Auto classes when it has none."""
    facts = registry.FAMILIES[family]
    module = importlib.import_module(f"{registry.__package__}.{facts.module}")
    return getattr(module, facts.head(auto_class).class_name)


def families_with_head(auto_class: str) -> tuple[str, ...]:
    """The families that register a head for `auto_class`, in registry order."""
    return tuple(
        name for name, family in registry.FAMILIES.items() if any(h.auto_class == auto_class for h in family.heads)
    )


def families_with_language_model(auto_class: str) -> tuple[str, ...]:
    """The families whose language-model head (what pretraining trains) is `auto_class`."""
    return tuple(name for name, family in registry.FAMILIES.items() if family.language_model_auto_class == auto_class)


_TABLE_POSITIONS = ("learned", "sinusoidal")  # position embeddings read from a table of max_position_embeddings rows


def longest_input(config: transformers.PretrainedConfig) -> int | None:
    """The most tokens one sequence may hold: the position table's rows past the offset (learned / sinusoidal
    positions), None where positions are computed (rotary) or absent."""
    if config.position_embedding_type not in _TABLE_POSITIONS:
        return None
    return config.max_position_embeddings - config.position_offset
