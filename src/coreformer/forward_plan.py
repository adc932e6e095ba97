"""The forward plan: what a stack decides once per forward and every block reads, and the planner that decides it.

    CoreformerStack.forward
        (continuous batching: self.planner.continuous_batching_plan(...) instead of the three steps below)
        packed_rows(...)                      packed documents and their positions, read from the caller's arguments
        self.planner.checked_positions(...)   the new tokens' positions, the mask's shape and the length checked
        plan = self.planner.plan(...)         masks, kernels, probabilities, rotary angles, unpadding: decided here
        for block in self.layers:
            block(hidden_states, plan, ...)   Block reads plan.layers[its layer type] and plan.cross
                Attention(x, layer_plan)      the core reads its mask, whether its kernel runs, its (cos, sin)

    ForwardPlan
      layers: {layer type: LayerPlan}        one per type present in the stack (layers of a type share everything)
      cross:  LayerPlan | None               cross-attention over the encoder output (cross-attending stacks)
      unpadding, padded_states               where the real tokens are, when the blocks run on them alone
      documents                              (B, T) document of each token of a packed (flattened) batch, or None

Here: `Unpadding`, `LayerPlan`, `ForwardPlan`; the packed-row helpers (document ids from restarting positions or
`cu_seq_lens`, positions within documents, flash attention's varlen arguments, the "same document" mask function);
and `ForwardPlanner`, which builds the plans.

Packed rows: several documents laid end to end in one row, described by position ids that restart at 0 (no
attention_mask), by `cu_seq_lens_q/k` + `max_length_q/k` (transformers' FlashAttentionKwargs) or by `seq_idx`.
`packed_documents` reads whichever the caller passed, once per forward; every mask then ANDs
"same document" into causality and the type's overlay, and kernels read `LayerPlan.documents`:

    row        | a0 a1 a2 a3 a4 | b0 b1 b2 b3 b4 b5 b6 b7 b8 | c0 c1 c2 |
    positions    0  1  2  3  4    0  1  2  3  4  5  6  7  8    0  1  2
    documents    0  0  0  0  0    1  1  1  1  1  1  1  1  1    2  2  2
    cu_seq_lens  0               5                            14        17

`CoreformerStack` (`modeling_base.py`) builds one `ForwardPlanner` and holds it as `stack.planner`: a plain object,
not a module, so it adds no checkpoint keys. The stack keeps what holds weights or state (embeddings, rotary tables,
blocks, final norm, caches) and hands its rotary tables to `plan`. The planner reads the layer-type table
(`layer_types.py`) for each type's mask overlay and kernel, and the backend, cache and packing of this forward.
Plans are NamedTuples of tensors and flags: built in Python, cheap, and traced by torch.compile without a graph break.
"""

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    create_bidirectional_mask,
    create_causal_mask,
)
from transformers.utils.generic import is_flash_attention_requested
from transformers.utils.import_utils import is_torchdynamo_compiling

from .configuration_coreformer import CoreformerConfig
from .layer_types import LAYER_TYPES, check_served

Masks = dict[str, torch.Tensor | None]

# The keyword arguments that describe a packed batch (transformers' FlashAttentionKwargs, and Mamba's `seq_idx`).
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


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
    documents: (B, T) document of each query token of a packed batch (see the module docstring), or None; kernels
        keep keys of other documents out (cross-attention: the masks pair decoder document i with encoder document i).
    attention_kwargs: passed to the attention function, as transformers' models pass them: `position_ids`, and for
        packed rows under flash attention the varlen arguments (`cu_seq_lens_q/k`, `max_length_q/k`). Cross-attention
        gets only the varlen arguments (its keys are not the queries' tokens), pairing the two sides' documents.
    paged: the cache is continuous batching's paged one (`ForwardPlanner.continuous_batching_plan`).
    """

    mask: torch.Tensor | None = None
    kernel: bool = False
    probability_mask: torch.Tensor | None = None
    output_attentions: bool = False
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
    unpadding: Unpadding | None = None
    documents: torch.Tensor | None = None
    attention_kwargs: dict[str, Any] | None = None
    paged: bool = False


class ForwardPlan(NamedTuple):
    """Everything a stack decides once per forward (`ForwardPlanner.plan`)."""

    layers: dict[str, LayerPlan]
    cross: LayerPlan | None
    unpadding: Unpadding | None
    # Recorded hidden states must be the tensors the computation uses: when they are asked for, blocks take padded
    # states and unpad inside (the same numbers; two index copies per layer) instead of the stack unpadding once.
    padded_states: bool
    documents: torch.Tensor | None = None


def document_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(B, T) position ids -> (B, T) document ids, a new document wherever the position does not step by +1 (the test
    of transformers' `find_packed_sequence_indices`); None where no row restarts (checked eagerly only: under
    torch.compile the ids are always returned, as transformers does)."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    documents = (step != 1).cumsum(-1)
    if not is_torchdynamo_compiling() and not bool(documents[:, -1].any()):
        return None
    return documents


def document_ids_from_cu_seq_lens(cu_seq_lens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """(N + 1,) cumulative document lengths over the flattened (B * T) tokens, as flash attention's varlen functions
    read them -> (B, T) document ids, counted from 0 in each row."""
    if not is_torchdynamo_compiling() and (cu_seq_lens.dim() != 1 or int(cu_seq_lens[-1]) != batch * length):
        raise ValueError(
            f"cu_seq_lens must be the 1D cumulative document lengths over the batch's {batch} x {length} = "
            f"{batch * length} flattened tokens (ending at {batch * length}), got {cu_seq_lens.tolist()}: build them "
            f"from the same rows as input_ids (DataCollatorWithFlattening(return_flash_attn_kwargs=True) does)."
        )
    tokens = torch.arange(batch * length, device=cu_seq_lens.device)
    documents = torch.searchsorted(cu_seq_lens[1:].contiguous(), tokens, right=True).view(batch, length)
    return documents - documents[:, :1]


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) each token's position within its document (0 at every document start)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    return index - torch.where(document_starts(documents), index, 0).cummax(-1).values


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) boolean, True at the first token of each document (every row starts one)."""
    changes = documents[:, 1:] != documents[:, :-1]  # (B, T - 1)
    return torch.cat([changes.new_ones(changes.shape[0], 1), changes], dim=1)


def varlen_kwargs(documents: torch.Tensor, key_documents: torch.Tensor | None = None) -> dict[str, Any]:
    """(B, T) document ids of the queries (and (B, S) of the keys, for cross-attention; the queries' own by
    default) -> flash attention's varlen arguments over the flattened tokens (what
    `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives): cu_seq_lens_q/k (N + 1,) int32 and
    max_length_q/k. Query document i reads key document i."""

    def cumulative(ids: torch.Tensor) -> torch.Tensor:
        starts = document_starts(ids).flatten().nonzero().squeeze(1)
        return torch.cat([starts, torch.tensor([ids.numel()], device=ids.device)]).to(torch.int32)

    cu_q = cumulative(documents)
    cu_k = cu_q if key_documents is None else cumulative(key_documents)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"the decoder side of this packed batch holds {cu_q.numel() - 1} documents and the encoder side "
            f"{cu_k.numel() - 1}: cross-attention pairs decoder document i with encoder document i, so pack the same "
            f"documents on both sides."
        )
    return {
        "cu_seq_lens_q": cu_q,
        "cu_seq_lens_k": cu_k,
        "max_length_q": int((cu_q[1:] - cu_q[:-1]).max()),
        "max_length_k": int((cu_k[1:] - cu_k[:-1]).max()),
    }


def same_document(query_documents: torch.Tensor, key_documents: torch.Tensor) -> Callable:
    """transformers' mask function keeping each query to the keys of its own document: (B, T) and (B, S) ids."""

    def allowed(batch_idx, head_idx, q_idx, kv_idx):
        return query_documents[batch_idx, q_idx] == key_documents[batch_idx, kv_idx]

    return allowed


def with_documents(overlay: Callable | None, documents: torch.Tensor | None) -> Callable | None:
    """The type's overlay ANDed with "same document" (packed rows), either alone, or None."""
    if documents is None:
        return overlay
    keep = same_document(documents, documents)
    return keep if overlay is None else and_masks(overlay, keep)


def eager_view(config: CoreformerConfig) -> CoreformerConfig:
    """A shallow copy of `config` for which transformers' mask builders produce eager's (materialised) masks."""
    eager_config = copy.copy(config)
    eager_config._attn_implementation = "eager"  # the copy has no sub-configs for the setter to reach
    return eager_config


def is_eager(config: CoreformerConfig) -> bool:
    """Whether transformers' mask builders produce eager's dense masks for `config`."""
    return config._attn_implementation == "eager"


def packed_documents(
    inputs: torch.Tensor,
    attention_mask: torch.Tensor | Masks | None,
    past_key_values: Cache | None,
    position_ids: torch.Tensor | None,
    packing: dict[str, Any],
) -> torch.Tensor | None:
    """The (B, T) document ids of a packed batch, decided once per forward from whichever description the caller
    passed: `seq_idx` (B, T); `cu_seq_lens_q` (`cu_seq_lens_k` alone: the keys' documents, which are the
    queries' in self-attention); or, as transformers reads them, position ids that restart mid-row when there is
    neither an attention_mask nor a cache. None: one document per row. `inputs`: the (B, T) ids or
    (B, T, hidden) embeddings; `packing`: the caller's `PACKING_KWARGS`."""
    batch, length = inputs.shape[:2]
    if packing.get("seq_idx") is not None:
        seq_idx = packing["seq_idx"]
        return seq_idx - seq_idx[:, :1]
    cu_seq_lens = packing.get("cu_seq_lens_q", packing.get("cu_seq_lens_k"))
    if cu_seq_lens is not None:
        return document_ids_from_cu_seq_lens(cu_seq_lens, batch, length)
    if position_ids is None or attention_mask is not None or past_key_values is not None:
        return None
    return document_ids_from_positions(position_ids.expand(batch, -1))


def packed_rows(
    inputs: torch.Tensor,
    attention_mask: torch.Tensor | Masks | None,
    past_key_values: Cache | None,
    position_ids: torch.Tensor | None,
    use_cache: bool | None,
    kwargs: dict,
) -> tuple[dict, torch.Tensor | None, torch.Tensor | None, bool | None]:
    """Packed rows: several documents end to end in a row, each then getting exactly what it gets alone. They are
    described by position ids that restart mid-row (without attention_mask and cache, as transformers reads
    them), by `cu_seq_lens_q/k` + `max_length_q/k` (FlashAttentionKwargs) or by `seq_idx` in `kwargs`; a seq2seq
    decoder also gets the encoder's `encoder_documents` (B, S) for cross-attention.

    Returns the caller's packing kwargs (popped from the stack's `kwargs`: they describe this stack's rows, not
    cross-attention's), the (B, T) document ids (`packed_documents`, or None), the positions (each document's own
    where the caller gave none) and use_cache (packed rows are never cached)."""
    # Two steps, no walrus: Dynamo cannot trace one inside a comprehension.
    packing = {name: kwargs.pop(name) for name in PACKING_KWARGS if name in kwargs}
    packing = {name: value for name, value in packing.items() if value is not None}
    documents = packed_documents(inputs, attention_mask, past_key_values, position_ids, packing)
    if documents is None:
        return packing, None, position_ids, use_cache
    if position_ids is None:
        position_ids = positions_in_documents(documents)
    if use_cache or past_key_values is not None:
        raise ValueError(
            "this batch packs several documents into a row (restarting position_ids, cu_seq_lens or seq_idx), "
            "which a cache cannot continue: pass use_cache=False and no past_key_values, or give each document "
            "its own row (with attention_mask) to generate."
        )
    return packing, documents, position_ids, False


def check_mask_shape(attention_mask: torch.Tensor | None, batch: int, past_length, length: int) -> None:
    """A 2D padding mask covers the cached and the new tokens: (B, past + T)."""
    # A static cache's length is a tensor: under torch.compile comparing it would break the graph, so the check
    # runs eagerly only (a compiled call was checked on its eager first call by the same code path).
    if attention_mask is None or attention_mask.dim() != 2 or is_torchdynamo_compiling():
        return
    if attention_mask.shape != (batch, int(past_length) + length):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but the input needs ({batch}, "
            f"{int(past_length) + length}) (batch, cached + new tokens): pass the mask the tokenizer returned with "
            f"these input_ids."
        )


def kernel_always_runs(name: str) -> bool:
    """Whether layer type `name` runs its kernel under every backend: it has one and no dense mask form."""
    layer_type = LAYER_TYPES[name]
    return layer_type.kernel is not None and not layer_type.dense_fallback


class ForwardPlanner:
    """Plans every forward of one stack. `CoreformerStack` builds one in its `__init__` and holds it as `planner`.

    A plain object, not a module: it holds no parameters or buffers, so a stack's checkpoint keys are those of its
    embeddings, blocks and norm alone. It reads the stack's own config object (an attention backend set on the model
    later reaches it), the stack's layer types and its direction; the rotary tables stay the stack's modules and come
    with each `plan` call.

    Args:
        config: the stack's config.
        layer_types: the attention type of each block, as the stack has them.
        is_causal: causal self-attention (decoder) or bidirectional (encoder).
        cross_attention: the blocks cross-attend to an encoder output.
    """

    def __init__(
        self, config: CoreformerConfig, layer_types: list[str], *, is_causal: bool, cross_attention: bool = False
    ):
        self.config = config
        self.layer_types = list(layer_types)
        self.is_causal = is_causal
        self.cross_attention = cross_attention
        # The rotary base of each layer type present (`config.rope_theta_of`); {} without rotary positions.
        rotary = config.position_embedding_type == "rotary"
        self.rope_thetas = {name: config.rope_theta_of(name) for name in dict.fromkeys(self.layer_types) if rotary}

    def checked_positions(
        self,
        inputs: torch.Tensor,
        attention_mask: torch.Tensor | Masks | None,
        cache: Cache | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """The positions of the new tokens, after checking the mask and the length against them: the caller's, or
        past + arange(T) (1, T). `inputs`: the ids (B, T) or the embeddings (B, T, hidden); `cache`: the
        self-attention cache."""
        attention_mask = attention_mask if self.prepared_masks(attention_mask) is None else None
        batch, length = inputs.shape[:2]
        past_length = cache.get_seq_length() if cache is not None else 0
        check_mask_shape(attention_mask, batch, past_length, length)
        self.check_length(length)
        if position_ids is not None:
            return position_ids
        return torch.arange(length, device=inputs.device).unsqueeze(0) + past_length  # (1, T)

    def check_length(self, length: int) -> None:
        # A type bounded by a config field (Linformer's E/F have one column per position up to
        # max_position_embeddings) would otherwise fail in an opaque matmul where positions are not learned (rotary,
        # none). Such types are never causal, so there is never a cached past to add.
        for name in dict.fromkeys(self.layer_types):
            field = LAYER_TYPES[name].max_length_field
            if field is not None and length > getattr(self.config, field):
                limit = getattr(self.config, field)
                raise ValueError(
                    f"the input has {length} tokens, more than the {limit} ({field}) that this model's '{name}' "
                    f"layers accept: truncate the input (tokenizer(..., truncation=True, max_length={limit})) or "
                    f"build the model with a larger {field}."
                )

    def plan(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | Masks | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
        *,
        output_attentions: bool,
        padded_states: bool,
        documents: torch.Tensor | None = None,
        encoder_documents: torch.Tensor | None = None,
        packing: dict[str, Any] | None = None,
        rotary_tables: tuple[torch.nn.Module | None, ...] = (),
    ) -> ForwardPlan:
        """The plan of this forward. `attention_mask`: the (B, past + T) padding mask, or the masks generate()
        prepared per layer type; `padded_states`: hidden states are recorded (see `ForwardPlan.padded_states`);
        `documents`: the (B, T) document ids of a packed batch (`packed_documents`), `encoder_documents` those of
        the encoder output cross-attention reads (B, S); `packing`: the caller's `PACKING_KWARGS`; `rotary_tables`:
        the stack's `RotaryEmbedding`s (None where absent), one per rotary base its layer types use."""
        prepared = self.prepared_masks(attention_mask)
        padding_mask = None if prepared is not None else attention_mask
        unpadding = self.unpadding(padding_mask, cache)
        masks, kernel_types, probability_masks = self.self_attention_masks(
            hidden_states, padding_mask, prepared, cache, position_ids, documents, output_attentions=output_attentions
        )
        rotary = self.rotary_position_embeddings(hidden_states, position_ids, rotary_tables)
        attention_kwargs = self.attention_kwargs(position_ids, documents, packing or {})
        layers = {
            name: LayerPlan(
                mask=masks[name],
                kernel=name in kernel_types,
                probability_mask=None if LAYER_TYPES[name].padding_mask_only else probability_masks.get(name),
                output_attentions=output_attentions,
                position_embeddings=rotary.get(name),
                unpadding=unpadding,
                documents=documents,
                attention_kwargs=attention_kwargs,
            )
            for name in dict.fromkeys(self.layer_types)
        }
        cross = self.cross_attention_plan(
            hidden_states,
            encoder_hidden_states,
            encoder_attention_mask,
            unpadding,
            output_attentions,
            documents,
            encoder_documents,
        )
        return ForwardPlan(layers, cross, unpadding, unpadding is not None and padded_states, documents)

    def continuous_batching_plan(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | Masks | None,
        position_ids: torch.Tensor,
        rotary_tables: tuple[torch.nn.Module | None, ...] = (),
    ) -> ForwardPlan:
        """The plan of a continuous-batching forward (`generate_batch`, a paged cache): every request of the batch
        end to end in one (1, N) row with its own `position_ids`, under the masks continuous batching built for it
        by transformers' layer type (a dict, or one tensor where the model has one type; None under flash attention,
        which reads the varlen arguments arriving with the call's kwargs). Only the types transformers computes
        exactly run (`LayerType.served_as`, checked once as batching starts: `check_continuous_batching`); no kernel
        runs."""
        rotary = self.rotary_position_embeddings(hidden_states, position_ids, rotary_tables)
        layers = {}
        for name in dict.fromkeys(self.layer_types):
            served_as = LAYER_TYPES[name].served_as
            mask = attention_mask.get(served_as) if isinstance(attention_mask, dict) else attention_mask
            layers[name] = LayerPlan(
                mask=mask,
                position_embeddings=rotary.get(name),
                attention_kwargs={"position_ids": position_ids},
                paged=True,
            )
        return ForwardPlan(layers, None, None, False)

    def check_continuous_batching(self) -> None:
        """Refuse, by name, what continuous batching would run wrongly (`generate_batch` calls this before starting)."""
        if not self.is_causal or self.cross_attention:
            raise ValueError(
                "continuous batching (generate_batch, transformers serve --continuous-batching) serves decoder-only "
                "models: generate this encoder-decoder model with model.generate(), which batches padded inputs."
            )
        check_served(
            self.layer_types,
            "continuous batching (generate_batch, transformers serve --continuous-batching)",
            "generate with model.generate(), which batches padded prompts and runs every layer type.",
        )
        if self.config.attention_sinks:  # its paged attention functions take no sink logit
            raise ValueError(
                "continuous batching (generate_batch, transformers serve --continuous-batching) runs every layer with "
                "transformers' paged attention, which has no attention sinks, but this model has "
                "attention_sinks=True: generate with model.generate(), which batches padded prompts."
            )

    def attention_kwargs(
        self, position_ids: torch.Tensor, documents: torch.Tensor | None, packing: dict[str, Any]
    ) -> dict[str, Any]:
        """What self-attention hands the attention function beyond q/k/v and the mask, as transformers' Llama does:
        the position ids; for packed rows under flash attention (which reads no mask) the varlen arguments of the
        documents, else the caller's varlen arguments as given."""
        kwargs: dict[str, Any] = {"position_ids": position_ids}
        if documents is not None and self.flash_requested():
            # Derived from this stack's own documents: a seq2seq caller's cu_seq_lens_q/k describe the decoder and
            # the encoder side, which neither self-attention may read as its own.
            return kwargs | varlen_kwargs(documents)
        return kwargs | {name: packing[name] for name in PACKING_KWARGS[:4] if packing.get(name) is not None}

    def flash_requested(self) -> bool:
        return is_flash_attention_requested(requested_attention_implementation=self.config._attn_implementation)

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
        documents: torch.Tensor | None,
        *,
        output_attentions: bool,
    ) -> tuple[Masks, frozenset[str], Masks]:
        """(the mask per layer type, the layer types whose kernel runs, the eager-form masks for recomputed
        probabilities when attentions are asked for)."""
        always = frozenset(name for name in self.layer_types if kernel_always_runs(name))
        if prepared is not None:  # generate() built them ahead, outside a compiled forward
            # the backend's own form, boolean or additive: both read as eager's for the probabilities
            return prepared, always, prepared
        self.check_packed_rows(documents)
        sparse_types = self.sparse_kernel_types(attention_mask, cache)
        masks = self.build_masks(hidden_states, attention_mask, cache, position_ids, sparse_types, documents=documents)
        if not output_attentions:
            return masks, always | sparse_types, {}
        if self.config._attn_implementation == "eager" and not sparse_types:
            return masks, always, masks
        eager_config = eager_view(self.config)
        eager = self.build_masks(
            hidden_states, attention_mask, cache, position_ids, config=eager_config, documents=documents
        )
        return masks, always | sparse_types, eager

    def check_packed_rows(self, documents: torch.Tensor | None) -> None:
        """A layer type that cannot give each document of a packed row what it gets alone (`LayerType.packed_rows`:
        low-rank projections mix the whole sequence) refuses packed input."""
        unable = sorted({name for name in self.layer_types if not LAYER_TYPES[name].packed_rows})
        if documents is None or not unable:
            return
        raise ValueError(
            f"this batch packs several documents into a row (restarting position_ids, cu_seq_lens or seq_idx), which "
            f"{', '.join(map(repr, unable))} layers cannot keep apart (they lay out the whole row at once): "
            f"give each document its own row (pad, and pass attention_mask) instead of packing."
        )

    def sparse_kernel_types(self, attention_mask: torch.Tensor | None, cache: Cache | None) -> frozenset[str]:
        """The layer types of this stack whose sparse kernel (`LayerType.dense_fallback`) runs in this forward.

        Sliding and strided layers run sparse kernels (O(L·w), O(L·(s + L/s))) under sdpa when nothing constrains
        the keys beyond padding and documents: no cached keys (whose window bookkeeping the dense mask handles); on
        packed rows they keep O(L·w) with document ids beside row ids (`LayerPlan.documents`). An empty dynamic
        cache layer (a prefill; eval-mode forwards build a DynamicCache by default) hands back exactly the new keys,
        so the kernels apply there too; a static layer hands back its whole fixed-length buffer.
        Under eager the dense reference path runs; under any other backend (flex, a registered custom function) the
        backend gets every call. (The layer check goes first: a static cache's length is a tensor, which
        torch.compile cannot branch on.)
        """
        with_kernel = {name for name in self.layer_types if LAYER_TYPES[name].dense_fallback}
        # The sparse kernels have no sink logit (`attention_sinks`): the masked backend computes those layers.
        if not with_kernel or self.config._attn_implementation != "sdpa" or self.config.attention_sinks:
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
        documents: torch.Tensor | None = None,
    ) -> Masks:
        """One mask per attention type in the stack, in the form the configured backend wants.

        Types with a mask overlay ("full", "sliding", "strided") go through transformers' mask machinery (eager,
        sdpa and flex all work; flex turns the pattern into a sparse BlockMask); types that take the padding mask
        itself (`LayerType.padding_mask_only`), and the `sparse_types` that run their kernel, get the (B, S) boolean
        padding mask; types whose kernel reads eager's dense mask (`LayerType.eager_mask`) get that form under every
        backend. `config`: build for another backend than the model's (`eager_view`, for recomputed
        probabilities). `documents`: (B, T) document ids of a packed batch, ANDed into every built mask (the stack
        decides them, so transformers is not left to find them again from the position ids).
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
            parameter = getattr(self.config, layer_type.parameter) if layer_type.parameter else None
            mask_config = eager_view(config) if layer_type.eager_mask and not is_eager(config) else config
            if documents is not None and layer_type.document_overlay is not None:
                overlay = layer_type.document_overlay(parameter, documents)  # laid out per document
            else:
                overlay = with_documents(layer_type.overlay(parameter) if layer_type.overlay else None, documents)
            if self.is_causal:
                # Positional: the fourth parameter is the cache, named `past_key_values` before transformers 5.24
                # and `cache` since (compat.CACHE_KEYWORD).
                masks[name] = create_causal_mask(
                    mask_config,
                    hidden_states,
                    attention_mask,
                    cache,
                    position_ids=position_ids if documents is None else None,
                    and_mask_function=overlay,
                    # Size the mask by a cache layer of this type: a sliding layer holds only its window.
                    layer_idx=self.layer_types.index(name) if cache is not None else None,
                )
            else:
                masks[name] = create_bidirectional_mask(
                    config=mask_config,
                    inputs_embeds=hidden_states,
                    attention_mask=attention_mask,
                    and_mask_function=overlay,
                )
        return masks

    def check_mask_backend(self, implementation: str | None) -> None:
        """Types defined by their mask need a backend that reads masks, and a mask function registered for it; the
        paged implementations read continuous batching's masks only."""
        if implementation is not None and implementation.startswith("paged|"):
            raise ValueError(
                f"{implementation!r} attends over continuous batching's paged cache (generate_batch sets it for its "
                f"own forwards, and puts the model's back): run this forward with "
                f"attn_implementation={implementation.removeprefix('paged|')!r}."
            )
        patterns = sorted(name for name in set(self.layer_types) if LAYER_TYPES[name].overlay is not None)
        # A window reaches every attention function as its `sliding_window` argument (as Mistral's does); other
        # patterns only through a mask.
        beyond_window = [name for name in patterns if LAYER_TYPES[name].transformers_window is None]
        if beyond_window and is_flash_attention_requested(requested_attention_implementation=implementation):
            raise ValueError(
                f"{beyond_window} layers are defined by their mask, which {implementation} ignores: use "
                f"attn_implementation='sdpa', 'flex_attention' or 'eager'."
            )
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
        documents: torch.Tensor | None = None,
        encoder_documents: torch.Tensor | None = None,
    ) -> LayerPlan | None:
        """The plan of cross-attention over the encoder output: its mask, and its eager form when attentions are
        asked for. Packed on both sides, decoder document i reads encoder document i alone."""
        if not self.cross_attention:
            return None
        if (documents is None) != (encoder_documents is None):
            packed, single = ("decoder", "encoder") if documents is not None else ("encoder", "decoder")
            raise ValueError(
                f"the {packed} side of this batch packs several documents into a row but the {single} side does not, "
                f"so cross-attention cannot pair them: pack both sides the same way (decoder document i answers "
                f"encoder document i), or neither."
            )
        pairing = same_document(documents, encoder_documents) if documents is not None else None
        masks = [
            create_bidirectional_mask(
                config=config,
                inputs_embeds=hidden_states,
                attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
                and_mask_function=pairing,
            )
            for config in ((self.config, eager_view(self.config)) if output_attentions else (self.config,))
        ]
        return LayerPlan(
            mask=masks[0],
            probability_mask=masks[1] if output_attentions else None,
            output_attentions=output_attentions,
            unpadding=unpadding,
            documents=documents,
            # flash reads no mask: the pairing reaches it as varlen arguments (decoder document i, encoder document i)
            attention_kwargs=varlen_kwargs(documents, encoder_documents)
            if documents is not None and self.flash_requested()
            else None,
        )

    def rotary_position_embeddings(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, tables: tuple[torch.nn.Module | None, ...]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer type: its rotary (cos, sin), each (B, T, head_dim)}, computed once per rotary base by the stack's
        `tables`; {} without rotary positions."""
        by_theta = {table.theta: table(hidden_states, position_ids) for table in tables if table is not None}
        return {name: by_theta[theta] for name, theta in self.rope_thetas.items()}
