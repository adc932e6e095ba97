"""What a native architecture can represent: `Requirement`s on the coreformer config, and the groups of them that
several architectures share (a plain LayerNorm block, a rotary LayerNorm block, LM heads, classifiers).

    Requirement(field, holds, native, heads)    one config field an architecture fixes, and what it has in words
    equals(field, value, native, heads)          the common case: the field must equal `value`
    MASKED_LM, CAUSAL_LM, CLASSIFIERS, ...       coreformer head class names a requirement can be limited to

Each failing requirement is one difference named in the refusal of `export.choose_target`, so `native` says what the
architecture has ("GPT-2 has no gate"), not what the config got wrong.
"""

from collections.abc import Callable
from dataclasses import dataclass

from ..configuration_coreformer import CoreformerConfig


@dataclass(frozen=True)
class Requirement:
    """One config field a native architecture fixes: `holds(value, config)`, and what it has (for the message).

    `heads` limits the requirement to those coreformer classes (a classifier's shape matters only to classifiers).
    """

    field: str
    holds: Callable[[object, CoreformerConfig], bool]
    native: str  # what the architecture has, in words: "GPT-2 has no gate"
    heads: tuple[str, ...] | None = None

    def difference(self, config: CoreformerConfig, class_name: str) -> str | None:
        if self.heads is not None and class_name not in self.heads:
            return None
        value = getattr(config, self.field, None)
        return None if self.holds(value, config) else f"{self.field}={value!r} ({self.native})"


def equals(field_name: str, expected: object, native: str, heads: tuple[str, ...] | None = None) -> Requirement:
    return Requirement(field_name, lambda value, config: value == expected, native, heads)


def all_layers(*allowed: str) -> Callable[[object, CoreformerConfig], bool]:
    """`holds` for a layer-type list: non-empty, every entry one of `allowed`."""
    return lambda value, config: value is not None and len(value) > 0 and set(value) <= set(allowed)


def standard_head_dim(value, config) -> bool:
    return value * config.num_attention_heads == config.hidden_size


MASKED_LM = ("CoreformerEncoderForMaskedLM",)
CAUSAL_LM = ("CoreformerDecoderForCausalLM",)
SEQ2SEQ_LM = ("CoreformerSeq2SeqForConditionalGeneration",)
CLASSIFIERS = (
    "CoreformerEncoderForSequenceClassification",
    "CoreformerEncoderForTokenClassification",
    "CoreformerEncoderForQuestionAnswering",
    "CoreformerEncoderForMultipleChoice",
    "CoreformerDecoderForSequenceClassification",
    "CoreformerDecoderForTokenClassification",
    "CoreformerSeq2SeqForSequenceClassification",
)
POOLED_ENCODER_HEADS = ("CoreformerEncoderForSequenceClassification", "CoreformerEncoderForMultipleChoice")
POOLED_CLASSIFIERS = (
    "CoreformerEncoderForSequenceClassification",
    "CoreformerEncoderForMultipleChoice",
    "CoreformerDecoderForSequenceClassification",
    "CoreformerSeq2SeqForSequenceClassification",
)


def pooling(pooled: str, native: str, heads: tuple[str, ...]) -> Requirement:
    """The pooled token of an architecture's sequence classifiers: `pooled` or the family's default (None)."""
    return Requirement(
        "classifier_pooling", lambda value, config: value in (None, pooled), f"{native} pools {pooled!r}", heads
    )


def plain_attention(native: str, has: tuple[str, ...] = ()) -> list[Requirement]:
    """The attention options most architectures lack (QK-norm, the output gate, sinks, partial rotary): every
    architecture requires them off (`NativeArchitecture.differences`) except those it `has`, which its own
    requirements state."""
    plain = [
        equals("qk_norm", False, f"{native} normalises no query or key head"),
        equals("attention_gate", None, f"{native} gates no attention output"),
        equals("attention_sinks", False, f"{native} has no attention sinks"),
        equals("partial_rotary_factor", 1.0, f"{native} rotates every channel of a head"),
    ]
    return [requirement for requirement in plain if requirement.field not in has]


def every_block_normed(native: str) -> list[Requirement]:
    """The coreformer options no architecture but ModernBERT has: every block's attention norm, plain classifiers."""
    return [
        equals("first_layer_attention_norm", True, f"{native}'s first layer normalises its attention input"),
        equals("classifier_transform", False, f"{native}'s classifiers have no transform of their own", CLASSIFIERS),
    ]


def standard_heads(native: str) -> list[Requirement]:
    """One key/value head per query head, each hidden_size / num_attention_heads wide."""
    return [
        Requirement(
            "num_key_value_heads", lambda value, config: value == config.num_attention_heads, f"{native} has no GQA"
        ),
        Requirement("head_dim", standard_head_dim, f"{native}'s heads are hidden_size / num_attention_heads wide"),
    ]


def rotary_layernorm_block(native: str, *, embedding_norm: bool, gated: bool) -> list[Requirement]:
    """GPT-NeoX / ModernBERT blocks: rotary, LayerNorm pre-norm with a final norm, unscaled embeddings, MHA."""
    return [
        equals("position_embedding_type", "rotary", f"{native} uses rotary positions"),
        equals("norm_type", "layernorm", f"{native} uses LayerNorm"),
        equals("norm_position", "pre", f"{native} is pre-norm"),
        equals("final_norm", True, f"{native} has a final norm"),
        equals(
            "embedding_layernorm",
            embedding_norm,
            f"{native} {'normalises its embeddings' if embedding_norm else 'has no embedding norm'}",
        ),
        equals("scale_embedding", False, f"{native} does not scale embeddings"),
        equals("gated_mlp", gated, f"{native}'s MLP {'is gated' if gated else 'has no gate'}"),
        *standard_heads(native),
    ]


def plain_block(native: str, norm_position: str) -> list[Requirement]:
    """GPT-2 / BERT / BART blocks: LayerNorm, biases everywhere, ungated MLP, one key/value head per query head."""
    return [
        *every_block_normed(native),
        equals("norm_bias", True, f"{native}'s LayerNorms have biases"),
        equals("norm_type", "layernorm", f"{native} uses LayerNorm"),
        equals("norm_position", norm_position, f"{native} is {norm_position}-norm"),
        equals("attention_bias", True, f"{native} has attention biases"),
        equals("mlp_bias", True, f"{native} has MLP biases"),
        equals("gated_mlp", False, f"{native}'s MLP has no gate"),
        *standard_heads(native),
        equals("position_embedding_type", "learned", f"{native} learns absolute positions"),
    ]


def plain_heads(native: str, *, lm_transform: bool, lm_bias: bool) -> list[Requirement]:
    """The LM head shapes an architecture has."""
    lm_heads = (*MASKED_LM, *CAUSAL_LM, *SEQ2SEQ_LM)
    return [
        equals(
            "lm_head_transform",
            lm_transform,
            f"{native}'s LM head {'has' if lm_transform else 'has no'} dense transform",
            lm_heads,
        ),
        equals("lm_head_bias", lm_bias, f"{native}'s LM projection {'has' if lm_bias else 'has no'} bias", lm_heads),
        equals("head_transform_bias", True, f"{native}'s MLM transform has a bias", MASKED_LM),
    ]


def pooled_classifier(native: str, *, dense: bool) -> list[Requirement]:
    """A sequence classifier that is a tanh dense layer with biases (BERT, BART) or one bias-free `score`."""
    what = "a tanh dense layer and biases" if dense else "a single bias-free projection (score)"
    return [
        equals("classifier_dense", dense, f"{native}'s sequence classifier is {what}", POOLED_CLASSIFIERS),
        equals("classifier_bias", dense, f"{native}'s sequence classifier is {what}", POOLED_CLASSIFIERS),
    ]


DECODER_POOLING = pooling("last", "its sequence classifier", ("CoreformerDecoderForSequenceClassification",))
NO_TOKEN_TYPES = equals("type_vocab_size", 0, "no token types")
EVERY_LAYER_FULL = Requirement("layer_types", all_layers("full"), "every layer full attention")
# What every decoder architecture but Mistral and Qwen2 (which slide windows) has.
DECODER_COMMON = (DECODER_POOLING, NO_TOKEN_TYPES, EVERY_LAYER_FULL)
