"""transformers BERT / RoBERTa / GPT-2 / BART / Llama / Mistral / Qwen2 / GPT-NeoX / ModernBERT models -> the matching
coreformer models, with exact parity.

    transformers class                      coreformer class
    BertModel, RobertaModel                 CoreformerEncoderModel (the pooler is dropped)
    Bert/RobertaForMaskedLM                 CoreformerEncoderForMaskedLM
    Bert/RobertaForSequenceClassification   CoreformerEncoderForSequenceClassification (BERT pooler -> classifier.dense)
    Bert/RobertaForTokenClassification      CoreformerEncoderForTokenClassification
    Bert/RobertaForQuestionAnswering        CoreformerEncoderForQuestionAnswering
    Bert/RobertaForMultipleChoice           CoreformerEncoderForMultipleChoice (pooler -> classifier.dense)
    GPT2Model                               CoreformerDecoderModel
    GPT2LMHeadModel                         CoreformerDecoderForCausalLM
    GPT2ForSequenceClassification           CoreformerDecoderForSequenceClassification
    GPT2ForTokenClassification              CoreformerDecoderForTokenClassification
    BartModel                               CoreformerSeq2SeqModel
    BartForConditionalGeneration            CoreformerSeq2SeqForConditionalGeneration
    BartForSequenceClassification           CoreformerSeq2SeqForSequenceClassification
    Llama/Mistral/Qwen2Model                CoreformerDecoderModel (rotary, RMSNorm, gated MLP, GQA)
    Llama/Mistral/Qwen2ForCausalLM          CoreformerDecoderForCausalLM
    Llama/Mistral/Qwen2ForSequenceClass.    CoreformerDecoderForSequenceClassification (score -> classifier.out_proj)
    Llama/Mistral/Qwen2ForTokenClass.       CoreformerDecoderForTokenClassification (score -> classifier)
    GPTNeoXModel                            CoreformerDecoderModel (rotary, LayerNorm pre-norm, biases; sequential
                                            residual and full rotary only: use_parallel_residual=False,
                                            partial_rotary_factor=1.0)
    GPTNeoXForCausalLM                      CoreformerDecoderForCausalLM
    GPTNeoXForSequenceClassification       CoreformerDecoderForSequenceClassification (score -> classifier.out_proj)
    GPTNeoXForTokenClassification          CoreformerDecoderForTokenClassification
    ModernBertModel                         CoreformerEncoderModel (rotary GeGLU pre-norm, global/local layers with
                                            a rope theta each, first_layer_attention_norm=False)
    ModernBertForMaskedLM                   CoreformerEncoderForMaskedLM (head -> lm_head_transform)
    ModernBertFor{Sequence,Token}Class.,    CoreformerEncoderFor... (head -> head_transform, classifier_transform;
    ...ForQuestionAnswering, ...ForMultipleChoice   classifier_pooling "cls" / "mean")

`convert_from_hf` translates the config, renames every weight through a table of regular expressions and loads the
result with `load_state_dict(strict=True)`: a source weight no rule claims, or a coreformer parameter no weight fills,
raises instead of leaving random values behind. Options that change what the network computes and have no coreformer
equivalent raise one `ValueError` naming the option.

Never imported by the modeling files: those are copied next to checkpoints, this one is not.
"""

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.pytorch_utils import Conv1D

from .configuration_coreformer import (
    CoreformerConfig,
    CoreformerDecoderConfig,
    CoreformerEncoderConfig,
    CoreformerSeq2SeqConfig,
)
from .modeling_base import CoreformerPreTrainedModel
from .modeling_decoder import (
    CoreformerDecoderForCausalLM,
    CoreformerDecoderForSequenceClassification,
    CoreformerDecoderForTokenClassification,
    CoreformerDecoderModel,
)
from .modeling_encoder import (
    CoreformerEncoderForMaskedLM,
    CoreformerEncoderForMultipleChoice,
    CoreformerEncoderForQuestionAnswering,
    CoreformerEncoderForSequenceClassification,
    CoreformerEncoderForTokenClassification,
    CoreformerEncoderModel,
)
from .modeling_seq2seq import (
    CoreformerSeq2SeqForConditionalGeneration,
    CoreformerSeq2SeqForSequenceClassification,
    CoreformerSeq2SeqModel,
)

# A rule renames the source weights whose name matches `pattern` (re.fullmatch) to `match.expand(target)`, optionally
# reshaping the tensor; target None drops the weight on purpose.
Rule = tuple[str, str | None] | tuple[str, str, Callable[[torch.Tensor], torch.Tensor]]

_WB = r"(weight|bias)"

# Base-model weights, relative to the base model on both sides (BertModel keys / CoreformerEncoderModel keys).
_BERT_BASE_RULES: list[Rule] = [
    (r"embeddings\.word_embeddings\.weight", "encoder.embed_tokens.weight"),
    (r"embeddings\.position_embeddings\.weight", "encoder.embed_positions.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "encoder.token_type_embeddings.weight"),
    (rf"embeddings\.LayerNorm\.{_WB}", r"encoder.embedding_norm.\1"),
    (rf"encoder\.layer\.(\d+)\.attention\.self\.query\.{_WB}", r"encoder.layers.\1.self_attn.q_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.attention\.self\.key\.{_WB}", r"encoder.layers.\1.self_attn.k_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.attention\.self\.value\.{_WB}", r"encoder.layers.\1.self_attn.v_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.attention\.output\.dense\.{_WB}", r"encoder.layers.\1.self_attn.o_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.{_WB}", r"encoder.layers.\1.self_attn_norm.\2"),
    (rf"encoder\.layer\.(\d+)\.intermediate\.dense\.{_WB}", r"encoder.layers.\1.mlp.up_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.output\.dense\.{_WB}", r"encoder.layers.\1.mlp.down_proj.\2"),
    (rf"encoder\.layer\.(\d+)\.output\.LayerNorm\.{_WB}", r"encoder.layers.\1.mlp_norm.\2"),
]

# GPT-2 after `_unfuse_gpt2`: Conv1D weights transposed to (out, in), c_attn split into q/k/v pseudo-names.
_GPT2_BASE_RULES: list[Rule] = [
    (r"wte\.weight", "decoder.embed_tokens.weight"),
    (r"wpe\.weight", "decoder.embed_positions.weight"),
    (rf"h\.(\d+)\.ln_1\.{_WB}", r"decoder.layers.\1.self_attn_norm.\2"),
    (rf"h\.(\d+)\.attn\.([qkv])_proj\.{_WB}", r"decoder.layers.\1.self_attn.\2_proj.\3"),
    (rf"h\.(\d+)\.attn\.c_proj\.{_WB}", r"decoder.layers.\1.self_attn.o_proj.\2"),
    (rf"h\.(\d+)\.ln_2\.{_WB}", r"decoder.layers.\1.mlp_norm.\2"),
    (rf"h\.(\d+)\.mlp\.c_fc\.{_WB}", r"decoder.layers.\1.mlp.up_proj.\2"),
    (rf"h\.(\d+)\.mlp\.c_proj\.{_WB}", r"decoder.layers.\1.mlp.down_proj.\2"),
    (rf"ln_f\.{_WB}", r"decoder.norm.\1"),
]

# Llama, Mistral and Qwen2 share their names: pre-norm blocks, RMSNorm, gated MLP, a final norm.
_LLAMA_BASE_RULES: list[Rule] = [
    (r"embed_tokens\.weight", "decoder.embed_tokens.weight"),
    (rf"layers\.(\d+)\.self_attn\.([qkvo])_proj\.{_WB}", r"decoder.layers.\1.self_attn.\2_proj.\3"),
    (r"layers\.(\d+)\.input_layernorm\.weight", r"decoder.layers.\1.self_attn_norm.weight"),
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", r"decoder.layers.\1.mlp_norm.weight"),
    (rf"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.{_WB}", r"decoder.layers.\1.mlp.\2_proj.\3"),
    (r"norm\.weight", "decoder.norm.weight"),
]

# GPT-NeoX after `_unfuse_gpt_neox`: the fused query_key_value split into q/k/v pseudo-names.
_GPT_NEOX_BASE_RULES: list[Rule] = [
    (r"embed_in\.weight", "decoder.embed_tokens.weight"),
    (rf"layers\.(\d+)\.input_layernorm\.{_WB}", r"decoder.layers.\1.self_attn_norm.\2"),
    (rf"layers\.(\d+)\.attention\.([qkv])_proj\.{_WB}", r"decoder.layers.\1.self_attn.\2_proj.\3"),
    (rf"layers\.(\d+)\.attention\.dense\.{_WB}", r"decoder.layers.\1.self_attn.o_proj.\2"),
    (rf"layers\.(\d+)\.post_attention_layernorm\.{_WB}", r"decoder.layers.\1.mlp_norm.\2"),
    (rf"layers\.(\d+)\.mlp\.dense_h_to_4h\.{_WB}", r"decoder.layers.\1.mlp.up_proj.\2"),
    (rf"layers\.(\d+)\.mlp\.dense_4h_to_h\.{_WB}", r"decoder.layers.\1.mlp.down_proj.\2"),
    (rf"final_layer_norm\.{_WB}", r"decoder.norm.\1"),
]

# ModernBERT after `_unfuse_modernbert`: Wqkv split into q/k/v pseudo-names, Wi into gate (the activated half) and up.
_MODERNBERT_BASE_RULES: list[Rule] = [
    (r"embeddings\.tok_embeddings\.weight", "encoder.embed_tokens.weight"),
    (rf"embeddings\.norm\.{_WB}", r"encoder.embedding_norm.\1"),
    (rf"layers\.(\d+)\.attn_norm\.{_WB}", r"encoder.layers.\1.self_attn_norm.\2"),
    (rf"layers\.(\d+)\.attn\.([qkv])_proj\.{_WB}", r"encoder.layers.\1.self_attn.\2_proj.\3"),
    (rf"layers\.(\d+)\.attn\.Wo\.{_WB}", r"encoder.layers.\1.self_attn.o_proj.\2"),
    (rf"layers\.(\d+)\.mlp_norm\.{_WB}", r"encoder.layers.\1.mlp_norm.\2"),
    (rf"layers\.(\d+)\.mlp\.(gate|up)_proj\.{_WB}", r"encoder.layers.\1.mlp.\2_proj.\3"),
    (rf"layers\.(\d+)\.mlp\.Wo\.{_WB}", r"encoder.layers.\1.mlp.down_proj.\2"),
    (rf"final_norm\.{_WB}", r"encoder.norm.\1"),
]

_STACK = r"(encoder|decoder)\.layers\.(\d+)"
_BART_BASE_RULES: list[Rule] = [
    (r"shared\.weight", "shared.weight"),
    (r"(encoder|decoder)\.embed_tokens\.weight", r"\1.embed_tokens.weight"),
    (r"(encoder|decoder)\.embed_positions\.weight", r"\1.embed_positions.weight"),
    (rf"(encoder|decoder)\.layernorm_embedding\.{_WB}", r"\1.embedding_norm.\2"),
    (rf"{_STACK}\.self_attn\.([qkv])_proj\.{_WB}", r"\1.layers.\2.self_attn.\3_proj.\4"),
    (rf"{_STACK}\.self_attn\.out_proj\.{_WB}", r"\1.layers.\2.self_attn.o_proj.\3"),
    (rf"{_STACK}\.self_attn_layer_norm\.{_WB}", r"\1.layers.\2.self_attn_norm.\3"),
    (rf"decoder\.layers\.(\d+)\.encoder_attn\.([qkv])_proj\.{_WB}", r"decoder.layers.\1.cross_attn.\2_proj.\3"),
    (rf"decoder\.layers\.(\d+)\.encoder_attn\.out_proj\.{_WB}", r"decoder.layers.\1.cross_attn.o_proj.\2"),
    (rf"decoder\.layers\.(\d+)\.encoder_attn_layer_norm\.{_WB}", r"decoder.layers.\1.cross_attn_norm.\2"),
    (rf"{_STACK}\.fc1\.{_WB}", r"\1.layers.\2.mlp.up_proj.\3"),
    (rf"{_STACK}\.fc2\.{_WB}", r"\1.layers.\2.mlp.down_proj.\3"),
    (rf"{_STACK}\.final_layer_norm\.{_WB}", r"\1.layers.\2.mlp_norm.\3"),
]

# Head weights, with their full source names (base-model prefix included) and full coreformer names.
_BERT_MLM_RULES: tuple[Rule, ...] = (
    (rf"cls\.predictions\.transform\.dense\.{_WB}", r"lm_head_transform.dense.\1"),
    (rf"cls\.predictions\.transform\.LayerNorm\.{_WB}", r"lm_head_transform.norm.\1"),
    (r"cls\.predictions\.decoder\.weight", "lm_head.weight"),
    # transformers ties decoder.bias to predictions.bias: both names fill the one lm_head.bias.
    (r"cls\.predictions\.(decoder\.)?bias", "lm_head.bias"),
)
_ROBERTA_MLM_RULES: tuple[Rule, ...] = (
    (rf"lm_head\.dense\.{_WB}", r"lm_head_transform.dense.\1"),
    (rf"lm_head\.layer_norm\.{_WB}", r"lm_head_transform.norm.\1"),
    (r"lm_head\.decoder\.weight", "lm_head.weight"),
    (r"lm_head\.(decoder\.)?bias", "lm_head.bias"),
)
_DROP_POOLER: tuple[Rule, ...] = ((rf"pooler\.dense\.{_WB}", None),)


def _pooler_classifier_rules(prefix: str) -> tuple[Rule, ...]:
    """BERT's pooler (tanh dense on [CLS]) + classifier is our ClassificationHead's dense + out_proj."""
    return (
        (rf"{prefix}\.pooler\.dense\.{_WB}", r"classifier.dense.\1"),
        (rf"classifier\.{_WB}", r"classifier.out_proj.\1"),
    )


_SAME_NAME_CLASSIFIER: tuple[Rule, ...] = ((rf"classifier\.{_WB}", r"classifier.\1"),)
_QA_RULES: tuple[Rule, ...] = ((rf"qa_outputs\.{_WB}", r"qa_outputs.\1"),)


@dataclass(frozen=True)
class _Conversion:
    """How one transformers class becomes one coreformer class."""

    family: str  # the source model_type, a key of _SOURCES: "bert" | "roberta" | "gpt2" | "bart" | "llama" | ...
    target: type[CoreformerPreTrainedModel]
    head_rules: tuple[Rule, ...] = ()
    # Config fields this head sets over the family's translation (what the source head does differently).
    head_config: tuple[tuple[str, object], ...] = ()


_CONVERSIONS: dict[str, _Conversion] = {
    "BertModel": _Conversion("bert", CoreformerEncoderModel, _DROP_POOLER),
    "BertForMaskedLM": _Conversion("bert", CoreformerEncoderForMaskedLM, _BERT_MLM_RULES),
    "BertForSequenceClassification": _Conversion(
        "bert", CoreformerEncoderForSequenceClassification, _pooler_classifier_rules("bert")
    ),
    "BertForTokenClassification": _Conversion("bert", CoreformerEncoderForTokenClassification, _SAME_NAME_CLASSIFIER),
    "BertForQuestionAnswering": _Conversion("bert", CoreformerEncoderForQuestionAnswering, _QA_RULES),
    "BertForMultipleChoice": _Conversion("bert", CoreformerEncoderForMultipleChoice, _pooler_classifier_rules("bert")),
    "RobertaModel": _Conversion("roberta", CoreformerEncoderModel, _DROP_POOLER),
    "RobertaForMaskedLM": _Conversion("roberta", CoreformerEncoderForMaskedLM, _ROBERTA_MLM_RULES),
    "RobertaForSequenceClassification": _Conversion(
        "roberta",
        CoreformerEncoderForSequenceClassification,
        ((rf"classifier\.(dense|out_proj)\.{_WB}", r"classifier.\1.\2"),),
        (("classifier_dropout_before_dense", True),),  # RobertaClassificationHead: dropout, dense, dropout
    ),
    "RobertaForTokenClassification": _Conversion(
        "roberta", CoreformerEncoderForTokenClassification, _SAME_NAME_CLASSIFIER
    ),
    "RobertaForQuestionAnswering": _Conversion("roberta", CoreformerEncoderForQuestionAnswering, _QA_RULES),
    "RobertaForMultipleChoice": _Conversion(
        "roberta", CoreformerEncoderForMultipleChoice, _pooler_classifier_rules("roberta")
    ),
    "GPT2Model": _Conversion("gpt2", CoreformerDecoderModel),
    "GPT2LMHeadModel": _Conversion("gpt2", CoreformerDecoderForCausalLM, ((r"lm_head\.weight", "lm_head.weight"),)),
    "GPT2ForSequenceClassification": _Conversion(
        "gpt2",
        CoreformerDecoderForSequenceClassification,
        ((r"score\.weight", "classifier.out_proj.weight"),),
        (("classifier_dropout", 0.0),),  # GPT-2's `score` has no dropout in front of it
    ),
    "GPT2ForTokenClassification": _Conversion("gpt2", CoreformerDecoderForTokenClassification, _SAME_NAME_CLASSIFIER),
    "BartModel": _Conversion("bart", CoreformerSeq2SeqModel),
    "BartForConditionalGeneration": _Conversion(
        "bart",
        CoreformerSeq2SeqForConditionalGeneration,
        ((r"lm_head\.weight", "lm_head.weight"), (r"final_logits_bias", "final_logits_bias")),
        (("final_logits_bias", True),),  # a buffer, never trained, as in BART
    ),
    "BartForSequenceClassification": _Conversion(
        "bart",
        CoreformerSeq2SeqForSequenceClassification,
        ((rf"classification_head\.(dense|out_proj)\.{_WB}", r"classifier.\1.\2"),),
        (("classifier_dropout_before_dense", True),),  # BartClassificationHead: dropout, dense, dropout
    ),
}


def _llama_style_conversions(family: str, prefix: str) -> dict[str, _Conversion]:
    """Llama, Mistral and Qwen2 heads: the same names, transformers' generic sequence and token classifiers."""
    return {
        f"{prefix}Model": _Conversion(family, CoreformerDecoderModel),
        f"{prefix}ForCausalLM": _Conversion(
            family, CoreformerDecoderForCausalLM, ((r"lm_head\.weight", "lm_head.weight"),)
        ),
        f"{prefix}ForSequenceClassification": _Conversion(
            family,
            CoreformerDecoderForSequenceClassification,
            ((r"score\.weight", "classifier.out_proj.weight"),),
            (("classifier_dropout", 0.0),),  # GenericForSequenceClassification: no dropout before `score`
        ),
        f"{prefix}ForTokenClassification": _Conversion(
            family, CoreformerDecoderForTokenClassification, ((rf"score\.{_WB}", r"classifier.\1"),)
        ),
    }


for _family, _prefix in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2")):
    _CONVERSIONS.update(_llama_style_conversions(_family, _prefix))

_CONVERSIONS.update(
    {
        "GPTNeoXModel": _Conversion("gpt_neox", CoreformerDecoderModel),
        "GPTNeoXForCausalLM": _Conversion(
            "gpt_neox", CoreformerDecoderForCausalLM, ((r"lm_head\.weight", "lm_head.weight"),)
        ),
        "GPTNeoXForSequenceClassification": _Conversion(
            "gpt_neox",
            CoreformerDecoderForSequenceClassification,
            ((r"score\.weight", "classifier.out_proj.weight"),),
            (("classifier_dropout", 0.0),),  # GPTNeoXForSequenceClassification: no dropout before `score`
        ),
        # Its dropout (config.classifier_dropout) and a biased `classifier`, as coreformer's token head.
        "GPTNeoXForTokenClassification": _Conversion(
            "gpt_neox", CoreformerDecoderForTokenClassification, _SAME_NAME_CLASSIFIER
        ),
    }
)

# ModernBERT's heads all start with its prediction head `head` (dense -> act -> norm): the MLM transform, or a
# classifier's `head_transform` (config.classifier_transform); `classifier` is the output projection.
_MODERNBERT_HEAD = ((rf"head\.(dense|norm)\.{_WB}", r"head_transform.\1.\2"),)
_CONVERSIONS.update(
    {
        "ModernBertModel": _Conversion("modernbert", CoreformerEncoderModel),
        "ModernBertForMaskedLM": _Conversion(
            "modernbert",
            CoreformerEncoderForMaskedLM,
            (
                (rf"head\.(dense|norm)\.{_WB}", r"lm_head_transform.\1.\2"),
                (rf"decoder\.{_WB}", r"lm_head.\1"),
            ),
        ),
        "ModernBertForSequenceClassification": _Conversion(
            "modernbert",
            CoreformerEncoderForSequenceClassification,
            (*_MODERNBERT_HEAD, (rf"classifier\.{_WB}", r"classifier.out_proj.\1")),
        ),
        "ModernBertForTokenClassification": _Conversion(
            "modernbert", CoreformerEncoderForTokenClassification, (*_MODERNBERT_HEAD, *_SAME_NAME_CLASSIFIER)
        ),
        "ModernBertForQuestionAnswering": _Conversion(
            "modernbert",
            CoreformerEncoderForQuestionAnswering,
            (*_MODERNBERT_HEAD, (rf"classifier\.{_WB}", r"qa_outputs.\1")),
        ),
        "ModernBertForMultipleChoice": _Conversion(
            "modernbert",
            CoreformerEncoderForMultipleChoice,
            (*_MODERNBERT_HEAD, (rf"classifier\.{_WB}", r"classifier.out_proj.\1")),
        ),
    }
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_CONVERSIONS)


def _unsupported(model_name: str, option: str, why: str) -> ValueError:
    return ValueError(f"cannot convert this {model_name} checkpoint: {option} {why}; coreformer has no equivalent.")


def _label_fields(config: PreTrainedConfig) -> dict:
    """Head labels: id2label / label2id (which fix num_labels) and problem_type."""
    id2label = dict(config.id2label)
    label2id = dict(config.label2id) if config.label2id else {label: i for i, label in id2label.items()}
    return {"id2label": id2label, "label2id": label2id, "problem_type": config.problem_type}


def _token_fields(config: PreTrainedConfig, *names: str) -> dict:
    return {name: getattr(config, name, None) for name in names}


def _check_activation(model_name: str, act) -> str:
    if not isinstance(act, str) or act not in ACT2FN:
        raise _unsupported(model_name, f"hidden_act={act!r}", "is not a transformers ACT2FN name")
    return act


def _encoder_config(config: PreTrainedConfig, is_mlm: bool, roberta: bool = False) -> CoreformerEncoderConfig:
    """BERT / RoBERTa: post-norm, learned absolute positions, token types, embedding LayerNorm, MLM transform."""
    name = "RoBERTa" if roberta else "BERT"
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        # transformers 5 dropped relative_key(_query) and silently ignores the field; the checkpoint was trained
        # with it, so neither model reproduces it.
        raise _unsupported(name, f"position_embedding_type={position_type!r}", "(relative positions)")
    if config.is_decoder or config.add_cross_attention:
        raise _unsupported(name, "is_decoder/add_cross_attention=True", "(a causal BERT decoder)")
    hidden_act = _check_activation(name, config.hidden_act)
    if roberta and is_mlm and hidden_act != "gelu":
        # RobertaLMHead hard-codes erf gelu whatever hidden_act says; our MLM transform uses hidden_act.
        raise _unsupported(name, f"hidden_act={hidden_act!r} with an MLM head", "(RobertaLMHead always uses gelu)")
    positions = {"max_position_embeddings": config.max_position_embeddings, "position_offset": 0}
    if roberta:
        if config.pad_token_id is None:
            raise _unsupported(name, "pad_token_id=None", "(RoBERTa numbers positions from padding_idx + 1)")
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
        tie_word_embeddings=config.tie_word_embeddings,
        **_token_fields(config, "pad_token_id", "bos_token_id", "eos_token_id"),
        **_label_fields(config),
    )


def _decoder_config(config: PreTrainedConfig, is_mlm: bool) -> CoreformerDecoderConfig:
    """GPT-2: pre-norm with a final norm, learned positions, no embedding norm, tied LM head."""
    if not config.scale_attn_weights:
        raise _unsupported("GPT-2", "scale_attn_weights=False", "(unscaled attention scores)")
    if config.scale_attn_by_inverse_layer_idx:
        raise _unsupported("GPT-2", "scale_attn_by_inverse_layer_idx=True", "(per-layer score scaling)")
    if config.reorder_and_upcast_attn:
        raise _unsupported("GPT-2", "reorder_and_upcast_attn=True", "(keys scaled before the product)")
    if config.add_cross_attention:
        raise _unsupported("GPT-2", "add_cross_attention=True", "(cross-attention in a GPT-2 decoder)")
    # GPT2ForTokenClassification's rule for its dropout (GPT2ForSequenceClassification has none: its head_config).
    classifier_dropout = getattr(config, "classifier_dropout", None)
    if classifier_dropout is None:
        classifier_dropout = getattr(config, "hidden_dropout", None)
    return CoreformerDecoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        intermediate_size=config.n_inner if config.n_inner is not None else 4 * config.n_embd,
        hidden_act=_check_activation("GPT-2", config.activation_function),
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
        classifier_dropout=0.1 if classifier_dropout is None else classifier_dropout,
        lm_head_transform=False,
        lm_head_bias=False,
        classifier_dense=False,
        classifier_bias=False,
        initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_word_embeddings,
        use_cache=config.use_cache,
        **_token_fields(config, "pad_token_id", "bos_token_id", "eos_token_id"),
        **_label_fields(config),
    )


def _seq2seq_config(config: PreTrainedConfig, is_mlm: bool) -> CoreformerSeq2SeqConfig:
    """BART: post-norm encoder and decoder, positions stored from 2, embedding LayerNorm, optional sqrt(d) scale."""
    if config.encoder_attention_heads != config.decoder_attention_heads:
        raise _unsupported(
            "BART",
            f"encoder_attention_heads={config.encoder_attention_heads} != decoder_attention_heads="
            f"{config.decoder_attention_heads}",
            "(coreformer has one num_attention_heads for both stacks)",
        )
    if config.encoder_ffn_dim != config.decoder_ffn_dim:
        raise _unsupported(
            "BART",
            f"encoder_ffn_dim={config.encoder_ffn_dim} != decoder_ffn_dim={config.decoder_ffn_dim}",
            "(coreformer has one intermediate_size for both stacks)",
        )
    # Flags of fairseq-era (m)BART configs that transformers 5's BartModel ignores: a checkpoint that sets them was
    # trained as another network, which neither transformers' BART nor coreformer reproduces.
    for flag, plain_value in {
        "normalize_before": False,
        "add_final_layer_norm": False,
        "static_position_embeddings": False,
        "add_bias_logits": False,
        "normalize_embedding": True,
    }.items():
        value = getattr(config, flag, plain_value)
        if value != plain_value:
            raise _unsupported("BART", f"{flag}={value!r}", "(not a plain post-norm BART)")
    return CoreformerSeq2SeqConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        num_attention_heads=config.encoder_attention_heads,
        intermediate_size=config.encoder_ffn_dim,
        hidden_act=_check_activation("BART", config.activation_function),
        max_position_embeddings=config.max_position_embeddings,
        position_embedding_type="learned",
        position_offset=2,  # BartLearnedPositionalEmbedding.offset
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
        lm_head_bias=False,  # BART's logits bias is final_logits_bias, a buffer: see its head_config
        classifier_dense=True,
        classifier_bias=True,
        initializer_range=config.init_std,
        tie_word_embeddings=config.tie_word_embeddings,
        use_cache=config.use_cache,
        **_token_fields(config, "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"),
        **_label_fields(config),
    )


def _rope_theta(model_name: str, config: PreTrainedConfig) -> float:
    """The base of plain rotary positions; scaled variants (linear, dynamic, YaRN, Llama 3) have no coreformer field."""
    rope = dict(config.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise _unsupported(model_name, f"rope_parameters.rope_type={rope_type!r}", "(scaled rotary frequencies)")
    return float(rope.get("rope_theta", getattr(config, "default_theta", 10000.0)))


def _rotary_decoder_fields(config: PreTrainedConfig, name: str) -> dict:
    """What the Llama-style and GPT-NeoX readers share: rotary pre-norm blocks with a final norm, no embedding norm, no
    token types, an LM projection without transform or bias, a bias-free `score` classifier; sizes, tokens, labels."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": _check_activation(name, config.hidden_act),
        "max_position_embeddings": config.max_position_embeddings,
        "position_embedding_type": "rotary",
        "rope_theta": _rope_theta(name, config),
        "type_vocab_size": 0,
        "norm_position": "pre",
        "embedding_layernorm": False,
        "final_norm": True,
        "attention_dropout": config.attention_dropout,
        "lm_head_transform": False,
        "lm_head_bias": False,
        "classifier_dense": False,
        "classifier_bias": False,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_cache": config.use_cache,
        **_token_fields(config, "pad_token_id", "bos_token_id", "eos_token_id"),
        **_label_fields(config),
    }


def _llama_config(config: PreTrainedConfig, is_mlm: bool, name: str = "Llama", **fields) -> CoreformerDecoderConfig:
    """Llama: rotary, RMSNorm pre-norm blocks with a final norm, gated MLP, grouped-query attention, no embedding norm.
    `fields` are what the Mistral / Qwen2 translations set on top (sliding layers, biases)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    translated = {
        **_rotary_decoder_fields(config, name),
        "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
        "head_dim": head_dim,
        "gated_mlp": True,
        "norm_type": "rmsnorm",
        "layer_norm_eps": config.rms_norm_eps,
        "attention_bias": getattr(config, "attention_bias", False),
        "mlp_bias": getattr(config, "mlp_bias", False),
        "hidden_dropout": 0.0,  # Llama has no dropout on embeddings or residual branches
        "classifier_dropout": 0.1,  # GenericForTokenClassification's fallback (these configs have no dropout field)
    }
    return CoreformerDecoderConfig(**{**translated, **fields})


def _sliding_fields(config: PreTrainedConfig, layer_types: list[str]) -> dict:
    """Sliding layers: transformers' window counts the query itself, coreformer's counts the keys before it."""
    if "sliding_attention" not in layer_types or config.sliding_window is None:
        return {"layer_types": ["full"] * len(layer_types)}
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise _unsupported(type(config).__name__, f"layer_types with {unknown}", "(attention types)")
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    return {"layer_types": [names[kind] for kind in layer_types], "sliding_window": config.sliding_window - 1}


def _mistral_config(config: PreTrainedConfig, is_mlm: bool) -> CoreformerDecoderConfig:
    """Mistral: Llama without biases, every layer sliding when `sliding_window` is set."""
    layers = ["sliding_attention" if config.sliding_window is not None else "full_attention"] * config.num_hidden_layers
    return _llama_config(config, is_mlm, "Mistral", **_sliding_fields(config, layers))


def _qwen2_config(config: PreTrainedConfig, is_mlm: bool) -> CoreformerDecoderConfig:
    """Qwen2: Llama with q/k/v biases (see `_qwen2_weights`), sliding layers where `layer_types` says so."""
    return _llama_config(config, is_mlm, "Qwen2", **_sliding_fields(config, list(config.layer_types)))


def _gpt_neox_config(config: PreTrainedConfig, is_mlm: bool) -> CoreformerDecoderConfig:
    """GPT-NeoX with a sequential residual and rotary positions on whole heads is a GPT-2 block with rotary positions:
    LayerNorm pre-norm with a final norm, biased ungated MLP, optional attention biases, no embedding norm."""
    if config.use_parallel_residual:
        raise _unsupported(
            "GPT-NeoX", "use_parallel_residual=True", "(attention and MLP read the same input, added in parallel)"
        )
    rope = dict(config.rope_parameters or {})
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise _unsupported(
            "GPT-NeoX", f"rope_parameters.partial_rotary_factor={partial!r}", "(rotary on part of each head)"
        )
    return CoreformerDecoderConfig(
        **_rotary_decoder_fields(config, "GPT-NeoX"),
        norm_type="layernorm",
        layer_norm_eps=config.layer_norm_eps,
        attention_bias=config.attention_bias,
        mlp_bias=True,  # GPTNeoXMLP's two Linear layers always have biases
        hidden_dropout=config.hidden_dropout,
        classifier_dropout=config.classifier_dropout,
    )


# ModernBERT's layer types -> coreformer's (its `layer_types` rule: global every `global_attn_every_n_layers`).
_MODERNBERT_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _modernbert_config(config: PreTrainedConfig, is_mlm: bool) -> CoreformerEncoderConfig:
    """ModernBERT: rotary pre-norm GeGLU blocks without biases, alternating global ("full") and local ("sliding")
    layers with a rotary base each, LayerNorms (biases optional) on the embeddings and at the end, no attention norm in
    the first layer, and a prediction head (dense -> act -> norm) in front of every head.

    Its local layers see `local_attention // 2` tokens on each side (`ModernBertConfig.sliding_window`), which is
    coreformer's `sliding_window`. Dropouts (embedding_dropout, mlp_dropout, the attention output dropout) are
    training-time only: coreformer's hidden_dropout takes embedding_dropout.
    """
    hidden_act = _check_activation("ModernBERT", config.hidden_activation)
    if config.classifier_activation != hidden_act:
        raise _unsupported(
            "ModernBERT",
            f"classifier_activation={config.classifier_activation!r} != hidden_activation={hidden_act!r}",
            "(coreformer's head transforms use hidden_act)",
        )
    unknown = sorted(set(config.layer_types) - set(_MODERNBERT_LAYER_TYPES))
    if unknown:
        raise _unsupported("ModernBERT", f"layer_types with {unknown}", "(attention types)")
    layer_types = [_MODERNBERT_LAYER_TYPES[kind] for kind in config.layer_types]
    thetas = {}
    for kind in dict.fromkeys(config.layer_types):
        rope = dict(config.rope_parameters[kind])
        if rope.get("rope_type", "default") != "default":
            option = f"rope_parameters[{kind!r}].rope_type={rope['rope_type']!r}"
            raise _unsupported("ModernBERT", option, "(scaled rotary frequencies)")
        thetas[_MODERNBERT_LAYER_TYPES[kind]] = float(rope["rope_theta"])
    rope_theta = thetas.get("full", float(config.rope_parameters["full_attention"]["rope_theta"]))
    local_rope_theta = thetas.get("sliding", rope_theta)
    sliding = "sliding" in layer_types
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
        sliding_window=config.sliding_window if sliding else None,
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
        tie_word_embeddings=config.tie_word_embeddings,
        **_token_fields(config, "pad_token_id", "bos_token_id", "eos_token_id"),
        **_label_fields(config),
    )


def _translate_config(model: PreTrainedModel, conversion: _Conversion) -> CoreformerConfig:
    is_mlm = conversion.target is CoreformerEncoderForMaskedLM
    translated = _SOURCES[conversion.family].translate_config(model.config, is_mlm)
    for name, value in conversion.head_config:
        setattr(translated, name, value)
    if conversion.family == "qwen2":
        translated.attention_bias = not _qwen2_biases_are_zero(model)
    translated.validate_fields()
    return translated


def _unfuse_gpt2(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's Conv1D stores weights (in, out): transpose them to nn.Linear's (out, in), and split the fused c_attn
    (hidden -> 3 * hidden) into q/k/v pseudo-names the rename rules understand."""
    conv1d = {name for name, module in model.named_modules() if isinstance(module, Conv1D)}
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


def _fuse_gpt2(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_unfuse_gpt2` (export): q/k/v pseudo-names concatenated into c_attn, Conv1D weights transposed
    back to (in, out)."""
    conv1d = {name for name, module in model.named_modules() if isinstance(module, Conv1D)}
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


_NEOX_QKV = re.compile(r"(.*\.attention\.)query_key_value\.(weight|bias)")
_NEOX_SPLIT = re.compile(r"(.*\.attention\.)([qkv])_proj\.(weight|bias)")


def _unfuse_gpt_neox(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-NeoX's query_key_value rows are laid out per head, [heads, 3, head_dim] (its forward views the output as
    (..., heads, 3 * head_dim) and chunks the last dim): split them into q/k/v pseudo-names of [heads, head_dim]."""
    heads = model.config.num_attention_heads
    unfused = {}
    for name, tensor in state_dict.items():
        match = _NEOX_QKV.fullmatch(name)
        if match is None:
            unfused[name] = tensor
            continue
        per_head = tensor.reshape(heads, 3, -1, *tensor.shape[1:])  # (3 * hidden, ...) -> (heads, 3, head_dim, ...)
        for index, part in enumerate("qkv"):
            unfused[f"{match[1]}{part}_proj.{match[2]}"] = per_head[:, index].reshape(-1, *tensor.shape[1:])
    return unfused


def _fuse_gpt_neox(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_unfuse_gpt_neox` (export): q/k/v rows interleaved per head into query_key_value."""
    heads = model.config.num_attention_heads
    fused = {}
    for name, tensor in state_dict.items():
        match = _NEOX_SPLIT.fullmatch(name)
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


_QWEN2_BIAS = re.compile(r"(.*\.self_attn\.)([qkv])_proj\.bias")


def _qwen2_biases_are_zero(model: PreTrainedModel) -> bool:
    """Whether every q/k/v bias of a Qwen2 model is zero: then coreformer needs no attention biases at all."""
    return all(
        not tensor.any() for name, tensor in model.state_dict().items() if _QWEN2_BIAS.fullmatch(name) is not None
    )


def _qwen2_weights(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen2 has q/k/v biases but none on o_proj; coreformer's `attention_bias` covers all four. All-zero q/k/v biases
    (a model exported from coreformer without biases) are dropped; otherwise o_proj gets a zero bias, which adds
    nothing."""
    if _qwen2_biases_are_zero(model):
        return {name: tensor for name, tensor in state_dict.items() if _QWEN2_BIAS.fullmatch(name) is None}
    prepared = dict(state_dict)
    for name in state_dict:
        match = _QWEN2_BIAS.fullmatch(name)
        if match is not None and match[2] == "q":
            output = state_dict[f"{match[1]}o_proj.weight"]
            prepared[f"{match[1]}o_proj.bias"] = output.new_zeros(output.shape[0])
    return prepared


_MODERNBERT_FUSED = re.compile(r"(.*\.)(attn\.Wqkv|mlp\.Wi)\.(weight|bias)")
_MODERNBERT_SPLIT = re.compile(r"(.*\.)(attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)")
# fused name -> the pseudo-names of its row blocks, in order: Wqkv is (3 * hidden, hidden) = [q; k; v] (its forward
# views the output as (..., 3, heads, head_dim)); Wi is (2 * intermediate, hidden) = [input; gate], and ModernBERT
# computes act(input) * gate, so `input` is coreformer's gate_proj (the activated half) and `gate` its up_proj.
_MODERNBERT_PARTS = {
    "attn.Wqkv": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    "mlp.Wi": ("mlp.gate_proj", "mlp.up_proj"),
}


def _unfuse_modernbert(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split ModernBERT's fused Wqkv and Wi into the pseudo-names the rename rules understand."""
    unfused = {}
    for name, tensor in state_dict.items():
        match = _MODERNBERT_FUSED.fullmatch(name)
        if match is None:
            unfused[name] = tensor
            continue
        parts = _MODERNBERT_PARTS[match[2]]
        for part, chunk in zip(parts, tensor.chunk(len(parts), dim=0)):  # (n * out, ...) -> n x (out, ...)
            unfused[f"{match[1]}{part}.{match[3]}"] = chunk
    return unfused


def _fuse_modernbert(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_unfuse_modernbert` (export): the row blocks concatenated back into Wqkv and Wi."""
    fused = {}
    for name, tensor in state_dict.items():
        match = _MODERNBERT_SPLIT.fullmatch(name)
        if match is None:
            fused[name] = tensor
            continue
        for whole, parts in _MODERNBERT_PARTS.items():
            if match[2] == parts[0]:  # gathered with the first part
                blocks = [state_dict[f"{match[1]}{part}.{match[3]}"] for part in parts]
                fused[f"{match[1]}{whole}.{match[3]}"] = torch.cat(blocks, dim=0)  # n x (out, ...) -> (n * out, ...)
    return fused


@dataclass(frozen=True)
class _Source:
    """One transformers architecture (a source `model_type`): how its config and base-model weights translate."""

    translate_config: Callable[[PreTrainedConfig, bool], CoreformerConfig]  # (config, is the head masked LM?)
    base_rules: list[Rule]
    # Rewrites the source state dict before renaming (GPT-2: transpose Conv1D, split c_attn).
    prepare_weights: Callable[[PreTrainedModel, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    # The inverse of prepare_weights for export (export.py): weights under the prepared names -> the source's own
    # layout. None where export needs no layout change (Qwen2's prepare_weights only adds or drops zero biases).
    restore_weights: Callable[[PreTrainedModel, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None


_SOURCES: dict[str, _Source] = {
    "bert": _Source(_encoder_config, _BERT_BASE_RULES),
    "roberta": _Source(lambda config, is_mlm: _encoder_config(config, is_mlm, roberta=True), _BERT_BASE_RULES),
    "gpt2": _Source(_decoder_config, _GPT2_BASE_RULES, _unfuse_gpt2, _fuse_gpt2),
    "bart": _Source(_seq2seq_config, _BART_BASE_RULES),
    "llama": _Source(_llama_config, _LLAMA_BASE_RULES),
    "mistral": _Source(_mistral_config, _LLAMA_BASE_RULES),
    "qwen2": _Source(_qwen2_config, _LLAMA_BASE_RULES, _qwen2_weights),
    "gpt_neox": _Source(_gpt_neox_config, _GPT_NEOX_BASE_RULES, _unfuse_gpt_neox, _fuse_gpt_neox),
    "modernbert": _Source(_modernbert_config, _MODERNBERT_BASE_RULES, _unfuse_modernbert, _fuse_modernbert),
}


def _rename(state_dict: dict[str, torch.Tensor], rules: list[Rule], source_name: str) -> dict[str, torch.Tensor]:
    """Apply the first matching rule to every weight; a weight no rule claims is an error, never a silent drop."""
    renamed: dict[str, torch.Tensor] = {}
    unclaimed = []
    for name, tensor in state_dict.items():
        for pattern, target, *transform in rules:
            match = re.fullmatch(pattern, name)
            if match is None:
                continue
            if target is not None:
                target_name = match.expand(target)
                value = transform[0](tensor) if transform else tensor
                if target_name in renamed and not torch.equal(renamed[target_name], value):
                    raise ValueError(
                        f"{source_name}: two different weights map to {target_name} (a tie transformers broke?)."
                    )
                renamed[target_name] = value
            break
        else:
            unclaimed.append(name)
    if unclaimed:
        raise ValueError(
            f"{source_name}: no coreformer parameter for weights {unclaimed}; the conversion is incomplete."
        )
    return renamed


def rename_rules(model: PreTrainedModel, converted: CoreformerPreTrainedModel) -> list[Rule]:
    """Every rule renaming `model`'s weights (transformers names, after its source's `prepare_weights`) to those of
    `converted`, full names on both sides: the head's rules, then the base model's. export.py reads them backwards."""
    conversion = _CONVERSIONS[type(model).__name__]
    # Base-model keys carry the prefix ("bert.", "model.") only inside a head model, on both sides.
    source_prefix = "" if model.base_model is model else f"{model.base_model_prefix}."
    target_prefix = "" if converted.base_model is converted else f"{converted.base_model_prefix}."
    base_rules = [
        (re.escape(source_prefix) + pattern, None if target is None else target_prefix + target, *transform)
        for pattern, target, *transform in _SOURCES[conversion.family].base_rules
    ]
    # Head rules first: BertForSequenceClassification's pooler lives under the base prefix but belongs to the head.
    return [*conversion.head_rules, *base_rules]


def _fill_ties(model: CoreformerPreTrainedModel, state_dict: dict[str, torch.Tensor], source_name: str) -> None:
    """Every name of a tied coreformer parameter must receive one value: copy it to names the source did not have,
    and refuse sources whose values differ (coreformer would share one tensor between them)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    for names in groups.values():
        given = [name for name in names if name in state_dict]
        if len(names) == 1 or not given:
            continue
        reference = state_dict[given[0]]
        for name in given[1:]:
            if not torch.equal(state_dict[name], reference):
                raise ValueError(
                    f"{source_name}: coreformer shares one tensor between {names}, but the source weights "
                    f"{given[0]} and {name} differ."
                )
        for name in names:
            state_dict.setdefault(name, reference)


def convert_from_hf(model: PreTrainedModel) -> CoreformerPreTrainedModel:
    """The coreformer equivalent of a transformers BERT / RoBERTa / GPT-2 / BART / Llama / Mistral / Qwen2 / GPT-NeoX /
    ModernBERT model: same head, same weights.

    The returned model is in eval mode, on the source's device and dtype, with the source's attention backend
    (`config._attn_implementation`) and, for generative models, a copy of its `generation_config`.

    Conversions that are exact only with caveats:
        - BertModel / RobertaModel: the pooler has no place in CoreformerEncoderModel and is dropped (the sequence
          classification heads keep it, as `classifier.dense`).
        - RoBERTa: positions are arange(T) + padding_idx + 1, equal to RoBERTa's cumsum of non-padding tokens for
          right-padded (or unpadded) batches only; padding positions themselves differ (nothing attends to them).
        - GPT-2: `token_type_ids`, which GPT-2 looks up in its token embedding, are ignored by the converted model.
        - Qwen2: coreformer's attention biases cover q, k, v and o; Qwen2 has none on o_proj, which gets a zero bias
          (exact, but fine-tuning then trains it). All-zero q/k/v biases convert to a model without biases.
        - ModernBERT: its multiple-choice head pools the first real token, coreformer's the first token: the same for
          right-padded batches. `sparse_prediction` is not kept (the same loss; logits for every token).
        - Training-time differences only: GPT-2's embedding dropout takes resid_pdrop (coreformer has one
          hidden_dropout), BART's activation dropout and layerdrop are not kept. With those equal (the defaults
          of GPT-2, and BART's activation_dropout=0, layerdrop=0), fine-tuning the converted model from the same seed
          on the same unpadded batches gives the source's losses, dropout included (tests/test_conversion.py).

    Args:
        model: an instantiated transformers model; `SUPPORTED_ARCHITECTURES` lists the classes.

    Raises:
        ValueError: for any other class, or a config option that coreformer cannot reproduce (named in the message).
    """
    source_name = type(model).__name__
    conversion = _CONVERSIONS.get(source_name)
    if conversion is None or getattr(model.config, "model_type", None) != conversion.family:
        raise ValueError(
            f"convert_from_hf does not support {source_name} (model_type="
            f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    config = _translate_config(model, conversion)
    if conversion.target is CoreformerEncoderForQuestionAnswering and model.config.num_labels != 2:
        raise _unsupported(source_name, f"num_labels={model.config.num_labels}", "(QA predicts a start and an end)")

    source = _SOURCES[conversion.family]
    state_dict = dict(model.state_dict())
    if source.prepare_weights is not None:
        state_dict = source.prepare_weights(model, state_dict)
    converted = conversion.target(config)
    state_dict = _rename(state_dict, rename_rules(model, converted), source_name)

    _fill_ties(converted, state_dict, source_name)
    converted.load_state_dict(state_dict, strict=True)

    parameter = next(model.parameters())
    converted.to(device=parameter.device, dtype=parameter.dtype)
    converted.set_attn_implementation(model.config._attn_implementation)
    if model.can_generate() and converted.can_generate():
        converted.generation_config = copy.deepcopy(model.generation_config)
    return converted.eval()
