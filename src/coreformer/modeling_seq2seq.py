"""BART-style encoder-decoder family: an encoder stack and a cross-attending decoder stack over one tied embedding.

input_ids ─> shared ─> encoder stack (bidirectional) ─────────────┐ encoder_hidden_states
decoder_input_ids ─> shared ─> decoder stack (causal + cross-attn) ┴─> last_hidden_state ─> lm_head

CoreformerSeq2SeqModel                        decoder last_hidden_state + encoder outputs + cache
CoreformerSeq2SeqForConditionalGeneration     vocabulary logits; generate() via GenerationMixin
CoreformerSeq2SeqForSequenceClassification    decoder state at the last eos token -> ClassificationHead
"""

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import (
    BaseModelOutput,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    Seq2SeqSequenceClassifierOutput,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.import_utils import is_torchdynamo_compiling

from .compat import CACHE_KEYWORD, cache_from, output_cache, with_cache
from .configuration_coreformer import CoreformerSeq2SeqConfig
from .forward_plan import PACKING_KWARGS, packed_documents
from .losses import TOKEN_LOSS
from .modeling_base import CoreformerCrossAttendingStack, CoreformerPreTrainedModel, CoreformerStack
from .modeling_heads import (
    ClassificationHead,
    build_head_transform,
    build_lm_head,
    language_model_outputs,
)


def shift_tokens_right(input_ids: torch.Tensor, pad_token_id: int | None, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher forcing: decoder inputs are the targets moved one step right behind the start token, -100 -> pad."""
    if pad_token_id is None:
        raise ValueError("Shifting labels into decoder inputs needs config.pad_token_id (to replace -100).")
    shifted = input_ids.new_full(input_ids.shape, decoder_start_token_id)
    shifted[:, 1:] = input_ids[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_token_id)


def packing_by_side(kwargs: dict) -> tuple[dict, dict]:
    """A packed seq2seq batch read as cross-attention reads FlashAttentionKwargs: `cu_seq_lens_k` / `max_length_k`
    describe the encoder's documents (the keys), `cu_seq_lens_q` / `max_length_q` the decoder's (the queries).
    kwargs -> (the encoder stack's, the decoder stack's), each stack's self-attention reading its own side as both."""
    if kwargs.get("seq_idx") is not None:
        raise ValueError(
            "seq_idx describes the documents of one sequence, but a seq2seq batch has two: describe the encoder's with "
            "position_ids (or cu_seq_lens_k) and the decoder's with decoder_position_ids (or cu_seq_lens_q)."
        )
    shared = {name: value for name, value in kwargs.items() if name not in PACKING_KWARGS}
    sides = []
    for side in ("k", "q"):
        lengths, longest = kwargs.get(f"cu_seq_lens_{side}"), kwargs.get(f"max_length_{side}")
        packing = {} if lengths is None else {"cu_seq_lens_q": lengths, "cu_seq_lens_k": lengths}
        if longest is not None:
            packing |= {"max_length_q": longest, "max_length_k": longest}
        sides.append(shared | packing)
    return sides[0], sides[1]


class CoreformerSeq2SeqPreTrainedModel(CoreformerPreTrainedModel):
    config_class = CoreformerSeq2SeqConfig
    config: CoreformerSeq2SeqConfig

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, CoreformerSeq2SeqForConditionalGeneration) and module.final_logits_bias is not None:
            init.zeros_(module.final_logits_bias)


class CoreformerSeq2SeqModel(CoreformerSeq2SeqPreTrainedModel):
    """Encoder stack + decoder stack with cross-attention, their token embeddings tied to the one `shared` weight.

    As in transformers' BART, each stack owns its embedding module and the PARAMETERS are tied (`_tied_weights_keys`,
    applied by `post_init` and after loading): a checkpoint that has any one of the three names fills all three, and
    one that has none reports them missing and initialises them.
    """

    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }
    # the stacks' embeddings ARE `shared`'s weight, which the config's plan shards on the vocabulary in each stack
    _tp_plan = {"shared": "embedding_rowwise"}

    def __init__(self, config: CoreformerSeq2SeqConfig):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        encoder_embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        decoder_embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.encoder = CoreformerStack(
            config, layer_types=config.layer_types, embed_tokens=encoder_embed_tokens, is_causal=False
        )
        self.decoder = CoreformerCrossAttendingStack(
            config, layer_types=config.decoder_layer_types, embed_tokens=decoder_embed_tokens
        )
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # transformers drops every tie when tie_word_embeddings=False (BART then unties its stacks' embeddings too);
        # here that flag is about lm_head only: the encoder and decoder always read the one shared embedding.
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return dict(self._tied_weights_keys)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = value
        self.encoder.embed_tokens = value
        self.decoder.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        position_ids: torch.LongTensor | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqModelOutput:
        """
        Args:
            input_ids / inputs_embeds: the source, (B, S); skipped when `encoder_outputs` are given (generation).
            attention_mask: (B, S) source padding mask, used by the encoder and by cross-attention.
            decoder_input_ids / decoder_inputs_embeds: the target prefix, (B, T); default: input_ids shifted right
                (BART's denoising setup).
            decoder_attention_mask: (B, past + T) target padding mask.
            position_ids / decoder_position_ids: (B, S) / (B, T) positions of each side; restarting mid-row without
                a mask, they pack documents (decoder document i answers encoder document i), as do cu_seq_lens_k
                (encoder) and cu_seq_lens_q (decoder) in kwargs (`packing_by_side`).
            cache / past_key_values: the decoder's `EncoderDecoderCache`, under either name (`cache` from
                transformers 5.24).
        """
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self._decoder_input_ids_from_source(input_ids)
        encoder_kwargs, decoder_kwargs = packing_by_side(kwargs)
        encoder_outputs, encoder_documents = self._encode(
            input_ids, attention_mask, position_ids, inputs_embeds, encoder_outputs, encoder_kwargs
        )
        encoder_hidden_states = encoder_outputs.last_hidden_state
        decoder_outputs = self.decoder(
            decoder_input_ids,
            attention_mask=decoder_attention_mask,
            position_ids=decoder_position_ids,
            inputs_embeds=decoder_inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=attention_mask,
            **with_cache(cache_from(past_key_values, cache)),
            use_cache=use_cache,
            encoder_documents=encoder_documents,
            **decoder_kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **with_cache(output_cache(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )

    def _decoder_input_ids_from_source(self, input_ids: torch.LongTensor | None) -> torch.LongTensor:
        """BART's denoising default for the decoder inputs: the source (B, S) shifted right behind the start token."""
        if input_ids is None:
            raise ValueError("Pass decoder_input_ids (or decoder_inputs_embeds), or input_ids to shift into them.")
        return shift_tokens_right(input_ids, self.config.pad_token_id, self.config.decoder_start_token_id)

    def _encode(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        encoder_outputs: BaseModelOutput | tuple | None,
        encoder_kwargs: dict,
    ) -> tuple[BaseModelOutput, torch.Tensor | None]:
        """The encoder's outputs (run here unless given) and the (B, S) documents of a packed source, which the
        decoder's cross-attention pairs with its own (or None)."""
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                **encoder_kwargs,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        source = encoder_outputs.last_hidden_state
        return encoder_outputs, packed_documents(source, attention_mask, None, position_ids, encoder_kwargs)


class CoreformerSeq2SeqForConditionalGeneration(CoreformerSeq2SeqPreTrainedModel, GenerationMixin):
    """Sequence-to-sequence generation (summarisation, translation, denoising) with a tied vocabulary projection."""

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}
    # the head reads the embedding's vocabulary slice when tied; each rank computes its slice of the logits
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: CoreformerSeq2SeqConfig):
        super().__init__(config)
        self.model = CoreformerSeq2SeqModel(config)
        self.lm_head_transform, self.lm_head = build_lm_head(config)
        # BART's final_logits_bias: added to the logits, saved, never trained (a buffer, not a parameter).
        bias = torch.zeros(1, config.vocab_size) if config.final_logits_bias else None  # (1, vocab)
        self.register_buffer("final_logits_bias", bias)
        self.post_init()

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        if self.final_logits_bias is not None:  # cut, or extended with zeros as BART does
            vocab = embeddings.weight.shape[0]
            extended = self.final_logits_bias.new_zeros(1, max(vocab, self.final_logits_bias.shape[-1]))
            extended[:, : self.final_logits_bias.shape[-1]] = self.final_logits_bias
            self.final_logits_bias = extended[:, :vocab]
        return embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        skip_logits: bool = False,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqLMOutput:
        """labels: (B, T) target ids, -100 where no loss is taken. Decoder inputs default to labels shifted right,
        so logits[:, t] already predicts labels[:, t]: the loss is taken without a second shift.
        skip_logits: True returns the loss only (`logits` is None), the projection (and final_logits_bias) fused
            with the loss (pretraining passes True); the default returns logits as transformers' heads do.
        cache / past_key_values: the `EncoderDecoderCache`, under either name (`cache` from transformers 5.24)."""
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            **with_cache(cache_from(past_key_values, cache)),
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
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
            logits_bias=self.final_logits_bias,
            **kwargs,
        )
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **with_cache(output_cache(outputs)),
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_KEYWORD)
        if isinstance(cache, EncoderDecoderCache) and set(self.config.decoder_layer_types) != {"full"}:
            # generate() lays the cross-attention cache out like the decoder's self-attention (sliding windows,
            # linear states), but cross-attention always keeps every encoder key: give it a plain cache.
            cache.cross_attention_cache = DynamicCache()


class CoreformerSeq2SeqForSequenceClassification(CoreformerSeq2SeqPreTrainedModel):
    """Classifies from the decoder state at each row's last eos token, as BART does."""

    def __init__(self, config: CoreformerSeq2SeqConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = CoreformerSeq2SeqModel(config)
        self.head_transform = build_head_transform(config)
        self.classifier = ClassificationHead(config, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqSequenceClassifierOutput:
        """input_ids (B, S) must contain config.eos_token_id in every row; labels as for any sequence classifier."""
        if input_ids is None:
            raise ValueError("Seq2seq classification pools at the eos token of input_ids: pass input_ids.")
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=False,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if hidden_states.shape[1] != input_ids.shape[1]:
            raise ValueError(
                "The classifier reads the decoder at the eos positions of input_ids, so decoder inputs must align with "
                "input_ids: leave decoder_input_ids unset (they default to input_ids shifted right)."
            )
        eos_id = self.config.eos_token_id
        # (B, S, 1) == (n_eos,) -> (B, S): torch.isin would do, but it has no ONNX form (it lowers to searchsorted)
        eos_ids = torch.tensor(eos_id, device=input_ids.device).reshape(-1)
        eos_mask = (input_ids.unsqueeze(-1) == eos_ids).any(-1).to(hidden_states.device)
        # A data-dependent check: eager only (torch.export / compile cannot branch on tensor values, as the stack's).
        if not is_torchdynamo_compiling() and not eos_mask.any(dim=-1).all():
            raise ValueError(f"Every input row needs an eos token ({eos_id}) to pool at; add it when tokenizing.")
        positions = torch.arange(input_ids.shape[-1], device=hidden_states.device)
        last_eos = (positions * eos_mask).argmax(-1)  # (B,)
        pooled = hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), last_eos]
        if self.head_transform is not None:
            pooled = self.head_transform(pooled)
        logits = self.classifier(pooled)  # (B, num_labels)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config, **kwargs)
        return Seq2SeqSequenceClassifierOutput(
            loss=loss,
            logits=logits,
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )
