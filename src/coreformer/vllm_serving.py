"""Serving with vLLM's Transformers backend: `vllm.LLM(model=folder, model_impl="transformers",
trust_remote_code=True)` builds this model with `config._attn_implementation == "vllm"` (`built_by_vllm`).

vLLM runs every request of a batch as one flattened row, with no attention mask and no transformers cache: its own
paged attention takes the place of each layer's backend call (the one call in `Attention.forward`), and it learns
what each layer attends to from the config, after building the model: layer i slides a window where
`get_text_config().layer_types[i] == "sliding_attention"`, of `sliding_window` tokens counting the query (as
transformers counts it). So, when vLLM builds a coreformer model:

    refuse_unserved(config, ...)    at the start of each stack: raise, naming them, for the layer types vLLM's attention
                                    does not compute (`layer_types.check_served`), attention sinks (its attention has
                                    none), a decoder's LM head transform (vLLM brings its own plain LM head) and
                                    cross-attention (no encoder-decoder). Gate and QK-norm sit outside the attention
                                    call vLLM replaces, so they serve.
    publish(config)                 at the end: transformers' names (`LayerType.served_as`) and window written onto
                                    the config itself (vLLM tells a text model from a multimodal one by
                                    `get_text_config() is config`, so no copy will do), ours kept beside them
    restore(config)                 before any model is built from it: ours back (vLLM builds a model to inspect,
                                    then the one it serves, from the same config object)

Every other layer type would run as something else without an error (strided and block masks never reach vLLM's
attention; linear and lsh kernels keep state vLLM's cache does not hold), which is why they are refused while vLLM
loads the model: on CPU it runs no forward before serving. `coreformer export --to native` serves what it can as
transformers' own architectures instead (docs/guides/serving.md).
"""

from typing import Any

from .configuration_coreformer import ENGINE_ORIGINALS
from .layer_types import LAYER_TYPES, check_served

VLLM_IMPLEMENTATION = "vllm"  # the attention implementation vLLM's Transformers backend registers and sets
WITH_TRANSFORMERS = "serve it with transformers (from_pretrained(..., trust_remote_code=True), then generate())"


def built_by_vllm(config: Any) -> bool:
    """Whether vLLM's Transformers backend is building a model from `config`."""
    return getattr(config, "_attn_implementation", None) == VLLM_IMPLEMENTATION


def refuse_unserved(config: Any, layer_types: list[str], *, is_causal: bool, cross_attention: bool) -> None:
    """One ValueError for what vLLM would not compute exactly, naming it and what serves such a model."""
    if cross_attention:
        raise ValueError(f"vLLM's Transformers backend serves no encoder-decoder model: {WITH_TRANSFORMERS}.")
    if is_causal and config.lm_head_transform:
        raise ValueError(
            "This decoder has lm_head_transform=True (dense + activation + norm before the vocabulary projection), "
            f"but vLLM's Transformers backend runs the base model under its own plain LM head: {WITH_TRANSFORMERS}."
        )
    check_served(
        layer_types,
        "vLLM's Transformers backend",
        f"{WITH_TRANSFORMERS}, or train a model of 'full' and 'sliding' layers (which also exports to a native "
        f"architecture vLLM serves: coreformer export).",
    )
    if config.attention_sinks:  # the one attention call it replaces is where the sinks join the softmax
        raise ValueError(
            "This model has attention_sinks=True, but vLLM's Transformers backend replaces each layer's attention "
            f"call with its own paged attention, which has no sinks: {WITH_TRANSFORMERS}."
        )


def publish(config: Any) -> None:
    """Write what vLLM reads after building the model onto the config: the layer types in transformers' names and
    the window counting the query; ours go to the config's `ENGINE_ORIGINALS` (never saved: `to_dict` writes them
    back in their place). Once per config (a second stack finds it done)."""
    if ENGINE_ORIGINALS in config.__dict__:
        return
    originals = {"layer_types": list(config.layer_types), "sliding_window": config.sliding_window}
    served = {"layer_types": [LAYER_TYPES[name].served_as for name in config.layer_types]}
    if config.sliding_window is not None:
        served["sliding_window"] = LAYER_TYPES["sliding"].transformers_window(config.sliding_window)
    for name, value in served.items():
        object.__setattr__(config, name, value)  # past the strict dataclass' checks: these names are not ours
    config.__dict__[ENGINE_ORIGINALS] = originals


def restore(config: Any) -> None:
    """Put back the values `publish` replaced, before a model is built from the config again."""
    originals = config.__dict__.pop(ENGINE_ORIGINALS, None)
    for name, value in (originals or {}).items():
        object.__setattr__(config, name, value)
