"""BERT-style encoder family: `CoreformerEncoderModel` (one bidirectional `CoreformerStack`) and its heads.

CoreformerEncoderModel                       last_hidden_state (B, T, hidden)
CoreformerEncoderForMaskedLM                 vocabulary logits per token, MLM loss
CoreformerEncoderForSequenceClassification   first token ([CLS]; or `classifier_pooling`) -> ClassificationHead
CoreformerEncoderForTokenClassification      a label per token
CoreformerEncoderForQuestionAnswering        start/end logits of an extractive span
CoreformerEncoderForMultipleChoice           one score per choice, (B, choices, T) inputs
"""

import torch
from torch import nn
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .configuration_coreformer import CoreformerEncoderConfig
from .losses import TOKEN_LOSS
from .modeling_base import CoreformerPreTrainedModel, CoreformerStack
from .modeling_heads import (
    POOLINGS,
    ClassificationHead,
    CoreformerSequenceClassifier,
    CoreformerTokenClassifier,
    build_head_transform,
    build_lm_head,
    classifier_dropout,
    language_model_outputs,
)


class CoreformerEncoderPreTrainedModel(CoreformerPreTrainedModel):
    config_class = CoreformerEncoderConfig
    config: CoreformerEncoderConfig
    default_pooling = "cls"  # sequence classifiers and multiple choice read the first token unless configured


class CoreformerEncoderModel(CoreformerEncoderPreTrainedModel):
    """A bidirectional stack over token (+ position, + token type) embeddings."""

    def __init__(self, config: CoreformerEncoderConfig):
        super().__init__(config)
        embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.encoder = CoreformerStack(
            config, layer_types=config.layer_types, embed_tokens=embed_tokens, is_causal=False
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutput:
        """input_ids (B, T) or inputs_embeds (B, T, hidden); attention_mask (B, T) with 0 on padding."""
        return self.encoder(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )


class CoreformerEncoderForMaskedLM(CoreformerEncoderPreTrainedModel):
    """Predicts masked tokens: [MLM transform] -> vocabulary projection tied to the input embedding."""

    _tied_weights_keys = {"lm_head.weight": "model.encoder.embed_tokens.weight"}
    # the head reads the embedding's vocabulary slice when tied; each rank computes its slice of the logits
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: CoreformerEncoderConfig):
        super().__init__(config)
        self.model = CoreformerEncoderModel(config)
        self.lm_head_transform, self.lm_head = build_lm_head(config)
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
        skip_logits: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MaskedLMOutput:
        """labels: (B, T) original ids at masked positions, -100 elsewhere.
        skip_logits: True returns the loss only (`logits` is None), the projection fused with the loss (pretraining
            passes True); the default returns logits as transformers' heads do."""
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        loss, logits = language_model_outputs(  # logits: (B, T, vocab)
            hidden_states,
            self.lm_head,
            labels,
            TOKEN_LOSS,
            skip_logits=skip_logits,
            vocab_size=self.config.vocab_size,
            transform=self.lm_head_transform,
            **kwargs,
        )
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class CoreformerEncoderForSequenceClassification(CoreformerEncoderPreTrainedModel, CoreformerSequenceClassifier):
    """Classifies the sequence from its first token ([CLS])."""

    base_model_class = CoreformerEncoderModel


class CoreformerEncoderForTokenClassification(CoreformerEncoderPreTrainedModel, CoreformerTokenClassifier):
    """A label for every token (NER, POS)."""

    base_model_class = CoreformerEncoderModel


class CoreformerEncoderForQuestionAnswering(CoreformerEncoderPreTrainedModel):
    """Extractive QA: a start and an end logit for every token."""

    def __init__(self, config: CoreformerEncoderConfig):
        super().__init__(config)
        self.model = CoreformerEncoderModel(config)
        self.head_transform = build_head_transform(config)  # with its dropout, as ModernBERT's QA head
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> QuestionAnsweringModelOutput:
        """start_positions / end_positions: (B,) token indices of the answer span."""
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
            hidden_states = self.dropout(self.head_transform(hidden_states))
        start_logits, end_logits = self.qa_outputs(hidden_states).unbind(dim=-1)  # 2 x (B, T)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions, **kwargs)
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits.contiguous(),
            end_logits=end_logits.contiguous(),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class CoreformerEncoderForMultipleChoice(CoreformerEncoderPreTrainedModel):
    """Scores each of C candidate sequences from its first token; softmax over the choices."""

    def __init__(self, config: CoreformerEncoderConfig):
        super().__init__(config)
        self.model = CoreformerEncoderModel(config)
        self.pool = POOLINGS[config.classifier_pooling or self.default_pooling]
        self.head_transform = build_head_transform(config)
        self.classifier = ClassificationHead(config, 1)
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
    ) -> MultipleChoiceModelOutput:
        """Inputs are (B, C, T) (embeddings (B, C, T, hidden)); labels: (B,) index of the right choice."""
        reference = input_ids if input_ids is not None else inputs_embeds
        if reference is None or reference.dim() < 3:
            raise ValueError("Multiple choice takes inputs shaped (batch, num_choices, seq_len).")
        num_choices = reference.shape[1]

        def flat(tensor: torch.Tensor | None) -> torch.Tensor | None:
            # (B, C, T, ...) -> (B*C, T, ...): every choice is encoded as its own sequence.
            return None if tensor is None else tensor.reshape(-1, *tensor.shape[2:])

        outputs = self.model(
            flat(input_ids),
            attention_mask=flat(attention_mask),
            token_type_ids=flat(token_type_ids),
            position_ids=flat(position_ids),
            inputs_embeds=flat(inputs_embeds),
            **kwargs,
        )
        pooled = self.pool(outputs.last_hidden_state, flat(attention_mask), flat(input_ids), self.config.pad_token_id)
        if self.head_transform is not None:
            pooled = self.head_transform(pooled)
        logits = self.classifier(pooled).view(-1, num_choices)  # (B*C, 1) -> (B, C)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits, labels.to(logits.device))
        return MultipleChoiceModelOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
