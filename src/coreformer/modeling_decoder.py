"""GPT-style decoder family: `CoreformerDecoderModel` (one causal `CoreformerStack`) and its heads.

CoreformerDecoderModel                       last_hidden_state (B, T, hidden) + KV cache
CoreformerDecoderForCausalLM                 next-token logits; generate() via GenerationMixin
CoreformerDecoderForSequenceClassification   last non-padding token -> ClassificationHead
CoreformerDecoderForTokenClassification      a label per token
"""

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithPast
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .compat import cache_from, output_cache, slice_logits_to_keep, with_cache
from .configuration_coreformer import CoreformerDecoderConfig
from .losses import CAUSAL_LM_LOSS
from .modeling_base import CoreformerPreTrainedModel, CoreformerStack
from .modeling_heads import (
    CoreformerSequenceClassifier,
    CoreformerTokenClassifier,
    build_lm_head,
    language_model_outputs,
)


class CoreformerDecoderPreTrainedModel(CoreformerPreTrainedModel):
    config_class = CoreformerDecoderConfig
    config: CoreformerDecoderConfig


class CoreformerDecoderModel(CoreformerDecoderPreTrainedModel):
    """A causal stack over token (+ position) embeddings."""

    def __init__(self, config: CoreformerDecoderConfig):
        super().__init__(config)
        # No padding_idx: GPT-style vocabularies often pad with eos, whose embedding must keep learning.
        embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.decoder = CoreformerStack(
            config, layer_types=config.layer_types, embed_tokens=embed_tokens, is_causal=True
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.decoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.decoder.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """input_ids (B, T) or inputs_embeds (B, T, hidden); attention_mask (B, past + T) with 0 on padding; the
        cache as `cache` or `past_key_values` (its name before transformers 5.24)."""
        return self.decoder(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **with_cache(cache_from(past_key_values, cache)),
            **kwargs,
        )


class CoreformerDecoderForCausalLM(CoreformerDecoderPreTrainedModel, GenerationMixin):
    """Next-token prediction with a vocabulary projection tied to the input embedding."""

    _tied_weights_keys = {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    # the head reads the embedding's vocabulary slice when tied; each rank computes its slice of the logits
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: CoreformerDecoderConfig):
        super().__init__(config)
        self.model = CoreformerDecoderModel(config)
        self.lm_head_transform, self.lm_head = build_lm_head(config)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        skip_logits: bool = False,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """
        labels: (B, T) the input ids themselves (shifted inside the loss), -100 where no loss is taken.
        logits_to_keep: compute logits for the last N positions only (generation needs just the last one).
        skip_logits: True returns the loss only (`logits` is None): the vocabulary projection is fused with the loss
            a chunk of rows at a time and the (B, T, vocab) logits never exist. Pretraining passes True; the
            default keeps transformers' contract (logits always returned).
        cache / past_key_values: the `Cache`, under either name (`cache` from transformers 5.24).
        """
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **with_cache(cache_from(past_key_values, cache)),
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        loss, logits = language_model_outputs(  # logits: (B, T_kept, vocab)
            hidden_states,
            self.lm_head,
            labels,
            CAUSAL_LM_LOSS,
            skip_logits=skip_logits,
            vocab_size=self.config.vocab_size,
            transform=self.lm_head_transform,
            **kwargs,
        )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **with_cache(output_cache(outputs)),
        )


class CoreformerDecoderForSequenceClassification(CoreformerDecoderPreTrainedModel, CoreformerSequenceClassifier):
    """Classifies the sequence from its last non-padding token."""

    base_model_class = CoreformerDecoderModel
    default_pooling = "last"


class CoreformerDecoderForTokenClassification(CoreformerDecoderPreTrainedModel, CoreformerTokenClassifier):
    """A label for every token, each seeing only its left context."""

    base_model_class = CoreformerDecoderModel
