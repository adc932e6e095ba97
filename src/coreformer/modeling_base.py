"""What every family shares: the pretrained-model base, THE stack, and the head pieces.

`CoreformerStack` is the one encoder/decoder stack. It embeds tokens, builds the masks and the rotary (cos, sin)
once per forward, runs its blocks and applies the final norm. The families differ only in how they build it:

    encoder model   CoreformerStack(config, config.layer_types, embed_tokens, is_causal=False)
    decoder model   CoreformerStack(config, config.layer_types, embed_tokens, is_causal=True)
    seq2seq model   encoder stack as above + CoreformerStack(config, config.decoder_layer_types, ...,
                                                             is_causal=True, cross_attention=True)

Layers may differ in attention type (`layer_types`): the stack builds one mask per type present, once per forward.

Head pieces (`LMHeadTransform`, `ClassificationHead`, the pooling functions) and the token-classification head, which
is the same for every family with a single stack, live here too.
"""

from collections.abc import Callable

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.import_utils import is_torchdynamo_compiling

from .attention import Attention, Unpadding
from .configuration_coreformer import CoreformerConfig
from .layers import (
    MLP,
    Block,
    RotaryEmbedding,
    SinusoidalPositions,
    build_activation,
    build_norm,
    sinusoidal_table,
)


class CoreformerPreTrainedModel(PreTrainedModel):
    """Capability flags and weight init shared by every coreformer model."""

    config: CoreformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            raise ValueError(
                f"The weights of {pretrained_model_name_or_path} are truncated or corrupt ({error}): download or save "
                f"the checkpoint again."
            ) from error

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() refuses caches to any class whose name contains "reformer" (meant for Reformer) -- and
        # "coreformer" does. Without this, generate() silently ignores cache_implementation="static".
        return True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # normal(initializer_range) linears/embeddings, unit norms, zero biases
        std = self.config.initializer_range
        if isinstance(module, (Attention, MLP)):
            # GPT-2's residual scaling: the projection that writes into the residual stream starts smaller, by
            # 1/sqrt(2 * layers), so the stream's variance does not grow with depth.
            projection = module.o_proj if isinstance(module, Attention) else module.down_proj
            num_layers = sum(self.config.layer_counts().values())
            init.normal_(projection.weight, mean=0.0, std=std / (2 * num_layers) ** 0.5)
        if isinstance(module, Attention) and module.layer_type == "linear" and hasattr(module, "random_features"):
            init.copy_(module.random_features, module.draw_random_features())
        elif isinstance(module, RotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())
        elif isinstance(module, SinusoidalPositions):
            init.copy_(module.table, sinusoidal_table(module.num_positions, module.dim))


def sliding_window_overlay(window: int) -> Callable:
    """Band mask: a query sees keys at most `window` positions away (ANDed with causality in decoders)."""

    def allowed(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window

    return allowed


def strided_overlay(stride: int) -> Callable:
    """Sparse Transformer strided pattern (Child et al. 2019, sec. 4.2): A(1) the `stride` nearest positions,
    A(2) every position a multiple of `stride` away."""

    def allowed(batch_idx, head_idx, q_idx, kv_idx):
        distance = (q_idx - kv_idx).abs()
        return (distance < stride) | (distance % stride == 0)

    return allowed


class CoreformerStack(nn.Module):
    """Embeddings, a stack of `Block`s and the final norm; bidirectional or causal, with or without cross-attention.

    Args:
        config: the family config.
        layer_types: the attention type of each block ("full", "sliding", ...); its length is the depth.
        embed_tokens: the token embedding; the seq2seq model passes its one shared embedding to both stacks.
        is_causal: causal self-attention (decoder) or bidirectional (encoder).
        cross_attention: add cross-attention to the encoder output in every block.
    """

    def __init__(
        self,
        config: CoreformerConfig,
        layer_types: list[str],
        embed_tokens: nn.Embedding,
        *,
        is_causal: bool,
        cross_attention: bool = False,
    ):
        super().__init__()
        self.config = config
        self.is_causal = is_causal
        self.cross_attention = cross_attention
        self.embed_tokens = embed_tokens
        self.embed_scale = config.hidden_size**0.5 if config.scale_embedding else 1.0

        positions = config.position_embedding_type
        self.embed_positions = None
        if positions == "learned":
            self.embed_positions = nn.Embedding(
                config.max_position_embeddings + config.position_offset, config.hidden_size
            )
        elif positions == "sinusoidal":
            self.embed_positions = SinusoidalPositions(config)
        self.rotary_emb = RotaryEmbedding(config) if positions == "rotary" else None
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size > 0 else None
        )
        self.embedding_norm = build_norm(config) if config.embedding_layernorm else None
        self.dropout = nn.Dropout(config.hidden_dropout)

        self.layer_types = list(layer_types)
        self.layers = nn.ModuleList(
            Block(config, i, is_causal=is_causal, cross_attention=cross_attention, layer_type=layer_type)
            for i, layer_type in enumerate(self.layer_types)
        )
        self.norm = build_norm(config) if config.final_norm else None

    def _check_input_shapes(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> None:
        if input_ids is not None:
            if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
                raise ValueError(
                    f"input_ids must hold integer token ids (torch.long), got {input_ids.dtype}; to feed vectors, "
                    f"pass them as inputs_embeds."
                )
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}.")
            length = input_ids.shape[1]
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(
                    f"inputs_embeds must be (batch, seq_len, hidden_size={self.config.hidden_size}), got shape "
                    f"{tuple(inputs_embeds.shape)}."
                )
            length = inputs_embeds.shape[1]
        if length == 0:
            raise ValueError("The input has no tokens (seq_len 0): every row needs at least one token.")

    def _check_input_ids(self, input_ids: torch.Tensor) -> None:
        # An out-of-range id is an opaque IndexError on CPU and a device-side assert on GPU: name it here instead.
        if is_torchdynamo_compiling() or input_ids.numel() == 0:
            return
        low, high = input_ids.min().item(), input_ids.max().item()
        if low < 0 or high >= self.config.vocab_size:
            bad = high if high >= self.config.vocab_size else low
            raise ValueError(
                f"input_ids contain {bad}, outside the vocabulary [0, {self.config.vocab_size}): the tokenizer does "
                f"not match this model; use the model's tokenizer or resize_token_embeddings(len(tokenizer))."
            )

    def _check_lowrank_length(self, length: int) -> None:
        # Linformer's E/F projections have one column per position up to max_position_embeddings; positions that are
        # not learned (rotary, none) would not stop a longer input before an opaque matmul error in the projection.
        # (Linformer is refused in causal stacks, so there is never a cached past to add.)
        if "lowrank" in self.layer_types and length > self.config.max_position_embeddings:
            raise ValueError(
                f"the input has {length} tokens, more than the {self.config.max_position_embeddings} "
                f"(max_position_embeddings) that this model's 'lowrank' (Linformer) layers project: truncate the "
                f"input (tokenizer(..., truncation=True, max_length={self.config.max_position_embeddings})) or build "
                f"the model with a larger max_position_embeddings."
            )

    def _check_positions(self, position_ids: torch.Tensor) -> None:
        if self.embed_positions is None or is_torchdynamo_compiling() or position_ids.numel() == 0:
            return
        longest = position_ids.max().item() + 1
        if longest > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence reaches position {longest}, beyond max_position_embeddings="
                f"{self.config.max_position_embeddings} of this model's {self.config.position_embedding_type} "
                f"positions: truncate the input (tokenizer(..., truncation=True, max_length="
                f"{self.config.max_position_embeddings})) or use a model with longer positions."
            )

    def embed(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Token (+ position) (+ token type) embeddings, normalised and dropped out: (B, T) -> (B, T, hidden)."""
        if inputs_embeds is None:
            self._check_input_ids(input_ids)
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        hidden_states = inputs_embeds
        if self.embed_positions is not None:
            self._check_positions(position_ids)
            hidden_states = hidden_states + self.embed_positions(position_ids + self.config.position_offset).to(
                hidden_states.dtype
            )
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(hidden_states.shape[:2], dtype=torch.long, device=hidden_states.device)
            hidden_states = hidden_states + self.token_type_embeddings(token_type_ids)
        if self.embedding_norm is not None:
            hidden_states = self.embedding_norm(hidden_states)
        return self.dropout(hidden_states)

    def build_masks(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
        packed: bool,
    ) -> dict[str, torch.Tensor | None]:
        """One mask per attention type in the stack, in the form the configured backend wants.

        "full", "sliding" and "strided" go through transformers' mask machinery (eager, sdpa and flex all work;
        flex turns the pattern into a sparse BlockMask); "lowrank" and "linear" take the (B, S) padding mask itself,
        and so do "sliding" and "strided" layers on their sparse-kernel path. `packed`: the caller passed its own
        position ids, which may restart mid-row (packed documents).
        """
        implementation = self.config._attn_implementation
        patterns = {"sliding", "strided"} & set(self.layer_types)
        if patterns and implementation is not None and implementation.startswith("flash"):
            raise ValueError(
                f"{sorted(patterns)} layers are defined by their mask, which {implementation} ignores: use "
                f"attn_implementation='sdpa', 'flex_attention' or 'eager'."
            )
        # transformers separates packed documents (position ids restarting mid-row, no attention_mask, no cache) in
        # causal masks only; a linear layer's running sums would run across them.
        if self.is_causal and "linear" in self.layer_types and packed and attention_mask is None and cache is None:
            # The test of transformers' find_packed_sequence_indices: a step other than +1 starts a new document.
            if not is_torchdynamo_compiling() and bool((position_ids.diff(dim=-1) != 1).any()):
                raise ValueError(
                    "position_ids restart mid-row (packed documents), which 'linear' layers cannot keep apart: their "
                    "running sums would mix the documents, while the other layer types separate them. Give each "
                    "document its own row (pad, and pass attention_mask) instead of packing, or use 'full', "
                    "'sliding' or 'strided' layers."
                )
        # Sliding and strided layers run sparse kernels (O(L·w), O(L·(s + L/s))) under sdpa when nothing constrains
        # the keys beyond padding: no cached keys (whose window bookkeeping the dense mask handles) and no packed
        # sequences (documents that restart their position ids, which transformers' mask machinery separates). An
        # empty dynamic cache layer (a prefill; eval-mode forwards build a DynamicCache by default) hands back exactly
        # the new keys, so the kernels apply there too; a static layer hands back its whole fixed-length buffer.
        # (The layer check goes first: a static cache's length is a tensor, which torch.compile cannot branch on.)
        sparse_kernels = (
            bool(patterns)
            and implementation == "sdpa"
            and not (attention_mask is None and packed)
            and (
                cache is None
                or all(
                    index >= len(cache.layers) or isinstance(cache.layers[index], DynamicLayer)
                    for index, layer_type in enumerate(self.layer_types)
                    if layer_type in patterns
                )
                and cache.get_seq_length() == 0
            )
        )
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type in dict.fromkeys(self.layer_types):
            if layer_type in ("lowrank", "linear") or (layer_type in patterns and sparse_kernels):
                if attention_mask is not None and attention_mask.dim() != 2:
                    raise ValueError(f"'{layer_type}' layers need the 2D (batch, length) padding mask.")
                masks[layer_type] = attention_mask.bool() if attention_mask is not None else None
                continue
            overlay = {
                "full": None,
                "sliding": sliding_window_overlay(self.config.sliding_window),
                "strided": strided_overlay(self.config.stride),
            }[layer_type]
            if self.is_causal:
                masks[layer_type] = create_causal_mask(
                    config=self.config,
                    inputs_embeds=hidden_states,
                    attention_mask=attention_mask,
                    past_key_values=cache,
                    position_ids=position_ids,
                    and_mask_function=overlay,
                    # Size the mask by a cache layer of this type: a sliding layer holds only its window.
                    layer_idx=self.layer_types.index(layer_type) if cache is not None else None,
                )
            else:
                masks[layer_type] = create_bidirectional_mask(
                    config=self.config,
                    inputs_embeds=hidden_states,
                    attention_mask=attention_mask,
                    and_mask_function=overlay,
                )
        return masks

    def unpadding(self, attention_mask: torch.Tensor | None, cache: Cache | None) -> Unpadding | None:
        """Where the real tokens are, when the batch is padded and nothing needs the padded layout between blocks.

        With a cache the padded layout is what gets cached; under torch.compile the data-dependent token count would
        break the graph. Padding positions come out of the stack as zeros.
        """
        if cache is not None or attention_mask is None or attention_mask.dim() != 2 or is_torchdynamo_compiling():
            return None
        if attention_mask.numel() == 0 or bool(attention_mask.all()):
            return None
        return Unpadding.from_padding_mask(attention_mask)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput | BaseModelOutputWithPastAndCrossAttentions:
        """
        Args:
            input_ids / inputs_embeds: exactly one; (B, T) ids or (B, T, hidden) embeddings.
            attention_mask: (B, past + T), 1 for tokens to attend to, 0 for padding.
            token_type_ids: (B, T) segment ids; ignored when the config has no token types (type_vocab_size=0),
                because tokenizers return them by default.
            position_ids: (B, T); default past + arange(T). Generation passes them to skip left padding.
            encoder_hidden_states / encoder_attention_mask: the encoder output and its padding mask (cross-attention).
            past_key_values: a `Cache`, updated in place (causal stacks only).
            use_cache: build and return a cache; default `config.use_cache` at inference, never while training.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds.")
        self._check_input_shapes(input_ids, inputs_embeds)
        if inputs_embeds is not None and not torch.is_autocast_enabled(inputs_embeds.device.type):
            # Embeddings computed elsewhere (another dtype) would fail deep inside the first matmul: match the model.
            inputs_embeds = inputs_embeds.to(self.embed_tokens.weight.dtype)
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if output_attentions and self.config._attn_implementation != "eager":
            raise ValueError(
                f"output_attentions=True needs the eager attention backend, which returns the probabilities; this "
                f"model runs {self.config._attn_implementation!r}. Load it with attn_implementation='eager' or call "
                f"model.set_attn_implementation('eager')."
            )
        if self.cross_attention and encoder_hidden_states is None:
            raise ValueError("This decoder cross-attends to an encoder: pass encoder_hidden_states.")

        batch, length = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if not self.is_causal:
            use_cache, past_key_values = False, None
        elif use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
            if self.cross_attention:
                # Cross-attention keeps every encoder key whatever the decoder's layer types: a plain cache.
                past_key_values = EncoderDecoderCache(past_key_values, DynamicCache())
        self_attention_cache = (
            past_key_values.self_attention_cache
            if isinstance(past_key_values, EncoderDecoderCache)
            else past_key_values
        )
        past_length = self_attention_cache.get_seq_length() if self_attention_cache is not None else 0
        if (
            attention_mask is not None
            and attention_mask.dim() == 2
            and attention_mask.shape != (batch, past_length + length)
        ):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the input needs ({batch}, "
                f"{past_length + length}) (batch, cached + new tokens): pass the mask the tokenizer returned with "
                f"these input_ids."
            )
        self._check_lowrank_length(length)
        caller_positions = position_ids is not None
        if position_ids is None:
            device = (input_ids if input_ids is not None else inputs_embeds).device
            position_ids = torch.arange(past_length, past_length + length, device=device).unsqueeze(0)  # (1, T)

        hidden_states = self.embed(input_ids, inputs_embeds, token_type_ids, position_ids)

        # Masks and rotary angles are built once here and shared by every block.
        masks = self.build_masks(hidden_states, attention_mask, self_attention_cache, position_ids, caller_positions)
        if self.cross_attention:
            encoder_attention_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
            )
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None
        unpadding = self.unpadding(attention_mask, past_key_values)
        if unpadding is not None:
            hidden_states = unpadding.unpad(hidden_states)  # (B, T, hidden) -> (N real tokens, hidden)
            kwargs["unpadding"] = unpadding

        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        all_cross_attentions = () if output_attentions and self.cross_attention else None
        for block in self.layers:
            # Tensors that need gradients go positionally: reentrant checkpointing only sees positional inputs.
            hidden_states, self_weights, cross_weights = block(
                hidden_states,
                masks[block.layer_type],
                encoder_hidden_states,
                encoder_attention_mask=encoder_attention_mask,
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                **kwargs,
            )
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if output_attentions:
                all_attentions += (self_weights,)
                if self.cross_attention:
                    all_cross_attentions += (cross_weights,)

        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
            if output_hidden_states:
                # As in transformers: the last hidden state reported is the normed one.
                all_hidden_states = all_hidden_states[:-1] + (hidden_states,)
        if unpadding is not None:
            hidden_states = unpadding.pad(hidden_states)  # (N, hidden) -> (B, T, hidden), zeros at the padding
            if output_hidden_states:
                all_hidden_states = tuple(unpadding.pad(states) for states in all_hidden_states)

        if not self.is_causal:
            return BaseModelOutput(
                last_hidden_state=hidden_states, hidden_states=all_hidden_states, attentions=all_attentions
            )
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            cross_attentions=all_cross_attentions,
        )


def classifier_dropout(config: CoreformerConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout


class LMHeadTransform(nn.Module):
    """BERT's MLM transform before the vocabulary projection: dense -> activation -> norm."""

    def __init__(self, config: CoreformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act_fn = build_activation(config.hidden_act)
        self.norm = build_norm(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act_fn(self.dense(hidden_states)))


def build_lm_head(config: CoreformerConfig) -> tuple[LMHeadTransform | None, nn.Linear]:
    """The optional MLM transform and the vocabulary projection (named `lm_head`, as transformers expects)."""
    transform = LMHeadTransform(config) if config.lm_head_transform else None
    return transform, nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)


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


class CoreformerTokenClassifier(CoreformerPreTrainedModel):
    """Token classification over any single-stack family; the family subclass names its base model class."""

    base_model_class: type[CoreformerPreTrainedModel]

    def __init__(self, config: CoreformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
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
        logits = self.classifier(self.dropout(outputs.last_hidden_state))  # (B, T, num_labels)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config, **kwargs)
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class CoreformerSequenceClassifier(CoreformerPreTrainedModel):
    """Sequence classification over any single-stack family.

    The family subclass names its base model class and which token summarises the sequence: the first one for a
    bidirectional encoder ([CLS]), the last non-padding one for a causal decoder (the only one that saw everything).
    """

    base_model_class: type[CoreformerPreTrainedModel]
    pool_last_token: bool

    def __init__(self, config: CoreformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
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
        hidden_states = outputs.last_hidden_state
        if self.pool_last_token:
            pooled = pool_last_token(hidden_states, attention_mask, input_ids, self.config.pad_token_id)
        else:
            pooled = hidden_states[:, 0]
        logits = self.classifier(pooled)  # (B, num_labels)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config, **kwargs)
        return SequenceClassifierOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=getattr(outputs, "past_key_values", None),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
