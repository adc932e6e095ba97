"""The head pieces every family shares, beside the stacks of `modeling_base.py`.

LMHeadTransform, build_lm_head, build_head_transform   BERT's MLM transform, the vocabulary projection
language_model_outputs (fused_language_model_loss)    (loss, logits) of a language-model head
ClassificationHead, POOLINGS                           pooled token -> classes (BERT / RoBERTa / BART / GPT-2)
CoreformerTokenClassifier, CoreformerSequenceClassifier   the heads that are the same for every single-stack family
"""

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutputWithPast, TokenClassifierOutput
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .compat import output_cache, with_cache
from .configuration_coreformer import CoreformerConfig
from .layers import build_activation, build_norm
from .losses import LanguageModelLoss, labelled_rows, linear_cross_entropy, token_loss
from .modeling_base import CoreformerPreTrainedModel


def classifier_dropout(config: CoreformerConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout


class LMHeadTransform(nn.Module):
    """BERT's MLM transform before the vocabulary projection: dense -> activation -> norm. The same shape is
    ModernBERT's prediction head, in front of its classifiers too (`classifier_transform`)."""

    def __init__(self, config: CoreformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.head_transform_bias)
        self.act_fn = build_activation(config.hidden_act)
        self.norm = build_norm(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act_fn(self.dense(hidden_states)))


def build_lm_head(config: CoreformerConfig) -> tuple[LMHeadTransform | None, nn.Linear]:
    """The optional MLM transform and the vocabulary projection (named `lm_head`, as transformers expects)."""
    transform = LMHeadTransform(config) if config.lm_head_transform else None
    return transform, nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)


def build_head_transform(config: CoreformerConfig) -> LMHeadTransform | None:
    """A classification head's own transform (`config.classifier_transform`, ModernBERT's `head`), or None."""
    return LMHeadTransform(config) if config.classifier_transform else None


def language_model_outputs(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor | None,
    loss: LanguageModelLoss,
    *,
    skip_logits: bool,
    vocab_size: int,
    transform: nn.Module | None = None,
    logits_bias: torch.Tensor | None = None,
    **loss_kwargs,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss, logits) of a language-model head from the final hidden states, (B, T, hidden).

    skip_logits=False: logits = lm_head(transform(hidden_states)) [+ logits_bias], (B, T, vocab), and the loss from
    them, as transformers' heads return. skip_logits=True (training): the loss only, logits None. Only the rows that
    take a loss go through the transform and the projection (`losses.labelled_rows`: ~15% of a masked-LM batch, the
    real targets of a padded one), the projection fused with the loss a chunk of rows at a time
    (`losses.LinearCrossEntropy`). A head that is not a plain `nn.Linear` (a PEFT LoRA layer, a quantized linear)
    computes more than weight and bias, so it is called as a module on those rows and the loss taken from its logits.
    """
    if skip_logits and labels is None:
        raise ValueError("skip_logits=True returns only the loss: pass labels, or leave skip_logits False for logits.")
    if not skip_logits:
        if transform is not None:
            hidden_states = transform(hidden_states)
        logits = lm_head(hidden_states)  # (B, T, vocab)
        if logits_bias is not None:
            logits = logits + logits_bias.to(logits.dtype)  # (B, T, vocab) + (1, vocab)
        value = None if labels is None else loss.from_logits(logits, labels, vocab_size=vocab_size, **loss_kwargs)
        return value, logits
    return fused_language_model_loss(
        hidden_states, lm_head, labels, loss, vocab_size, transform, logits_bias, **loss_kwargs
    ), None


# Under torch.compile this runs eagerly, one graph break after the final hidden states: the row selection has a
# data-dependent shape (3 graph breaks, one per `nonzero`), and the chunk loop, traced, left the fused loss neither
# fast nor small. The compiled bf16 training step at vocabulary 50,257 (benchmarks/compare.py) went from 0.70x compiled
# GPT-2 at 1.19x its peak memory (compare_compiled.json) to 0.90x at 0.58x (..._compiled_training.json).
@torch.compiler.disable
def fused_language_model_loss(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    loss: LanguageModelLoss,
    vocab_size: int,
    transform: nn.Module | None,
    logits_bias: torch.Tensor | None,
    **loss_kwargs,
) -> torch.Tensor:
    """The loss of `language_model_outputs(..., skip_logits=True)`: only the labelled rows through the transform and
    the projection, fused with the loss (`losses.LinearCrossEntropy`), or through a head that is not a plain
    `nn.Linear` as a module."""
    ignore_index = loss_kwargs.pop("ignore_index", -100)
    targets = loss.targets(labels, ignore_index=ignore_index, **loss_kwargs)  # (B, T) the target of each position
    loss_kwargs.pop("shift_labels", None)  # applied above: the rows' targets are final
    rows, targets = labelled_rows(hidden_states, targets, ignore_index)  # (N, hidden), (N,)
    if transform is not None:
        rows = transform(rows)
    if type(lm_head) is nn.Linear:
        bias = lm_head.bias
        if logits_bias is not None:  # (1, vocab): a buffer added to every row, BART's final_logits_bias
            bias = logits_bias[0] if bias is None else bias + logits_bias[0]
        num_items_in_batch = loss_kwargs.get("num_items_in_batch")
        return linear_cross_entropy(rows, lm_head.weight, bias, targets, num_items_in_batch)
    logits = lm_head(rows)  # (N, vocab)
    if logits_bias is not None:
        logits = logits + logits_bias.to(logits.dtype)
    return token_loss(logits, targets, vocab_size, ignore_index=ignore_index, **loss_kwargs)


class ClassificationHead(nn.Module):
    """Pooled token -> [[dropout] -> tanh(dense)] -> dropout -> out_proj.

    With `config.classifier_dense` this is BERT's pooler + classifier, and with `classifier_dropout_before_dense`
    RoBERTa's and BART's classification heads; without a dense layer, GPT-2's `score` projection.
    """

    def __init__(self, config: CoreformerConfig, num_outputs: int):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size) if config.classifier_dense else None
        self.dropout_before_dense = config.classifier_dense and config.classifier_dropout_before_dense
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.out_proj = nn.Linear(config.hidden_size, num_outputs, bias=config.classifier_bias)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            if self.dropout_before_dense:
                pooled = self.dropout(pooled)
            pooled = torch.tanh(self.dense(pooled))
        return self.out_proj(self.dropout(pooled))


def pool_last_token(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    pad_token_id: int | None,
) -> torch.Tensor:
    """The rightmost real token of each row, left or right padded: (B, T, H) -> (B, H). Real tokens are where the
    attention mask is 1, or, without a mask, where the ids are not `pad_token_id`."""
    batch = hidden_states.shape[0]
    if attention_mask is not None and attention_mask.dim() == 2:
        real = attention_mask[:, -hidden_states.shape[1] :].bool()
    elif input_ids is not None and pad_token_id is not None:
        real = input_ids != pad_token_id
    else:
        if batch > 1 and input_ids is not None:
            raise ValueError("Pooling the last token of a padded batch needs config.pad_token_id to find the padding.")
        return hidden_states[:, -1]
    positions = torch.arange(real.shape[-1], device=hidden_states.device)
    last = (positions * real.to(hidden_states.device)).argmax(-1)  # (B,)
    return hidden_states[torch.arange(batch, device=hidden_states.device), last]


def pool_first_token(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    pad_token_id: int | None,
) -> torch.Tensor:
    """The first token of each row ([CLS]): (B, T, H) -> (B, H)."""
    return hidden_states[:, 0]


def pool_mean(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    pad_token_id: int | None,
) -> torch.Tensor:
    """The mean over each row's real tokens (attention mask 1; every token without a mask): (B, T, H) -> (B, H)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return hidden_states.mean(dim=1)
    real = attention_mask[:, -hidden_states.shape[1] :, None].to(hidden_states.dtype)  # (B, T, 1)
    return (hidden_states * real).sum(dim=1) / real.sum(dim=1)


# config.classifier_pooling -> (hidden_states, attention_mask, input_ids, pad_token_id) -> (B, H) pooled states.
POOLINGS = {"cls": pool_first_token, "last": pool_last_token, "mean": pool_mean}


class CoreformerTokenClassifier(CoreformerPreTrainedModel):
    """Token classification over any single-stack family; the family subclass names its base model class."""

    base_model_class: type[CoreformerPreTrainedModel]

    def __init__(self, config: CoreformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        self.head_transform = build_head_transform(config)
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> TokenClassifierOutput:
        """labels: (B, T) class ids, -100 where no loss is taken (padding, sub-word continuations)."""
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if self.head_transform is not None:
            hidden_states = self.head_transform(hidden_states)
        logits = self.classifier(self.dropout(hidden_states))  # (B, T, num_labels)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config, **kwargs)
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class CoreformerSequenceClassifier(CoreformerPreTrainedModel):
    """Sequence classification over any single-stack family.

    The family subclass names its base model class and how the sequence is summarised unless the config says
    otherwise (`classifier_pooling`, a key of POOLINGS): the first token for a bidirectional encoder ([CLS]), the last
    non-padding one for a causal decoder (the only one that saw everything).
    """

    base_model_class: type[CoreformerPreTrainedModel]
    default_pooling: str

    def __init__(self, config: CoreformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        self.pool = POOLINGS[config.classifier_pooling or self.default_pooling]
        self.head_transform = build_head_transform(config)
        self.classifier = ClassificationHead(config, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutputWithPast:
        """labels: (B,) class ids, (B, num_labels) floats for multi-label, or (B,) floats when num_labels == 1."""
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
        pooled = self.pool(outputs.last_hidden_state, attention_mask, input_ids, self.config.pad_token_id)  # (B, H)
        if self.head_transform is not None:
            pooled = self.head_transform(pooled)
        logits = self.classifier(pooled)  # (B, num_labels)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config, **kwargs)
        return SequenceClassifierOutputWithPast(
            loss=loss,
            logits=logits,
            **with_cache(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
