"""Every transformers name that moved between the releases coreformer supports (pyproject: >=5.16.1, <6).

The modeling files run wherever a published folder goes, on whatever transformers its user has, so each name that
differs between releases is resolved here, once, and nothing else in the package asks which release is running.
Where one spelling works on every release (a name all of them accept, a positional argument) the modeling files use
it, with a comment pointing here; where none does, the entry below answers for the running release.

    entry                          changed in  what differs
    CACHE_KEYWORD, cache_from,     5.24        generation's `past_key_values` became `cache`: the keyword generate()
      with_cache, output_cache                 passes to forward and to `create_masks_for_generate`, and the field of
                                               every output class (the old name is deprecated until 5.40)
    CACHE_KEYWORDS                 5.24        both names, for the lists transformers matches keys against
    (positional, forward_plan.py)  5.24        `create_causal_mask`'s fourth parameter, the same rename: passed by
                                               position, which every release reads
    slice_logits_to_keep           5.21        added to transformers.modeling_utils (ours: the same slicing)
    SELECTS_HIDDEN_STATES,         5.23        `output_hidden_states` may select layers by index, and OutputRecorder
      output_recorder                          takes `num_hidden_layers_key` to resolve negative ones
    INDEXED_ATTENTION              5.18        "deepseek_sparse_attention" was renamed "indexed_attention"; the old
                                               name is accepted by every release (5.18+ maps it to the new one)
    assigned_tp_plan_entries       5.21        before, PreTrainedConfig.__init__ assigns `base_model_tp_plan` when
                                               embeddings are tied
    pipeline_generate_kwargs       5.20        pipelines merge their generation settings in `_prepare_generate_kwargs`
    enable_activation_checkpointing  5.23      `gradient_checkpointing_enable` became `activation_checkpointing_enable`
                                               (the old name warns until 6)
    CONTINUOUS_BATCHING            5.17        continuous batching reads the layer types from `get_text_config()`
                                               (5.16 reads `config.layer_types` as stored: in coreformer's names)
    paged_keys_values              5.24        continuous batching's paged cache is updated by the model (Llama's
                                               attention, with the batch's kwargs); before, by the paged attention
                                               functions, which take it as the `cache` keyword

Torch-free: it reads the running release from the installed package's metadata, and imports from transformers only
inside the functions that need a class of it. Copied next to every checkpoint with the other modeling files
(single-dot imports only); docs/compatibility.md says how the range is tested.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _release() -> tuple[int, int]:
    """(major, minor) of the running transformers."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        import transformers

        version = transformers.__version__
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


RELEASE = _release()

CACHE_KEYWORD = "cache" if RELEASE >= (5, 24) else "past_key_values"
# Both names: forwards accept either, and transformers matches output keys and device-placement skips by name.
CACHE_KEYWORDS = ["past_key_values", "cache"]


def cache_from(past_key_values: Any | None, cache: Any | None) -> Any | None:
    """The one cache a forward was given, under either name (5.24 passes `cache`, earlier releases
    `past_key_values`, users either); both at once is refused, as transformers 5.24 refuses it. Where the running
    release has deprecated the old name, passing it warns as its own models do (`deprecate_kwarg`)."""
    if past_key_values is not None and cache is not None:
        raise ValueError("Pass the cache once, as `cache` or as `past_key_values` (its name before transformers 5.24).")
    if past_key_values is not None and CACHE_KEYWORD != "past_key_values" and not _compiling():
        warnings.warn(
            "`past_key_values` is deprecated and will be removed in version 5.40.0: pass the cache as `cache`.",
            FutureWarning,
            stacklevel=3,
        )
    return cache if cache is not None else past_key_values


def _compiling() -> bool:
    """Whether torch.compile is tracing (it cannot trace a warning; transformers' own deprecations stay silent)."""
    from transformers.utils.import_utils import is_torchdynamo_compiling

    return is_torchdynamo_compiling()


def with_cache(cache: Any | None) -> dict[str, Any | None]:
    """The cache as a keyword under the name the running transformers reads, for an output class
    (`Output(**with_cache(c))`) or a forward called inside the package: 5.24 takes the old name too, but warns."""
    return {CACHE_KEYWORD: cache}


def output_cache(outputs: Any) -> Any | None:
    """The cache a model output carries (`outputs.cache` from 5.24, `outputs.past_key_values` before); None when the
    output class has no cache field."""
    return getattr(outputs, CACHE_KEYWORD, None)


def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions generation needs logits for: (B, T, hidden) -> (B, T_kept, hidden). An int keeps the last N
    (0 keeps all), a 1D tensor keeps those indices."""
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep > 0 else hidden_states
    return hidden_states[:, logits_to_keep, :]


SELECTS_HIDDEN_STATES = RELEASE >= (5, 23)


def output_recorder(target_class: type, *, num_hidden_layers_key: str | None = None, **spec: Any) -> Any:
    """transformers' `OutputRecorder(target_class, **spec)`; `num_hidden_layers_key` (the config field giving the
    recorded stack's depth) is passed where the release has it."""
    from transformers.utils.output_capturing import OutputRecorder

    if num_hidden_layers_key is not None and SELECTS_HIDDEN_STATES:
        spec["num_hidden_layers_key"] = num_hidden_layers_key
    return OutputRecorder(target_class, **spec)


INDEXED_ATTENTION = "deepseek_sparse_attention"

# The entry that releases before 5.21 add to `base_model_tp_plan` at init when embeddings are tied: a top-level
# `embed_tokens`, which coreformer's plan already names per stack.
_ASSIGNED_TP_PLAN_ENTRIES = {"embed_tokens": "embedding_rowwise"}


def assigned_tp_plan_entries(assigned: dict[str, str] | None, derived: dict[str, str] | None) -> dict[str, str]:
    """What an assignment to a derived `base_model_tp_plan` asks for beyond the plan itself and the entry older
    releases add on their own; empty when the assignment changes nothing."""
    known = {**(derived or {}), **_ASSIGNED_TP_PLAN_ENTRIES}
    return {name: style for name, style in (assigned or {}).items() if known.get(name) != style}


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each block's activations in backward, under the method name the running release declares."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


CONTINUOUS_BATCHING = RELEASE >= (5, 17)


def is_paged_cache(cache: Any) -> bool:
    """Whether `cache` is continuous batching's `PagedAttentionCache` (`generate_batch`, `transformers serve`): every
    request of the batch flattened into one row, its keys and values in shared blocks."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return isinstance(cache, PagedAttentionCache)


def paged_keys_values(
    cache: Any, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values one layer attends to under continuous batching, as Llama of the running release gets
    them: from 5.24 the model writes the new ones to the paged cache and reads back the requests' pasts, the cache
    filling this layer's varlen arguments into `kwargs` (the layer's own dict) in place; before, the paged attention
    functions do both, given the cache as the `cache` keyword."""
    if RELEASE >= (5, 24):
        return cache.update(key, value, layer_idx, kwargs=kwargs)
    kwargs["cache"] = cache
    return key, value


def pipeline_generate_kwargs(pipeline: Any, generate_kwargs: dict) -> dict:
    """The generate() keywords of one pipeline call: from 5.20 the pipeline merges its own settings in
    `_prepare_generate_kwargs`; before, a call without a `generation_config` gets the pipeline's."""
    if hasattr(pipeline, "_prepare_generate_kwargs"):
        return pipeline._prepare_generate_kwargs(generate_kwargs)
    if "generation_config" in generate_kwargs:
        return generate_kwargs
    return {**generate_kwargs, "generation_config": pipeline.generation_config}
