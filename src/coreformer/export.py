"""coreformer models -> transformers' own architectures (and, through the serve helpers, ONNX and GGUF).

    export_to(source, out, to="native" | "onnx" | "gguf", check=False)   a saved coreformer folder -> OUT
    to_native(model) -> transformers model                                 the same function under a native class
    choose_target(config, class_name) -> (NativeTarget, native class)      or ONE ValueError naming the differences
    check_exported([CheckJob, ...]) -> [CheckResult, ...]                  plain-transformers reload, in a fresh process

Most coreformer configurations ARE a native architecture: a table of targets (`NATIVE_TARGETS`) says, per target,
which family it can represent, which config values it needs (each `Requirement` names the field and the value the
target has), how the config translates, and which native class each coreformer head becomes. The first target whose
requirements all hold is used; when none holds, the error names the closest target and every field that differs:

    target     family    needs (besides the family's defaults)                      native heads
    gpt2       decoder   learned positions, LayerNorm pre-norm, biases, no GQA      GPT2{Model,LMHeadModel,For...}
    llama      decoder   rotary, RMSNorm pre-norm, gated MLP, all layers full       Llama{Model,ForCausalLM,For...}
    mistral    decoder   as llama without biases, every layer sliding               Mistral...
    qwen2      decoder   as llama without biases, layers full or sliding            Qwen2... (q/k/v biases written 0)
    gpt_neox   decoder   rotary, LayerNorm pre-norm, MLP biases, no GQA, all full    GPTNeoX{Model,ForCausalLM,For...}
                         (a GPT-2 block with rotary positions: the decoder presets; sequential residual, full rotary)
    bert       encoder   learned positions from 0, LayerNorm post-norm, types       Bert{Model,ForMaskedLM,For...}
    roberta    encoder   as bert, positions from pad_token_id + 1                   Roberta...
    modernbert encoder   rotary pre-norm GeGLU, no first attention norm, full/sliding      ModernBert{Model,For...}
                         layers (a rope theta each), head transforms (classifier_transform)
    bart       seq2seq   learned positions (offset <= 2), LayerNorm post-norm        Bart{Model,ForConditional...}

The weights are renamed with conversion.py's own rules, read backwards: the native model is built from the
translated config, its weight names are run through `conversion.rename_rules` (and GPT-2's `prepare_weights`), and
each native weight takes the coreformer weight its name converts to. So `convert_from_hf(to_native(m))` is `m`
again by construction (tests/test_export.py checks it for every target and head). Native weights coreformer has no
counterpart for are written as zeros, which adds nothing: BertModel's pooler (pooler_output is then 0), BART's
final_logits_bias when the model has none, Qwen2's q/k/v biases for a model without biases.

The output folder holds config.json (native model_type and architectures, no auto_map), model.safetensors,
generation_config.json for generative heads, the source's tokenizer, and a README.md saying what it was exported
from. It is written atomically (folders.staged_folder); a non-empty OUT is refused unless `overwrite=True`.

`check=True` reloads OUT with plain transformers in a fresh `python -I` process in which importing coreformer
fails (asserted there), runs it on a padded sample batch and, for generative heads, generates a few greedy tokens;
the same runs here on the coreformer model. A difference above `CHECK_TOLERANCE` (fp32) or a different token fails
the export and leaves nothing at OUT.

Never imported by the modeling files: those are copied next to checkpoints, this one is not.
"""

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedConfig, PreTrainedModel

from . import conversion
from .configuration_coreformer import GENERIC_LAYER_TYPES, CoreformerConfig
from .families import head_of_class
from .folders import has_tokenizer, prepare_for_serving, staged_folder
from .layer_types import LAYER_TYPES
from .model_card import CARD_NAME, inherited_license, is_hub_id, validate_model_card
from .modeling_base import CoreformerPreTrainedModel
from .modeling_encoder import CoreformerEncoderForQuestionAnswering

CHECK_TOLERANCE = 1e-5  # fp32: the largest output difference `check` accepts
GREEDY_TOKENS = 5  # new tokens generated greedily by each side for generative heads


class ExportCheckError(RuntimeError):
    """`check=True` found a difference above tolerance (or other tokens); nothing was written to OUT."""


# ---------------------------------------------------------------------------------------------------------------
# What a target needs of the config
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    """One config field a native target fixes: `holds(value, config)`, and what the target has (for the message).

    `heads` limits the requirement to those coreformer classes (a classifier's shape matters only to classifiers).
    """

    field: str
    holds: Callable[[object, CoreformerConfig], bool]
    native: str  # what the target has, in words: "GPT-2 has no gate"
    heads: tuple[str, ...] | None = None

    def difference(self, config: CoreformerConfig, class_name: str) -> str | None:
        if self.heads is not None and class_name not in self.heads:
            return None
        value = getattr(config, self.field, None)
        return None if self.holds(value, config) else f"{self.field}={value!r} ({self.native})"


def equals(field_name: str, expected: object, native: str, heads: tuple[str, ...] | None = None) -> Requirement:
    return Requirement(field_name, lambda value, config: value == expected, native, heads)


def _all_layers(*allowed: str) -> Callable[[object, CoreformerConfig], bool]:
    return lambda value, config: value is not None and len(value) > 0 and set(value) <= set(allowed)


def _standard_head_dim(value, config) -> bool:
    return value * config.num_attention_heads == config.hidden_size


MASKED_LM = ("CoreformerEncoderForMaskedLM",)
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
CAUSAL_LM = ("CoreformerDecoderForCausalLM",)
SEQ2SEQ_LM = ("CoreformerSeq2SeqForConditionalGeneration",)
POOLED_CLASSIFIERS = (
    "CoreformerEncoderForSequenceClassification",
    "CoreformerEncoderForMultipleChoice",
    "CoreformerDecoderForSequenceClassification",
    "CoreformerSeq2SeqForSequenceClassification",
)


def _pooling(pooling: str, native: str, heads: tuple[str, ...]) -> Requirement:
    """The pooled token of a target's sequence classifiers: `pooling` or the family's default (None)."""
    return Requirement(
        "classifier_pooling", lambda value, config: value in (None, pooling), f"{native} pools {pooling!r}", heads
    )


def _every_block_normed(native: str) -> list[Requirement]:
    """The coreformer options no target but ModernBERT has: every block's attention norm, plain classifiers."""
    return [
        equals("first_layer_attention_norm", True, f"{native}'s first layer normalises its attention input"),
        equals("classifier_transform", False, f"{native}'s classifiers have no transform of their own", CLASSIFIERS),
    ]


def _standard_heads(native: str) -> list[Requirement]:
    """One key/value head per query head, each hidden_size / num_attention_heads wide."""
    return [
        Requirement(
            "num_key_value_heads", lambda value, config: value == config.num_attention_heads, f"{native} has no GQA"
        ),
        Requirement("head_dim", _standard_head_dim, f"{native}'s heads are hidden_size / num_attention_heads wide"),
    ]


def _rotary_layernorm_block(native: str, *, embedding_norm: bool, gated: bool) -> list[Requirement]:
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
        *_standard_heads(native),
    ]


def _plain_block(native: str, norm_position: str) -> list[Requirement]:
    """GPT-2 / BERT / BART blocks: LayerNorm, biases everywhere, ungated MLP, one key/value head per query head."""
    return [
        *_every_block_normed(native),
        equals("norm_bias", True, f"{native}'s LayerNorms have biases"),
        equals("norm_type", "layernorm", f"{native} uses LayerNorm"),
        equals("norm_position", norm_position, f"{native} is {norm_position}-norm"),
        equals("attention_bias", True, f"{native} has attention biases"),
        equals("mlp_bias", True, f"{native} has MLP biases"),
        equals("gated_mlp", False, f"{native}'s MLP has no gate"),
        *_standard_heads(native),
        equals("position_embedding_type", "learned", f"{native} learns absolute positions"),
    ]


def _llama_block(native: str) -> list[Requirement]:
    """Llama-style blocks: rotary positions, RMSNorm pre-norm with a final norm, gated MLP, no embedding norm."""
    return [
        *_every_block_normed(native),
        Requirement(
            "local_rope_theta",
            lambda value, config: value in (None, config.rope_theta),
            f"{native} has one rope_theta for every layer",
        ),
        equals("position_embedding_type", "rotary", f"{native} uses rotary positions"),
        equals("norm_type", "rmsnorm", f"{native} uses RMSNorm"),
        equals("norm_position", "pre", f"{native} is pre-norm"),
        equals("final_norm", True, f"{native} has a final norm"),
        equals("embedding_layernorm", False, f"{native} has no embedding norm"),
        equals("scale_embedding", False, f"{native} does not scale embeddings"),
        equals("gated_mlp", True, f"{native}'s MLP is gated"),
        equals("type_vocab_size", 0, f"{native} has no token types"),
    ]


def _heads_plain(lm_transform: bool, lm_bias: bool, native: str) -> list[Requirement]:
    """The LM head and pooled classifier shapes a target has."""
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


def _classifier(dense: bool, native: str) -> list[Requirement]:
    what = "a tanh dense layer and biases" if dense else "a single bias-free projection (score)"
    return [
        equals("classifier_dense", dense, f"{native}'s sequence classifier is {what}", POOLED_CLASSIFIERS),
        equals("classifier_bias", dense, f"{native}'s sequence classifier is {what}", POOLED_CLASSIFIERS),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Config translations: coreformer config -> native config (the inverses of conversion.py's translations)
# ---------------------------------------------------------------------------------------------------------------


def _common_fields(config: CoreformerConfig) -> dict:
    """Labels, special tokens and the LM tie, as every native config names them."""
    return {
        "id2label": dict(config.id2label),
        "label2id": dict(config.label2id),
        "problem_type": config.problem_type,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
    }


def _dropout(config: CoreformerConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout


def _gpt2_config(config: CoreformerConfig) -> PreTrainedConfig:
    return transformers.GPT2Config(
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
        classifier_dropout=_dropout(config),
        initializer_range=config.initializer_range,
        use_cache=config.use_cache,
        **_common_fields(config),
    )


def _llama_fields(config: CoreformerConfig) -> dict:
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layer_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.initializer_range,
        "use_cache": config.use_cache,
        **_common_fields(config),
    }


def _gpt_neox_config(config: CoreformerConfig) -> PreTrainedConfig:
    native = transformers.GPTNeoXConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        layer_norm_eps=config.layer_norm_eps,
        use_parallel_residual=False,  # coreformer's blocks add attention, then the MLP reads the sum
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta, "partial_rotary_factor": 1.0},
        attention_bias=config.attention_bias,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        classifier_dropout=_dropout(config),
        initializer_range=config.initializer_range,
        use_cache=config.use_cache,
        **_common_fields(config),
    )
    # The pre-v5 names of the rotary fields, which transformers 5 no longer writes and llama.cpp's
    # convert_hf_to_gguf.py reads from config.json for GPTNeoXForCausalLM; transformers reads rope_parameters first.
    native.rotary_pct = 1.0
    native.rotary_emb_base = config.rope_theta
    return native


def _transformers_window(config: CoreformerConfig) -> int:
    """transformers' window counts the query itself; coreformer's counts the keys on one side of it."""
    return LAYER_TYPES["sliding"].transformers_window(config.sliding_window)


def _llama_config(config: CoreformerConfig) -> PreTrainedConfig:
    return transformers.LlamaConfig(
        **_llama_fields(config),
        head_dim=config.head_dim,
        attention_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
    )


def _mistral_config(config: CoreformerConfig) -> PreTrainedConfig:
    return transformers.MistralConfig(
        **_llama_fields(config), head_dim=config.head_dim, sliding_window=_transformers_window(config)
    )


def _qwen2_config(config: CoreformerConfig) -> PreTrainedConfig:
    sliding = "sliding" in config.layer_types
    return transformers.Qwen2Config(
        **_llama_fields(config),
        use_sliding_window=sliding,
        sliding_window=_transformers_window(config) if sliding else None,
        layer_types=[GENERIC_LAYER_TYPES[layer_type] for layer_type in config.layer_types],
    )


def _bert_fields(config: CoreformerConfig) -> dict:
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
        **_common_fields(config),
    }


def _bert_config(config: CoreformerConfig) -> PreTrainedConfig:
    return transformers.BertConfig(**_bert_fields(config), max_position_embeddings=config.max_position_embeddings)


def _roberta_config(config: CoreformerConfig) -> PreTrainedConfig:
    # RoBERTa's table also holds the rows below padding_idx + 1 (= coreformer's position_offset).
    return transformers.RobertaConfig(
        **_bert_fields(config), max_position_embeddings=config.max_position_embeddings + config.position_offset
    )


def _bart_config(config: CoreformerConfig) -> PreTrainedConfig:
    return transformers.BartConfig(
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
        classifier_dropout=_dropout(config),
        init_std=config.initializer_range,
        scale_embedding=config.scale_embedding,
        use_cache=config.use_cache,
        decoder_start_token_id=config.decoder_start_token_id,
        forced_eos_token_id=None,  # generation settings travel in generation_config.json
        **_common_fields(config),
    )


def _modernbert_config(config: CoreformerConfig) -> PreTrainedConfig:
    """ModernBERT's local layers see `local_attention // 2` tokens on each side: coreformer's sliding_window."""
    sliding = "sliding" in config.layer_types
    return transformers.ModernBertConfig(
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
        classifier_dropout=_dropout(config),
        classifier_bias=config.head_transform_bias,  # the bias of ModernBERT's prediction head's dense layer
        classifier_activation=config.hidden_act,
        **_common_fields(config),
    )


BART_OFFSET = 2  # BartLearnedPositionalEmbedding.offset


def _bart_positions(config: CoreformerConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BART looks position p up in row p + 2; coreformer in row p + position_offset. A model with a smaller offset
    gets zero rows in front (rows BART never reads), so each position still reads its own row. Converting back gives
    position_offset=2 with those rows: the same function."""
    missing = BART_OFFSET - config.position_offset
    if missing == 0:
        return state_dict
    adapted = dict(state_dict)
    for name, table in state_dict.items():
        if name.endswith("embed_positions.weight"):
            adapted[name] = torch.cat([table.new_zeros(missing, table.shape[1]), table])  # (max + 2, hidden)
    return adapted


# ---------------------------------------------------------------------------------------------------------------
# The table of targets
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NativeTarget:
    """One transformers architecture coreformer models export to.

    Attributes:
        name: the transformers model_type ("llama"), also conversion.py's source key for the way back.
        family: the coreformer family it represents ("encoder" | "decoder" | "seq2seq").
        requirements: what the config must hold; each failing one is a difference named in the refusal.
        native_config: coreformer config -> native config.
        heads: coreformer class name -> native class name.
        zero_filled: regular expressions of native weights coreformer has no counterpart for, written as zeros.
        adapt_weights: rewrites the coreformer state dict into the layout the native weights take (BART's position
            rows), before renaming.
    """

    name: str
    family: str
    requirements: tuple[Requirement, ...]
    native_config: Callable[[CoreformerConfig], PreTrainedConfig]
    heads: dict[str, str]
    zero_filled: tuple[str, ...] = ()
    adapt_weights: Callable[[CoreformerConfig, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None

    def differences(self, config: CoreformerConfig, class_name: str) -> list[str]:
        found = [req.difference(config, class_name) for req in self.requirements]
        return list(filter(None, found))


def _decoder_heads(prefix: str, causal_lm: str | None = None) -> dict[str, str]:
    return {
        "CoreformerDecoderModel": f"{prefix}Model",
        "CoreformerDecoderForCausalLM": causal_lm or f"{prefix}ForCausalLM",
        "CoreformerDecoderForSequenceClassification": f"{prefix}ForSequenceClassification",
        "CoreformerDecoderForTokenClassification": f"{prefix}ForTokenClassification",
    }


def _encoder_heads(prefix: str) -> dict[str, str]:
    return {
        f"CoreformerEncoder{head}": f"{prefix}{head}"
        for head in (
            "Model",
            "ForMaskedLM",
            "ForSequenceClassification",
            "ForTokenClassification",
            "ForQuestionAnswering",
            "ForMultipleChoice",
        )
    }


_DECODER_POOLING = _pooling("last", "its sequence classifier", ("CoreformerDecoderForSequenceClassification",))
_DECODER_COMMON = (
    _DECODER_POOLING,
    equals("type_vocab_size", 0, "no token types"),
    Requirement("layer_types", _all_layers("full"), "every layer full attention"),
)
_ENCODER_COMMON = (
    equals("embedding_layernorm", True, "a LayerNorm on the embeddings"),
    equals("final_norm", False, "no final norm"),
    equals("scale_embedding", False, "embeddings unscaled"),
    Requirement("type_vocab_size", lambda value, config: value >= 1, "token-type embeddings (type_vocab_size >= 1)"),
    Requirement("layer_types", _all_layers("full"), "every layer full attention"),
    _pooling("cls", "BERT", POOLED_ENCODER_HEADS),
    *_heads_plain(True, True, "BERT"),
    *_classifier(True, "BERT"),
)

NATIVE_TARGETS: tuple[NativeTarget, ...] = (
    NativeTarget(
        "gpt2",
        "decoder",
        (
            *_plain_block("GPT-2", "pre"),
            equals("position_offset", 0, "GPT-2 numbers positions from 0"),
            equals("final_norm", True, "GPT-2 has a final norm (ln_f)"),
            equals("embedding_layernorm", False, "GPT-2 has no embedding norm"),
            equals("scale_embedding", False, "GPT-2 does not scale embeddings"),
            *_DECODER_COMMON,
            *_heads_plain(False, False, "GPT-2"),
            *_classifier(False, "GPT-2"),
        ),
        _gpt2_config,
        _decoder_heads("GPT2", causal_lm="GPT2LMHeadModel"),
    ),
    NativeTarget(
        "llama",
        "decoder",
        (*_llama_block("Llama"), *_DECODER_COMMON, *_heads_plain(False, False, "Llama"), *_classifier(False, "Llama")),
        _llama_config,
        _decoder_heads("Llama"),
    ),
    NativeTarget(
        "mistral",
        "decoder",
        (
            *_llama_block("Mistral"),
            equals("attention_bias", False, "Mistral has no attention biases"),
            equals("mlp_bias", False, "Mistral has no MLP biases"),
            equals("type_vocab_size", 0, "no token types"),
            Requirement("layer_types", _all_layers("sliding"), "Mistral slides the window on every layer"),
            _DECODER_POOLING,
            *_heads_plain(False, False, "Mistral"),
            *_classifier(False, "Mistral"),
        ),
        _mistral_config,
        _decoder_heads("Mistral"),
    ),
    NativeTarget(
        "qwen2",
        "decoder",
        (
            *_llama_block("Qwen2"),
            equals("attention_bias", False, "Qwen2's q/k/v biases are written as zeros, and it has no o_proj bias"),
            equals("mlp_bias", False, "Qwen2 has no MLP biases"),
            Requirement("head_dim", _standard_head_dim, "Qwen2's heads are hidden_size / num_attention_heads wide"),
            equals("type_vocab_size", 0, "no token types"),
            Requirement("layer_types", _all_layers("full", "sliding"), "Qwen2 has full and sliding layers only"),
            _DECODER_POOLING,
            *_heads_plain(False, False, "Qwen2"),
            *_classifier(False, "Qwen2"),
        ),
        _qwen2_config,
        _decoder_heads("Qwen2"),
        zero_filled=(r".*\.self_attn\.[qkv]_proj\.bias",),
    ),
    NativeTarget(
        "gpt_neox",
        "decoder",
        (
            *_every_block_normed("GPT-NeoX"),
            *_rotary_layernorm_block("GPT-NeoX", embedding_norm=False, gated=False),
            equals("norm_bias", True, "GPT-NeoX's LayerNorms have biases"),
            equals("mlp_bias", True, "GPT-NeoX has MLP biases"),
            *_DECODER_COMMON,
            *_heads_plain(False, False, "GPT-NeoX"),
            *_classifier(False, "GPT-NeoX"),
        ),
        _gpt_neox_config,
        _decoder_heads("GPTNeoX"),
    ),
    NativeTarget(
        "bert",
        "encoder",
        (
            *_plain_block("BERT", "post"),
            equals("position_offset", 0, "BERT numbers positions from 0"),
            *_ENCODER_COMMON,
        ),
        _bert_config,
        _encoder_heads("Bert"),
        zero_filled=(r"pooler\.dense\.(weight|bias)",),
    ),
    NativeTarget(
        "roberta",
        "encoder",
        (
            *_plain_block("RoBERTa", "post"),
            Requirement(
                "position_offset",
                lambda value, config: config.pad_token_id is not None and value == config.pad_token_id + 1,
                "RoBERTa numbers positions from pad_token_id + 1",
            ),
            equals("hidden_act", "gelu", "RobertaLMHead always uses gelu", MASKED_LM),
            *_ENCODER_COMMON,
        ),
        _roberta_config,
        _encoder_heads("Roberta"),
        zero_filled=(r"pooler\.dense\.(weight|bias)",),
    ),
    NativeTarget(
        "modernbert",
        "encoder",
        (
            *_rotary_layernorm_block("ModernBERT", embedding_norm=True, gated=True),  # GeGLU
            equals("first_layer_attention_norm", False, "ModernBERT's first layer has no attention norm"),
            equals("type_vocab_size", 0, "ModernBERT has no token types"),
            Requirement("layer_types", _all_layers("full", "sliding"), "ModernBERT has global and local layers only"),
            equals("lm_head_transform", True, "ModernBERT's MLM head has its prediction head in front", MASKED_LM),
            Requirement(
                "classifier_pooling",
                lambda value, config: value in (None, "cls", "mean"),
                "ModernBERT pools 'cls' or 'mean'",
                POOLED_ENCODER_HEADS,
            ),
            equals(
                "classifier_transform", True, "ModernBERT's classifiers have its prediction head in front", CLASSIFIERS
            ),
            equals("classifier_dense", False, "ModernBERT's classifier has no tanh dense layer", POOLED_CLASSIFIERS),
            equals("classifier_bias", True, "ModernBERT's classifier has a bias", POOLED_CLASSIFIERS),
        ),
        _modernbert_config,
        _encoder_heads("ModernBert"),
    ),
    NativeTarget(
        "bart",
        "seq2seq",
        (
            *_plain_block("BART", "post"),
            Requirement("position_offset", lambda value, config: value <= BART_OFFSET, "BART stores positions from 2"),
            equals("embedding_layernorm", True, "BART normalises its embeddings"),
            equals("final_norm", False, "BART has no final norm"),
            equals("layer_norm_eps", 1e-5, "BART's LayerNorms use torch's default eps"),
            equals("type_vocab_size", 0, "BART has no token types"),
            Requirement("layer_types", _all_layers("full"), "every encoder layer full attention"),
            Requirement("decoder_layer_types", _all_layers("full"), "every decoder layer full attention"),
            *_heads_plain(False, False, "BART"),
            *_classifier(True, "BART"),
        ),
        _bart_config,
        {
            "CoreformerSeq2SeqModel": "BartModel",
            "CoreformerSeq2SeqForConditionalGeneration": "BartForConditionalGeneration",
            "CoreformerSeq2SeqForSequenceClassification": "BartForSequenceClassification",
        },
        zero_filled=(r"final_logits_bias",),
        adapt_weights=_bart_positions,
    ),
)


def choose_target(config: CoreformerConfig, class_name: str) -> tuple[NativeTarget, str]:
    """The first target that computes exactly what `class_name` with `config` computes, and its native class.

    Raises:
        ValueError: naming the closest target of the family (fewest differences) and every differing field.
    """
    family, _ = head_of_class(class_name)
    candidates = [target for target in NATIVE_TARGETS if target.family == family.name and class_name in target.heads]
    if not candidates:
        raise ValueError(f"{class_name} has no native transformers counterpart to export to.")
    differences = {target.name: target.differences(config, class_name) for target in candidates}
    for target in candidates:
        if not differences[target.name]:
            return target, target.heads[class_name]
    closest = min(candidates, key=lambda target: len(differences[target.name]))
    raise ValueError(
        f"cannot export {class_name} to a native transformers architecture without changing what it computes: the "
        f"closest native architecture is {closest.heads[class_name]}; differs in: "
        f"{'; '.join(differences[closest.name])}. Export to ONNX (--to onnx) keeps any configuration."
    )


# ---------------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------------


def _native_name_map(
    native: PreTrainedModel, model: CoreformerPreTrainedModel, native_names: list[str]
) -> dict[str, str | None]:
    """Every native weight name (after its source's `prepare_weights` where that has an inverse) -> the coreformer
    name conversion.py renames it to (None: a weight conversion drops on purpose)."""
    rules = conversion.rename_rules(native, model)
    names: dict[str, str | None] = {}
    for name in native_names:
        for pattern, target, *transform in rules:
            match = re.fullmatch(pattern, name)
            if match is None:
                continue
            if transform:
                raise ValueError(f"the conversion rule for {name} reshapes it; export has no inverse for it.")
            names[name] = None if target is None else match.expand(target)
            break
        else:
            raise ValueError(f"no conversion rule names the native weight {name}; the export table is incomplete.")
    return names


def _prepared_native_weights(native: PreTrainedModel) -> dict[str, torch.Tensor]:
    source = conversion._SOURCES[native.config.model_type]
    state_dict = dict(native.state_dict())
    if source.restore_weights is None:
        return state_dict
    return source.prepare_weights(native, state_dict)


def _exported_weights(
    native: PreTrainedModel, model: CoreformerPreTrainedModel, target: NativeTarget
) -> dict[str, torch.Tensor]:
    """The native state dict holding `model`'s weights; every coreformer weight must be used."""
    ours = model.state_dict()
    if target.adapt_weights is not None:
        ours = target.adapt_weights(model.config, ours)
    shapes = {name: tensor.shape for name, tensor in _prepared_native_weights(native).items()}
    exported: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, ours_name in _native_name_map(native, model, list(shapes)).items():
        if ours_name in ours:
            value = ours[ours_name]
            used.add(ours_name)
        elif ours_name is None or any(re.fullmatch(pattern, name) for pattern in target.zero_filled):
            value = torch.zeros(shapes[name], dtype=next(iter(ours.values())).dtype)
        else:
            raise ValueError(f"{type(model).__name__} has no {ours_name} for the native weight {name}.")
        if value.shape != shapes[name]:
            raise ValueError(f"{ours_name} is {tuple(value.shape)}, the native {name} {tuple(shapes[name])}.")
        exported[name] = value
    used_storage = {ours[name].data_ptr() for name in used}
    unused = [name for name, tensor in ours.items() if name not in used and tensor.data_ptr() not in used_storage]
    if unused:
        raise ValueError(f"the native {type(native).__name__} has no place for {unused}; the export is incomplete.")
    source = conversion._SOURCES[target.name]
    if source.restore_weights is not None:
        exported = source.restore_weights(native, exported)
    return exported


def to_native(model: CoreformerPreTrainedModel) -> PreTrainedModel:
    """The transformers model computing what `model` computes: same weights, native class, eval mode, same dtype.

    Raises:
        ValueError: when no native architecture computes the same function (the message names the closest one and
            the differing config fields).
    """
    class_name = type(model).__name__
    target, native_class = choose_target(model.config, class_name)
    native_config = target.native_config(model.config)
    if isinstance(model, CoreformerEncoderForQuestionAnswering):
        native_config.num_labels = 2  # a start and an end logit, whatever the config's labels say
    native_config._attn_implementation = model.config._attn_implementation
    native = getattr(transformers, native_class)(native_config)
    native.load_state_dict(_exported_weights(native, model, target), strict=True)
    parameter = next(model.parameters())
    native.to(device=parameter.device, dtype=parameter.dtype)
    if model.can_generate() and native.can_generate():
        native.generation_config = copy.deepcopy(model.generation_config)
    return native.eval()


# ---------------------------------------------------------------------------------------------------------------
# The check: plain transformers, in a fresh process where coreformer cannot be imported
# ---------------------------------------------------------------------------------------------------------------

# Run with `python -I` (no user site, no PYTHON* variables, no script folder on sys.path). An editable install still
# puts coreformer on sys.path, so the child blocks the import and asserts that it fails before loading anything.
_CHECK_CHILD = r"""
import sys
for blocked in ("coreformer", "coreformer_cli"):
    sys.modules[blocked] = None
try:
    import coreformer  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("coreformer is importable in the check process")
import torch
import transformers

jobs = torch.load(sys.argv[1], weights_only=False)
results = []
for job in jobs:
    config = transformers.AutoConfig.from_pretrained(job["folder"], local_files_only=True)
    assert "auto_map" not in config.to_dict(), "the exported config.json asks for remote code"
    model_class = getattr(transformers, config.architectures[0])
    # fp32 whatever the folder holds: the comparison is made in fp32 on both sides.
    model = model_class.from_pretrained(job["folder"], local_files_only=True, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("transformers.models."), type(model).__module__
    result = {"class": type(model).__name__}
    with torch.no_grad():
        outputs = model(**job["inputs"])
        result["outputs"] = {
            key: value for key, value in outputs.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point()
        }
        if job["generate"] is not None:
            result["tokens"] = model.generate(**job["generate"], do_sample=False, num_beams=1,
                                              max_new_tokens=job["new_tokens"])
    if job["texts"]:
        tokenizer = transformers.AutoTokenizer.from_pretrained(job["folder"], local_files_only=True)
        result["token_ids"] = [tokenizer(text)["input_ids"] for text in job["texts"]]
    results.append(result)
torch.save(results, sys.argv[2])
"""

SAMPLE_TEXTS = ("The quick brown fox jumps over the lazy dog.", "Exported models compute the same logits.")


@dataclass
class CheckJob:
    """One exported folder to reload, with the coreformer model it must reproduce."""

    folder: Path
    model: CoreformerPreTrainedModel
    tokenizer: object = None  # the source tokenizer, whose ids the exported one must reproduce


@dataclass
class CheckResult:
    native_class: str
    differences: dict[str, float]  # output name -> max abs difference over real tokens
    tokens_equal: bool | None  # greedy tokens identical (None: not a generative head)
    tokenizer_equal: bool | None  # the exported tokenizer's ids (None: no tokenizer)
    worst: float = field(init=False)

    def __post_init__(self) -> None:
        self.worst = max(self.differences.values(), default=float("inf"))

    @property
    def passed(self) -> bool:
        return self.worst <= CHECK_TOLERANCE and self.tokens_equal is not False and self.tokenizer_equal is not False


def sample_inputs(model: CoreformerPreTrainedModel, seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded batch of random ordinary ids (rows of 12, 9 and 5 tokens, each ending in eos, where BART's
    classifier pools), with token types for encoders that have them: what every target reproduces exactly on its
    real tokens (RoBERTa numbers positions of right-padded rows as coreformer does)."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    special = {
        config.pad_token_id,
        config.bos_token_id,
        config.eos_token_id,
        getattr(config, "decoder_start_token_id", None),
    }
    ordinary = torch.tensor([i for i in range(config.vocab_size) if i not in special])
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    lengths = (12, 9, 5) if config.pad_token_id is not None else (12,)  # no pad id: no padded rows to pool over
    input_ids = torch.full((len(lengths), lengths[0]), pad)
    attention_mask = torch.zeros(len(lengths), lengths[0], dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = ordinary[torch.randint(len(ordinary), (length,), generator=generator)]
        if config.eos_token_id is not None:
            input_ids[row, length - 1] = config.eos_token_id
        attention_mask[row, :length] = 1
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if config.type_vocab_size > 1:
        inputs["token_type_ids"] = (torch.arange(lengths[0]) >= 4).long().expand_as(input_ids) * attention_mask
    if type(model).__name__.endswith("ForMultipleChoice"):
        inputs = {key: value[None] for key, value in inputs.items()}  # (B, T) -> (1, B, T): B choices
    return inputs


def _generation_inputs(model: CoreformerPreTrainedModel, inputs: dict) -> dict | None:
    """The first (unpadded) sample row, for greedy generation; None for heads that do not generate."""
    if not model.can_generate():
        return None
    length = int(inputs["attention_mask"][0].sum())
    return {"input_ids": inputs["input_ids"][:1, :length], "attention_mask": inputs["attention_mask"][:1, :length]}


def _differences(reference: dict, found: dict, mask: torch.Tensor) -> dict[str, float]:
    """Max |reference - found| per shared output; per-token outputs only over real tokens."""
    differences = {}
    for key, value in reference.items():
        other = found.get(key)
        if other is None or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        difference = (value.float() - other.float()).abs()
        if difference.shape[: mask.dim()] == mask.shape:
            difference = difference[mask.bool()]
        differences[key] = difference.max().item() if difference.numel() else 0.0
    return differences


@torch.no_grad()
def check_exported(jobs: list[CheckJob], timeout: float = 900) -> list[CheckResult]:
    """Reload every exported folder in ONE fresh process with plain transformers (coreformer blocked there) and
    compare its outputs, greedy tokens and tokenizer ids with the coreformer models here, in fp32."""
    prepared, references = [], []
    for job in jobs:
        model = job.model.float().eval()
        inputs = sample_inputs(model)
        generate = _generation_inputs(model, inputs)
        outputs = model(**inputs)
        reference = {
            "outputs": {key: value for key, value in outputs.items() if isinstance(value, torch.Tensor)},
            "tokens": None
            if generate is None
            else model.generate(**generate, do_sample=False, num_beams=1, max_new_tokens=GREEDY_TOKENS),
            "token_ids": None if job.tokenizer is None else [job.tokenizer(text)["input_ids"] for text in SAMPLE_TEXTS],
        }
        references.append((reference, inputs["attention_mask"]))
        prepared.append(
            {
                "folder": str(job.folder),
                "inputs": inputs,
                "generate": generate,
                "new_tokens": GREEDY_TOKENS,
                "texts": list(SAMPLE_TEXTS) if job.tokenizer is not None else [],
            }
        )
    with tempfile.TemporaryDirectory(prefix="coreformer-export-check-") as scratch:
        jobs_path, results_path = Path(scratch) / "jobs.pt", Path(scratch) / "results.pt"
        torch.save(prepared, jobs_path)
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        completed = subprocess.run(
            [sys.executable, "-I", "-c", _CHECK_CHILD, str(jobs_path), str(results_path)],
            cwd=scratch,
            env=environment,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if completed.returncode != 0:
            raise RuntimeError(f"the plain-transformers check process failed:\n{completed.stderr[-3000:]}")
        found = torch.load(results_path, weights_only=False)
    results = []
    for (reference, mask), child in zip(references, found):
        tokens_equal = None
        if reference["tokens"] is not None:
            tokens_equal = torch.equal(reference["tokens"], child["tokens"])
        tokenizer_equal = None if reference["token_ids"] is None else reference["token_ids"] == child["token_ids"]
        differences = _differences(reference["outputs"], child["outputs"], mask)
        results.append(CheckResult(child["class"], differences, tokens_equal, tokenizer_equal))
    return results


# ---------------------------------------------------------------------------------------------------------------
# Folders: load, write, card
# ---------------------------------------------------------------------------------------------------------------


def coreformer_class(source: str | Path) -> type[CoreformerPreTrainedModel]:
    """The coreformer class the config.json of the folder `source` names."""
    import coreformer  # the package (registered classes); this module is part of it

    config_path = Path(source) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{source} has no config.json: not a saved model folder.")
    architectures = json.loads(config_path.read_text()).get("architectures") or []
    model_class = getattr(coreformer, architectures[0], None) if architectures else None
    if not (isinstance(model_class, type) and issubclass(model_class, CoreformerPreTrainedModel)):
        raise ValueError(
            f"{source} holds {architectures or 'no architectures'}, not a coreformer model: export takes a folder "
            f"saved by coreformer (pretraining, fine-tuning or `coreformer convert`)."
        )
    return model_class


def _check_destination(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} exists and is not empty; pass --overwrite (overwrite=True) to replace it.")


def _card(
    source: str, out: str, model: CoreformerPreTrainedModel, native: PreTrainedModel, result: CheckResult | None
) -> str:
    """README.md of an exported folder: plain transformers metadata (no custom code), what it was exported from, and
    how to load it from `out` (publishing.card_for_repo points those lines at the repo)."""
    import yaml

    from . import __version__

    _, head = head_of_class(type(model).__name__)
    metadata = {
        "license": inherited_license(source) or "other",
        "library_name": "transformers",
        "tags": ["coreformer", "exported", native.config.model_type],
    }
    if head.pipeline_tag:
        metadata["pipeline_tag"] = head.pipeline_tag
    if is_hub_id(source) and not Path(source).exists():
        metadata["base_model"] = source
    native_class = type(native).__name__
    if result is None:
        check = "not run (`coreformer export --check` reloads the folder with plain transformers and compares)"
    else:
        tokens = {None: "", True: "; greedy tokens identical", False: "; greedy tokens DIFFER"}[result.tokens_equal]
        check = f"max abs difference {result.worst:.3g} (tolerance {CHECK_TOLERANCE}, fp32){tokens}"
    rows = [
        ("exported from", f"`{source}`"),
        ("coreformer class", type(model).__name__),
        ("native class", native_class),
        ("coreformer version", __version__),
        ("check", check),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        f"---\n{yaml.safe_dump(metadata, sort_keys=False)}---\n\n"
        f"# {native_class} exported from {Path(source).name}\n\n"
        f"A coreformer `{type(model).__name__}` written as transformers' own `{native_class}` with `coreformer "
        f"export`: the same weights under {native_class}'s names, computing the same outputs. It loads with plain "
        f"transformers (no `trust_remote_code`, no coreformer) and in engines that know {native_class}.\n\n"
        f"| | |\n|---|---|\n{table}\n\n"
        f"## How to load\n\n```python\nfrom transformers import AutoTokenizer, {head.auto_class}\n\n"
        f'tokenizer = AutoTokenizer.from_pretrained("{out}")\n'
        f'model = {head.auto_class}.from_pretrained("{out}")\n```\n'
    )


def export_native(
    source: str | Path, out: str | Path, *, check: bool = False, overwrite: bool = False
) -> dict[str, object]:
    """Write the native transformers folder of the coreformer folder `source` to `out` (see the module docstring).

    Returns:
        {"out", "native_class", "target", "check"}: check is None, or the max difference and token equality.

    Raises:
        ValueError: no native architecture computes the same function, or `out` is not empty without overwrite.
        ExportCheckError: `check` found a difference; nothing is written.
    """
    out = Path(out)
    _check_destination(out, overwrite)
    model_class = coreformer_class(source)
    choose_target(model_class.config_class.from_pretrained(source), model_class.__name__)  # refuse before loading
    model = model_class.from_pretrained(source).eval()
    native = to_native(model)
    tokenizer = None
    if has_tokenizer(source):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
    result = None
    with staged_folder(out) as staging:
        native.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        causal_lm = (
            type(native).__name__ in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        )
        prepare_for_serving(staging, causal_lm=causal_lm)
        saved = json.loads((staging / "config.json").read_text())
        if "auto_map" in saved:
            raise ValueError(f"the exported config.json names remote code ({saved['auto_map']}); refusing to write.")
        if check:
            (result,) = check_exported([CheckJob(staging, model, tokenizer)])
            if not result.passed:
                raise ExportCheckError(
                    f"check failed: max abs difference {result.worst:.3g} (tolerance {CHECK_TOLERANCE}), greedy tokens "
                    f"equal: {result.tokens_equal}, tokenizer ids equal: {result.tokenizer_equal}; {out} not written."
                )
        card = _card(str(source), str(out), model, native, result)
        validate_model_card(card)
        (staging / CARD_NAME).write_text(card, encoding="utf-8")
        _check_destination(out, overwrite)  # it may have been filled while we worked
    summary = {"out": str(out), "native_class": type(native).__name__, "target": native.config.model_type}
    summary["check"] = (
        None
        if result is None
        else {
            "max_abs_difference": result.worst,
            "differences": result.differences,
            "tokens_equal": result.tokens_equal,
            "tokenizer_equal": result.tokenizer_equal,
        }
    )
    return summary


def _export_onnx(source: Path, out: Path, *, check: bool, overwrite: bool, gguf_dtype: str) -> dict:
    from .onnx_export import export_onnx  # the serve helper's module; imported only when asked for

    _check_destination(out, overwrite)
    return export_onnx(source, out, check=check)


def gguf_path(out: Path, dtype: str) -> Path:
    """OUT for `--to gguf`: a path ending in .gguf is the file itself; anything else is a folder that receives
    `model-<dtype>.gguf`."""
    return out if out.suffix == ".gguf" else out / f"model-{dtype}.gguf"


def _export_gguf(source: Path, out: Path, *, check: bool, overwrite: bool, gguf_dtype: str) -> dict:
    from .gguf_export import export_gguf  # the serve helper's module; imported only when asked for

    path = gguf_path(out, gguf_dtype)
    if path.exists() and not overwrite:
        raise ValueError(f"{path} exists; pass --overwrite (overwrite=True) to replace it.")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coreformer-native-", dir=path.parent) as scratch:
        native_folder = Path(scratch) / "native"
        export_native(source, native_folder)
        return export_gguf(native_folder, path, dtype=gguf_dtype, check=check)


def _export_native(source: Path, out: Path, *, check: bool, overwrite: bool, gguf_dtype: str) -> dict:
    return export_native(source, out, check=check, overwrite=overwrite)


# --to KIND -> the function writing it: (source folder, out, check, overwrite, gguf_dtype) -> summary dict.
EXPORTERS: dict[str, Callable[..., dict]] = {"native": _export_native, "onnx": _export_onnx, "gguf": _export_gguf}
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")


def export_to(
    source: str | Path,
    out: str | Path,
    *,
    to: str = "native",
    check: bool = False,
    overwrite: bool = False,
    gguf_dtype: str = "f32",
) -> dict:
    """Export the coreformer folder `source` to `out`: a native transformers folder (default), an ONNX folder, or a
    GGUF file (`gguf_path`: OUT ending in .gguf, or a folder receiving model-<dtype>.gguf; written from a
    temporary native export). Returns the exporter's summary; see `export_native` for errors."""
    if to not in EXPORTERS:
        raise ValueError(f"unknown export target {to!r}; choose one of {', '.join(EXPORTERS)}.")
    if gguf_dtype not in GGUF_DTYPES:
        raise ValueError(f"unknown GGUF dtype {gguf_dtype!r}; choose one of {', '.join(GGUF_DTYPES)}.")
    source = Path(source)
    if not source.is_dir():
        raise ValueError(f"no such folder: {source} (looked for {source.resolve()}); pass a saved coreformer folder.")
    return EXPORTERS[to](source, Path(out), check=check, overwrite=overwrite, gguf_dtype=gguf_dtype)


__all__ = [
    "CHECK_TOLERANCE",
    "EXPORTERS",
    "NATIVE_TARGETS",
    "CheckJob",
    "CheckResult",
    "ExportCheckError",
    "NativeTarget",
    "Requirement",
    "check_exported",
    "choose_target",
    "export_native",
    "export_to",
    "to_native",
]
