"""The hooks of a layer type that computes more than a mask: what `Attention` calls, and when the forward plan says.

A layer type's kernel (`layer_types.LayerType.kernel` loads it) is a `LayerKernel` subclass in its own file beside the
attention core (`sparse_attention.py`, `linear_attention.py`, `lowrank_attention.py`). The core owns q/k/v, heads
and caches; a kernel receives them at fixed points of `Attention.forward`:

    build(attention)           once, at construction: extra parameters/buffers (their names are checkpoint keys)
    init_weights(attention)    from `_init_weights`: values for what `build` registered
    mix(...)                   the whole layer, for a token mixer that is not attention over keys (Gated DeltaNet):
                               the layer input -> what `o_proj` wrote; nothing below runs
    inputs(...)                queries and what the cache holds, from the layer input, instead of the core's
                               projections (multi-head latent attention's latents)
    project(...)               keys/values before the scores (Linformer's projections along the sequence)
    attend(...)                the scores and weighted values instead of the configured backend, (B, T, H, D)
    probabilities(...)         the (B, H, T, S) probabilities of a kernel whose form is not a softmax over keys
    combine(...)               the heads o_proj reads, from what the backend (or `attend`) returned (differential)

`keeps_cache`: the kernel reads and writes its own cache layer (the core does not put keys/values in it).
`unquantized`: the names of modules `build` registers that quantizers must leave in full precision.
`cached_keys`: the kernel attends over every key the cache holds (it runs while decoding), not this call's alone. This
file is free of torch so that the configuration, which reads the layer-type table, never loads a kernel.
"""

from typing import Any


class LayerKernel:
    """Defaults: nothing extra, keys/values unchanged, the configured backend attends, softmax probabilities."""

    keeps_cache = False
    cached_keys = False
    unquantized: tuple[str, ...] = ()

    def build(self, attention: Any) -> None:
        """Register extra parameters/buffers on the attention module (`attention.config` holds the settings)."""

    def init_weights(self, attention: Any) -> None:
        """Fill what `build` registered (models are built on the meta device; `_init_weights` calls this)."""

    def mix(self, attention: Any, hidden_states: Any, plan: Any, cache: Any) -> Any:
        """The layer input, (B, T, hidden) or the unpadded (N, hidden) real tokens (`plan.unpadding`), its plan and the
        self-attention cache (or None) -> the layer's output in the same layout; None for attention over keys (the
        core's projections, the backend and the hooks below)."""
        return None

    def inputs(self, attention: Any, hidden_states: Any, plan: Any, rotary: Any) -> tuple[Any, Any, Any] | None:
        """The layer input, (B, T, hidden) or the unpadded (N, hidden) real tokens (`plan.unpadding`) -> (B, H, T, D)
        queries with their rotary angles and the (B, ·, S, ·) keys and values the cache is to hold; None for the
        core's projections. `rotary`: the core's `apply_rotary(query, key, cos, sin)`."""
        return None

    def project(self, attention: Any, key: Any, value: Any, padding_mask: Any) -> tuple[Any, Any, Any]:
        """(B, H_kv, S, D) keys/values and the (B, S) padding mask (or None) -> the keys/values and mask the scores
        see."""
        return key, value, padding_mask

    def attend(self, attention: Any, query: Any, key: Any, value: Any, mask: Any, cache: Any, plan: Any) -> Any:
        """(B, H, T, D) queries, keys/values with their heads repeated to H, the mask after `project` (the (B, S)
        padding mask for the types that take it), the layer's cache (or None) and its `forward_plan.LayerPlan` (what
        else the stack decided: output_attentions, ...) -> (B, T, H, D); None to leave the scores to the backend."""
        return None

    def probabilities(self, attention: Any, query: Any, key: Any, plan: Any) -> Any:
        """(B, H, T, D) queries, (B, H, S, D) keys, the layer's plan -> (B, H, T, S); None for a softmax over the
        plan's eager-form mask."""
        return None

    def combine(self, attention: Any, output: Any) -> Any:
        """(B, T, H, D_v) attention output -> the (B, T, H, D) heads `o_proj` reads; unchanged by default."""
        return output
