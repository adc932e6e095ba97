"""What every family shares: the pretrained-model base and THE stack.

`CoreformerStack` is the one encoder/decoder stack. It embeds tokens, has its planner build the masks and the rotary
(cos, sin) once per forward, runs its blocks and applies the final norm. The families differ only in how they build it:

    encoder model   CoreformerStack(config, layer_types=config.layer_types, embed_tokens=..., is_causal=False)
    decoder model   CoreformerStack(config, layer_types=config.layer_types, embed_tokens=..., is_causal=True)
    seq2seq model   encoder stack as above + CoreformerCrossAttendingStack(config, layer_types=..., embed_tokens=...)

Layers may differ in attention type (`layer_types`, one entry each in `layer_types.py`): per forward the stack's
`planner` (a `forward_plan.ForwardPlanner` it builds and holds; a plain object, so no checkpoint keys) makes one plan
(a mask per type present, which kernels run, the probability masks, the rotary angles, where the real tokens are) and
the stack hands it to every block. The stack keeps what holds weights or state: embeddings, blocks, norm, caches.
Hidden states and attentions are recorded by transformers' `capture_outputs` hooks (`_can_record_outputs`), not
collected by hand; the stack is a `PreTrainedModel` for that (transformers' contract, as BART's encoder and decoder).

The head pieces the families share live in `modeling_heads.py`.
"""

import re
from itertools import chain

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
)
from transformers.utils.import_utils import is_torchdynamo_compiling
from transformers.utils.output_capturing import capture_outputs

from .attention import Attention
from .compat import (
    CACHE_KEYWORDS,
    CONTINUOUS_BATCHING,
    SELECTS_HIDDEN_STATES,
    cache_from,
    is_paged_cache,
    output_recorder,
    with_cache,
)
from .configuration_coreformer import CoreformerConfig
from .forward_plan import ForwardPlan, ForwardPlanner, packed_rows
from .layer_types import LAYER_TYPES
from .layers import (
    MLP,
    Block,
    RotaryEmbedding,
    SinusoidalPositions,
    build_norm,
    sinusoidal_table,
)
from .lowrank_attention import SequenceProjection
from .lsh_attention import HashingProjection
from .vllm_serving import built_by_vllm, publish, refuse_unserved, restore


class CoreformerPreTrainedModel(PreTrainedModel):
    """Capability flags and weight init shared by every coreformer model."""

    config: CoreformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _skip_keys_device_placement = CACHE_KEYWORDS
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # What is read as a matrix or fed to a hash, declared as transformers reads it (`post_init` names what the model
    # holds: transformers requires each name to match a module of the model, and in one of the two lists only).
    # Linformer's E and F and the rotations of "lsh" layers stay fp32 under fp16 and bf16 loads (`_strict`); being no
    # linear layers, quantizers leave them. An "lsh" layer's query-key projection, whose output is hashed, is never
    # quantized (quantizers skip `_keep_in_fp32_modules`, which also keeps it fp32 under fp16 loads); nor is what a
    # kernel names `unquantized` (the gate projections of "gated_deltanet" layers).
    KEPT_FP32 = ("k_seq_proj", "v_seq_proj", "lsh_rotations")

    def __init__(self, config: CoreformerConfig, *args, **kwargs):
        restore(config)  # vLLM builds more than one model from a config it published on (`vllm_serving.py`)
        super().__init__(config, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            raise ValueError(
                f"The weights of {pretrained_model_name_or_path} are truncated or corrupt ({error}): download or save "
                f"the checkpoint again."
            ) from error

    def post_init(self) -> None:
        super().post_init()  # the lists become sets, holding the submodels' names too
        if any(LAYER_TYPES[module.layer_type].stateful for module in self.modules() if isinstance(module, Attention)):
            # transformers' flag for a cache holding a recurrent state: generate() then refuses assisted decoding,
            # whose crop would leave the rejected draft tokens in the state. Per instance: the class holds others too.
            # (Read from the layers: under vLLM the config's layer types are in its engine's names.)
            self._is_stateful = True
        held = [name for name, _ in chain(self.named_parameters(), self.named_buffers())]
        self._keep_in_fp32_modules_strict |= {
            kept for kept in self.KEPT_FP32 if any(re.search(rf"(?:^|\.){kept}(?:\.|$)", name) for name in held)
        }
        # "q_proj" alone names every layer's: each hashing one by its place in its stack (the same pattern in a stack
        # and in the family model holding it; a regex matched from the start, as quantizers match names).
        unquantized = [name for name, module in self.named_modules() if isinstance(module, HashingProjection)]
        unquantized += [
            f"{name}.{part}"
            for name, module in self.named_modules()
            if isinstance(module, Attention) and module.kernel is not None
            for part in module.kernel.unquantized
        ]
        self._keep_in_fp32_modules |= {".*" + re.escape(re.search(r"layers\.\d+\..*", name)[0]) for name in unquantized}

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() refuses caches to any class whose name contains "reformer" (meant for Reformer) -- and
        # "coreformer" does. Without this, generate() silently ignores cache_implementation="static".
        return True

    def create_masks_for_generate(
        self,
        config: CoreformerConfig,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        cache: Cache | None = None,
        **kwargs,
    ) -> dict[str, torch.Tensor | None]:
        """generate() builds the masks ahead of a compiled forward when the cache is static, so that every decode step
        hands the forward tensors of one shape (no recompiles). transformers' own builder knows only its layer-type
        names (and hands back the raw 2D mask for any other); this builds ours, per layer type, with the causal
        stack's planner (`ForwardPlanner.build_masks`). (B, past + T) padding mask -> {layer type: mask for the
        configured backend}. The cache comes as `cache` from transformers 5.24, as `past_key_values` before."""
        stack = self.base_model.decoder
        past_key_values = cache_from(past_key_values, cache)
        cache = (
            past_key_values.self_attention_cache
            if isinstance(past_key_values, EncoderDecoderCache)
            else past_key_values
        )
        if position_ids is None:
            past_length = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0) + past_length
        return stack.planner.build_masks(inputs_embeds, attention_mask, cache, position_ids)

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (`generate_batch`, `transformers serve --continuous-batching`), after
        refusing by name what it would run wrongly: its manager reports a failing forward only as failed requests."""
        if not CONTINUOUS_BATCHING:
            raise ValueError(
                "continuous batching of coreformer models needs transformers>=5.17 (5.16 reads the layer types as the "
                "config stores them, in coreformer's names): upgrade transformers, or generate with model.generate()."
            )
        self.base_model.decoder.planner.check_continuous_batching()
        self.config.serve_continuous_batching()
        return super().init_continuous_batching(*args, **kwargs)

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
        if isinstance(module, Attention) and module.has_sinks:  # drawn as GPT-OSS draws its sinks
            init.normal_(module.sinks, mean=0.0, std=std)
        if isinstance(module, Attention) and module.kernel is not None:
            module.kernel.init_weights(module)
        elif isinstance(module, SequenceProjection):  # Linformer's E/F, drawn as the linear layers they once were
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())
        elif isinstance(module, SinusoidalPositions):
            init.copy_(module.table, sinusoidal_table(module.num_positions, module.dim))


class CoreformerStack(CoreformerPreTrainedModel):
    """Embeddings, a stack of `Block`s and the final norm; bidirectional or causal, with or without cross-attention.

    A `PreTrainedModel` of its own, as BART's encoder and decoder are: transformers' output-recording contract puts
    `_can_record_outputs` on the PreTrainedModel whose forward carries `@capture_outputs`. The family base models hold
    their stacks under the checkpoint names (`model.decoder.layers.0...`) and do not capture again.

    Args:
        config: the family config.
        layer_types: the attention type of each block ("full", "sliding", ...); its length is the depth.
        embed_tokens: the token embedding; the seq2seq model gives each stack its own, tied to `shared` through
            `_tied_weights_keys`.
        is_causal: causal self-attention (decoder) or bidirectional (encoder).
        cross_attention: add cross-attention to the encoder output in every block (`CoreformerCrossAttendingStack`).

    `planner` (`forward_plan.ForwardPlanner`) decides each forward's masks, kernels, documents and positions; the stack
    embeds, runs the blocks with the plan, applies the final norm and handles the cache.

    Hidden states and attentions are recorded by transformers' `capture_outputs` from the blocks and attention
    modules named in `_can_record_outputs` (hooks installed on first use), as Llama, BERT and BART record theirs.
    """

    _can_record_outputs = {
        "hidden_states": output_recorder(Block, index=0),
        "attentions": output_recorder(Attention, index=1, layer_name="self_attn"),
    }

    def __init__(
        self,
        config: CoreformerConfig,
        *,
        layer_types: list[str],
        embed_tokens: nn.Embedding,
        is_causal: bool,
        cross_attention: bool = False,
    ):
        # Keyword-only: vLLM wraps this __init__ (its torch.compile support) and checks positional arguments by type.
        config.require_head_dim()  # before anything sized by it
        super().__init__(config)
        if built_by_vllm(config):  # vLLM runs no forward before it serves: what it cannot compute is refused here
            refuse_unserved(config, layer_types, is_causal=is_causal, cross_attention=cross_attention)
        self.is_causal = is_causal
        self.cross_attention = cross_attention
        # Not a module (no weights): held as a plain attribute, it adds nothing to the checkpoint.
        self.planner = ForwardPlanner(self.config, layer_types, is_causal=is_causal, cross_attention=cross_attention)
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
        # A second table for the one other rotary base the layer types can use (`local_rope_theta`, ModernBERT's
        # local layers; `ForwardPlanner.rope_thetas` maps each type to its base).
        other_thetas = sorted(set(self.planner.rope_thetas.values()) - {config.rope_theta})
        self.local_rotary_emb = RotaryEmbedding(config, other_thetas[0]) if other_thetas else None
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size > 0 else None
        )
        self.embedding_norm = build_norm(config) if config.embedding_layernorm else None
        self.dropout = nn.Dropout(config.hidden_dropout)

        self.layer_types = list(layer_types)
        self.layers = nn.ModuleList(
            Block(
                config,
                i,
                is_causal=is_causal,
                cross_attention=cross_attention,
                layer_type=layer_type,
                attention_norm=i > 0 or config.first_layer_attention_norm,
            )
            for i, layer_type in enumerate(self.layer_types)
        )
        self.norm = build_norm(config) if config.final_norm else None
        self.post_init()
        if built_by_vllm(config):
            publish(config)  # what vLLM reads when it gives each layer its attention, after this build

    def init_parallel_plans(self) -> None:
        # The config's base-model plans name this stack's modules from the family base model (`decoder.layers.*`),
        # which collects them itself; a stack taking them too would add them again under its own prefix.
        self._tp_plan, self._ep_plan, self._pp_plan, self._fsdp_plan = {}, {}, {}, {}

    def _checked_inputs(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """One clear error for inputs the stack cannot take; `inputs_embeds` in the model's dtype."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds.")
        self._check_input_shapes(input_ids, inputs_embeds)
        if self.cross_attention and encoder_hidden_states is None:
            raise ValueError("This decoder cross-attends to an encoder: pass encoder_hidden_states.")
        if inputs_embeds is not None and not torch.is_autocast_enabled(inputs_embeds.device.type):
            # Embeddings computed elsewhere (another dtype) would fail deep inside the first matmul: match the model.
            inputs_embeds = inputs_embeds.to(self.embed_tokens.weight.dtype)
        return inputs_embeds

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

    @capture_outputs
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
        output_hidden_states: bool | int | list[int] | None = None,
        encoder_documents: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutput | BaseModelOutputWithPastAndCrossAttentions:
        """
        Args:
            input_ids / inputs_embeds: exactly one; (B, T) ids or (B, T, hidden) embeddings.
            attention_mask: (B, past + T), 1 for tokens to attend to, 0 for padding; or the masks generate()
                prepared per layer type for a static cache (`CoreformerPreTrainedModel.create_masks_for_generate`).
            token_type_ids: (B, T) segment ids; ignored when the config has no token types (type_vocab_size=0),
                because tokenizers return them by default.
            position_ids: (B, T); default past + arange(T) (per document in packed rows, below). Generation passes them
                to skip left padding.
            encoder_hidden_states / encoder_attention_mask: the encoder output and its padding mask (cross-attention).
            past_key_values / cache: a `Cache` updated in place (causal stacks only); `cache` is its name from 5.24.
            use_cache: build and return a cache; default `config.use_cache` at inference, never while training.
            output_attentions / output_hidden_states: recorded by `capture_outputs` from the blocks
                (`_can_record_outputs`); hidden states may be selected by index (an int or a list), as transformers
                allows. Attentions come under every backend (recomputed next to fast kernels).
            encoder_documents, **kwargs: packed rows (`packed_rows`); kwargs also reach the attention function.
        """
        inputs_embeds = self._checked_inputs(input_ids, inputs_embeds, encoder_hidden_states)
        past_key_values = cache_from(past_key_values, cache)
        output_attentions, output_hidden_states = self._recorded_outputs(output_attentions, output_hidden_states)
        inputs = input_ids if input_ids is not None else inputs_embeds
        if is_paged_cache(past_key_values):  # continuous batching: the batch's kwargs reach the attention as given
            hidden_states = self.embed(input_ids, inputs_embeds, token_type_ids, position_ids)
            plan = self.planner.continuous_batching_plan(
                hidden_states, attention_mask, position_ids, (self.rotary_emb, self.local_rotary_emb)
            )
            hidden_states = self.run_blocks(hidden_states, plan, None, past_key_values, **kwargs)
            return self._stack_output(hidden_states, None)
        packing, documents, position_ids, use_cache = packed_rows(
            inputs, attention_mask, past_key_values, position_ids, use_cache, kwargs
        )
        use_cache, past_key_values, cache = self._resolve_cache(use_cache, past_key_values)
        position_ids = self.planner.checked_positions(inputs, attention_mask, cache, position_ids)
        hidden_states = self.embed(input_ids, inputs_embeds, token_type_ids, position_ids)
        plan = self.planner.plan(
            hidden_states,
            attention_mask,
            cache,
            position_ids,
            encoder_hidden_states,
            encoder_attention_mask,
            output_attentions=output_attentions,
            padded_states=bool(output_hidden_states is not False and output_hidden_states),
            documents=documents,
            encoder_documents=encoder_documents,
            packing=packing,
            rotary_tables=(self.rotary_emb, self.local_rotary_emb),
        )
        hidden_states = self.run_blocks(hidden_states, plan, encoder_hidden_states, past_key_values, **kwargs)
        return self._stack_output(hidden_states, past_key_values if use_cache else None)

    def _recorded_outputs(
        self, output_attentions: bool | None, output_hidden_states: bool | int | list[int] | None
    ) -> tuple[bool, bool | int | list[int]]:
        """(output_attentions, output_hidden_states): the caller's, or the config's where not given."""
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        if not isinstance(output_hidden_states, bool) and not SELECTS_HIDDEN_STATES:
            # Older releases' `capture_outputs` read any index as True and would return every layer's state.
            raise ValueError(
                f"output_hidden_states={output_hidden_states!r} selects hidden states by index, which needs "
                f"transformers>=5.23: upgrade it, or pass output_hidden_states=True and index the returned tuple."
            )
        return output_attentions, output_hidden_states

    def _stack_output(
        self, hidden_states: torch.Tensor, past_key_values: Cache | None
    ) -> BaseModelOutput | BaseModelOutputWithPastAndCrossAttentions:
        """The stack's output: the last hidden states, with the cache (None when not used) for a causal stack."""
        if not self.is_causal:
            return BaseModelOutput(last_hidden_state=hidden_states)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden_states, **with_cache(past_key_values))

    def run_blocks(
        self,
        hidden_states: torch.Tensor,
        plan: ForwardPlan,
        encoder_hidden_states: torch.Tensor | None,
        past_key_values: Cache | None,
        **kwargs,
    ) -> torch.Tensor:
        """The blocks, then the final norm: (B, T, hidden) in and out, zeros at the padding when unpadded."""
        unpadding = plan.unpadding
        if unpadding is not None and not plan.padded_states:
            hidden_states = unpadding.unpad(hidden_states)  # (B, T, hidden) -> (N real tokens, hidden)
        for block in self.layers:
            # Tensors that need gradients go positionally: reentrant checkpointing only sees positional inputs.
            hidden_states, _, _ = block(
                hidden_states, plan, encoder_hidden_states, past_key_values=past_key_values, **kwargs
            )
        if unpadding is not None and plan.padded_states:
            hidden_states = unpadding.unpad(hidden_states)
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        if unpadding is not None:
            hidden_states = unpadding.pad(hidden_states)  # (N, hidden) -> (B, T, hidden), zeros at the padding
        return hidden_states

    def _resolve_cache(
        self, use_cache: bool | None, past_key_values: Cache | None
    ) -> tuple[bool, Cache | None, Cache | None]:
        """Whether this forward caches, the cache, and its self-attention part: none in a bidirectional stack; a
        DynamicCache (wrapped for cross-attention) when caching is on and none was passed."""
        if not self.is_causal:
            return False, None, None
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
            if self.cross_attention:
                # Cross-attention keeps every encoder key whatever the decoder's layer types: a plain cache.
                past_key_values = EncoderDecoderCache(past_key_values, DynamicCache())
        if isinstance(past_key_values, EncoderDecoderCache):
            return use_cache, past_key_values, past_key_values.self_attention_cache
        return use_cache, past_key_values, past_key_values


class CoreformerCrossAttendingStack(CoreformerStack):
    """The seq2seq decoder's stack: a causal `CoreformerStack` whose blocks cross-attend to the encoder output, and
    which records cross-attentions too (transformers keys what a module records by its class, as BART's decoder)."""

    _can_record_outputs = {
        **CoreformerStack._can_record_outputs,
        # negative `output_hidden_states` indices count from this stack's depth, not the encoder's
        "hidden_states": output_recorder(Block, index=0, num_hidden_layers_key="decoder_layers"),
        "cross_attentions": output_recorder(Attention, index=1, layer_name="cross_attn"),
    }

    def __init__(self, config: CoreformerConfig, *, layer_types: list[str], embed_tokens: nn.Embedding):
        super().__init__(
            config, layer_types=layer_types, embed_tokens=embed_tokens, is_causal=True, cross_attention=True
        )
