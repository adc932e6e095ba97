"""The forward plan: what a stack decides once per forward and every block reads.

    CoreformerStack.forward
        plan = self.plan(...)                 masks, kernels, probabilities, rotary angles, unpadding: decided here
        for block in self.layers:
            block(hidden_states, plan, ...)   Block reads plan.layers[its layer type] and plan.cross
                Attention(x, layer_plan)      the core reads its mask, whether its kernel runs, its (cos, sin)

    ForwardPlan
      layers: {layer type: LayerPlan}        one per type present in the stack (layers of a type share everything)
      cross:  LayerPlan | None               cross-attention over the encoder output (cross-attending stacks)
      unpadding, padded_states               where the real tokens are, when the blocks run on them alone

`ForwardPlanner` is the planning half of `CoreformerStack` (`modeling_base.py`): it reads the layer-type table
(`layer_types.py`) for each type's mask overlay and kernel, and the backend, cache and packing of this forward.
Plans are NamedTuples of tensors and flags: built in Python, cheap, and traced by torch.compile without a graph break.
"""

import copy
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_bidirectional_mask, create_causal_mask
from transformers.utils.import_utils import is_torchdynamo_compiling

from .configuration_coreformer import CoreformerConfig
from .layer_types import LAYER_TYPES

Masks = dict[str, torch.Tensor | None]


class Unpadding(NamedTuple):
    """Where the real tokens of a right- or left-padded (B, L) batch sit, so that the position-wise work (projections,
    MLPs, norms) runs on those N tokens alone: ModernBERT's unpadding (Warner et al. 2024); measured 1.7x for a 6 x 384
    encoder on CPU, forward and forward+backward, with 53% real tokens. Scores still see the padded (B, L) layout and
    the usual mask, so every backend and layer type works.

    indices: (N,) flat positions b * L + t of the real tokens.
    """

    indices: torch.Tensor
    batch: int
    length: int

    @classmethod
    def from_padding_mask(cls, padding_mask: torch.Tensor) -> "Unpadding":
        """padding_mask: (B, L), nonzero for real tokens."""
        return cls(padding_mask.flatten().nonzero().squeeze(1), *padding_mask.shape)

    def unpad(self, states: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (N, ...)"""
        return states.reshape(self.batch * self.length, *states.shape[2:]).index_select(0, self.indices)

    def pad(self, states: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, L, ...), zeros at the padding."""
        padded = states.new_zeros(self.batch * self.length, *states.shape[1:]).index_copy(0, self.indices, states)
        return padded.view(self.batch, self.length, *states.shape[1:])


class LayerPlan(NamedTuple):
    """What the attention of one layer type reads in this forward.

    mask: in the configured backend's form; the (B, S) boolean padding mask (or None) where the type takes the
        padding mask itself (`LayerType.padding_mask_only`) or its sparse kernel runs.
    kernel: run the type's kernel (`LayerType.kernel`).
    probability_mask: the mask in eager's form, for probabilities recomputed beside another backend or a kernel;
        None when attentions are not asked for, and for types whose kernel writes its own probabilities or whose
        keys are not the tokens.
    output_attentions: return the attention probabilities.
    position_embeddings: rotary (cos, sin), each (B, T, head_dim), or None.
    unpadding: set when the hidden states hold only the real tokens of a padded batch.
    """

    mask: torch.Tensor | None = None
    kernel: bool = False
    probability_mask: torch.Tensor | None = None
    output_attentions: bool = False
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
    unpadding: Unpadding | None = None


class ForwardPlan(NamedTuple):
    """Everything a stack decides once per forward (`ForwardPlanner.plan`)."""

    layers: dict[str, LayerPlan]
    cross: LayerPlan | None
    unpadding: Unpadding | None
    # Recorded hidden states must be the tensors the computation uses: when they are asked for, blocks take padded
    # states and unpad inside (the same numbers; two index copies per layer) instead of the stack unpadding once.
    padded_states: bool


def eager_view(config: CoreformerConfig) -> CoreformerConfig:
    """A shallow copy of `config` for which transformers' mask builders produce eager's (materialised) masks."""
    eager_config = copy.copy(config)
    eager_config._attn_implementation = "eager"  # the copy has no sub-configs for the setter to reach
    return eager_config


class ForwardPlanner:
    """The planning half of `CoreformerStack`: needs `config`, `layer_types`, `is_causal`, `cross_attention`, and
    the rotary tables (`rotary_emb`, `local_rotary_emb`, `rope_thetas`)."""

    config: CoreformerConfig
    layer_types: list[str]
    is_causal: bool
    cross_attention: bool

    def plan(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | Masks | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
        *,
        packed: bool,
        output_attentions: bool,
        padded_states: bool,
    ) -> ForwardPlan:
        """The plan of this forward. `attention_mask`: the (B, past + T) padding mask, or the masks generate()
        prepared per layer type; `packed`: the caller passed position ids (documents may restart mid-row);
        `padded_states`: hidden states are recorded (see `ForwardPlan.padded_states`)."""
        prepared = self.prepared_masks(attention_mask)
        padding_mask = None if prepared is not None else attention_mask
        unpadding = self.unpadding(padding_mask, cache)
        masks, kernel_types, probability_masks = self.self_attention_masks(
            hidden_states, padding_mask, prepared, cache, position_ids, packed, output_attentions=output_attentions
        )
        rotary = self.rotary_position_embeddings(hidden_states, position_ids)
        layers = {
            name: LayerPlan(
                mask=masks[name],
                kernel=name in kernel_types,
                probability_mask=None if LAYER_TYPES[name].padding_mask_only else probability_masks.get(name),
                output_attentions=output_attentions,
                position_embeddings=rotary.get(name),
                unpadding=unpadding,
            )
            for name in dict.fromkeys(self.layer_types)
        }
        cross = self.cross_attention_plan(
            hidden_states, encoder_hidden_states, encoder_attention_mask, unpadding, output_attentions
        )
        return ForwardPlan(layers, cross, unpadding, unpadding is not None and padded_states)

    def prepared_masks(self, attention_mask) -> Masks | None:
        """Masks already built per layer type (`CoreformerPreTrainedModel.create_masks_for_generate`), or None."""
        if not isinstance(attention_mask, dict):
            return None
        missing = sorted(set(self.layer_types) - set(attention_mask))
        if missing:
            raise ValueError(
                f"attention_mask is a dict of prepared masks without an entry for the layer types {missing}: pass "
                f"the (batch, length) padding mask instead, or one mask per type of {sorted(set(self.layer_types))}."
            )
        return attention_mask

    def self_attention_masks(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        prepared: Masks | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
        packed: bool,
        *,
        output_attentions: bool,
    ) -> tuple[Masks, frozenset[str], Masks]:
        """(the mask per layer type, the layer types whose kernel runs, the eager-form masks for recomputed
        probabilities when attentions are asked for)."""
        always = frozenset(name for name in self.layer_types if self.kernel_always_runs(name))
        if prepared is not None:  # generate() built them ahead, outside a compiled forward
            # the backend's own form, boolean or additive: both read as eager's for the probabilities
            return prepared, always, prepared
        self.check_packed_rows(attention_mask, cache, position_ids, packed)
        sparse_types = self.sparse_kernel_types(attention_mask, cache, packed)
        masks = self.build_masks(hidden_states, attention_mask, cache, position_ids, sparse_types)
        if not output_attentions:
            return masks, always | sparse_types, {}
        if self.config._attn_implementation == "eager" and not sparse_types:
            return masks, always, masks
        eager = self.build_masks(hidden_states, attention_mask, cache, position_ids, config=eager_view(self.config))
        return masks, always | sparse_types, eager

    @staticmethod
    def kernel_always_runs(name: str) -> bool:
        layer_type = LAYER_TYPES[name]
        return layer_type.kernel is not None and not layer_type.dense_fallback

    def check_packed_rows(
        self, attention_mask: torch.Tensor | None, cache: Cache | None, position_ids: torch.Tensor, packed: bool
    ) -> None:
        """transformers separates packed documents (position ids restarting mid-row, no attention_mask, no cache) in
        causal masks only; a type that cannot keep them apart (`LayerType.packed_rows`, e.g. a linear layer's running
        sums) would run across them: refuse that."""
        unmasked_packed = packed and attention_mask is None and cache is None
        unable = sorted({name for name in self.layer_types if not LAYER_TYPES[name].packed_rows})
        if not (self.is_causal and unable and unmasked_packed):
            return
        # The test of transformers' find_packed_sequence_indices: a step other than +1 starts a new document.
        if not is_torchdynamo_compiling() and bool((position_ids.diff(dim=-1) != 1).any()):
            able = ", ".join(f"'{name}'" for name, layer_type in LAYER_TYPES.items() if layer_type.packed_rows)
            raise ValueError(
                f"position_ids restart mid-row (packed documents), which {', '.join(map(repr, unable))} layers cannot "
                f"keep apart: their state would mix the documents, while the other layer types separate them. Give "
                f"each document its own row (pad, and pass attention_mask) instead of packing, or use {able} layers."
            )

    def sparse_kernel_types(
        self, attention_mask: torch.Tensor | None, cache: Cache | None, packed: bool
    ) -> frozenset[str]:
        """The layer types of this stack whose sparse kernel (`LayerType.dense_fallback`) runs in this forward.

        Sliding and strided layers run sparse kernels (O(L·w), O(L·(s + L/s))) under sdpa when nothing constrains
        the keys beyond padding: no cached keys (whose window bookkeeping the dense mask handles) and no packed
        sequences (documents that restart their position ids, which transformers' mask machinery separates). An
        empty dynamic cache layer (a prefill; eval-mode forwards build a DynamicCache by default) hands back exactly
        the new keys, so the kernels apply there too; a static layer hands back its whole fixed-length buffer.
        Under eager the dense reference path runs; under any other backend (flex, a registered custom function) the
        backend gets every call. (The layer check goes first: a static cache's length is a tensor, which
        torch.compile cannot branch on.)
        """
        with_kernel = {name for name in self.layer_types if LAYER_TYPES[name].dense_fallback}
        if not with_kernel or self.config._attn_implementation != "sdpa" or (attention_mask is None and packed):
            return frozenset()
        if cache is not None:
            layers = [index for index, name in enumerate(self.layer_types) if name in with_kernel]
            if any(index < len(cache.layers) and not isinstance(cache.layers[index], DynamicLayer) for index in layers):
                return frozenset()
            if cache.get_seq_length() != 0:
                return frozenset()
        return frozenset(with_kernel)

    def build_masks(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
        sparse_types: frozenset[str] = frozenset(),
        config: CoreformerConfig | None = None,
    ) -> Masks:
        """One mask per attention type in the stack, in the form the configured backend wants.

        Types with a mask overlay ("full", "sliding", "strided") go through transformers' mask machinery (eager,
        sdpa and flex all work; flex turns the pattern into a sparse BlockMask); types that take the padding mask
        itself (`LayerType.padding_mask_only`), and the `sparse_types` that run their kernel, get the (B, S) boolean
        padding mask. `config`: build for another backend than the model's (`eager_view`, for recomputed
        probabilities).
        """
        config = self.config if config is None else config
        self.check_mask_backend(config._attn_implementation)
        masks: Masks = {}
        for name in dict.fromkeys(self.layer_types):
            layer_type = LAYER_TYPES[name]
            if layer_type.padding_mask_only or name in sparse_types:
                if attention_mask is not None and attention_mask.dim() != 2:
                    raise ValueError(f"'{name}' layers need the 2D (batch, length) padding mask.")
                masks[name] = attention_mask.bool() if attention_mask is not None else None
                continue
            overlay = layer_type.overlay(getattr(self.config, layer_type.parameter)) if layer_type.overlay else None
            if self.is_causal:
                masks[name] = create_causal_mask(
                    config=config,
                    inputs_embeds=hidden_states,
                    attention_mask=attention_mask,
                    past_key_values=cache,
                    position_ids=position_ids,
                    and_mask_function=overlay,
                    # Size the mask by a cache layer of this type: a sliding layer holds only its window.
                    layer_idx=self.layer_types.index(name) if cache is not None else None,
                )
            else:
                masks[name] = create_bidirectional_mask(
                    config=config, inputs_embeds=hidden_states, attention_mask=attention_mask, and_mask_function=overlay
                )
        return masks

    def check_mask_backend(self, implementation: str | None) -> None:
        """Types defined by their mask need a backend that reads masks, and a mask function registered for it."""
        patterns = sorted(name for name in set(self.layer_types) if LAYER_TYPES[name].overlay is not None)
        if patterns and implementation is not None and implementation.startswith("flash"):
            raise ValueError(
                f"{patterns} layers are defined by their mask, which {implementation} ignores: use "
                f"attn_implementation='sdpa', 'flex_attention' or 'eager'."
            )
        beyond_window = [name for name in patterns if LAYER_TYPES[name].transformers_window is None]
        if beyond_window and implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"{beyond_window} layers are defined by their mask, but the attention function {implementation!r} "
                f"has no mask function registered, so it would get no mask: register one with "
                f"AttentionMaskInterface.register({implementation!r}, sdpa_mask) (transformers.masking_utils), or use "
                f"'sdpa', 'flex_attention' or 'eager'."
            )

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

    def cross_attention_plan(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
        unpadding: Unpadding | None,
        output_attentions: bool,
    ) -> LayerPlan | None:
        """The plan of cross-attention over the encoder output: its mask, and its eager form when attentions are
        asked for."""
        if not self.cross_attention:
            return None
        masks = [
            create_bidirectional_mask(
                config=config,
                inputs_embeds=hidden_states,
                attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
            )
            for config in ((self.config, eager_view(self.config)) if output_attentions else (self.config,))
        ]
        return LayerPlan(
            mask=masks[0],
            probability_mask=masks[1] if output_attentions else None,
            output_attentions=output_attentions,
            unpadding=unpadding,
        )

    def rotary_position_embeddings(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer type: its rotary (cos, sin), each (B, T, head_dim)}, computed once per rotary base; {} without
        rotary positions."""
        by_theta = {
            table.theta: table(hidden_states, position_ids)
            for table in (self.rotary_emb, self.local_rotary_emb)
            if table is not None
        }
        return {name: by_theta[theta] for name, theta in self.rope_thetas.items()}
