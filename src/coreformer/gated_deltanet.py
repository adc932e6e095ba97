"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025), a linear-attention layer with a delta rule and gates: its math and
its layer type ("gated_deltanet").

The layer keeps a (D_k, D_v) matrix per value head instead of keys and values. Each token decays it, corrects what
it stores for the token's key towards the token's value, and reads it with the query (`gated_delta_step`):

    S_t = a_t S_{t-1} + β_t k_t (v_t - a_t S_{t-1}ᵀ k_t)ᵀ        a_t = exp(g_t) ∈ (0, 1], β_t ∈ (0, 1)
    o_t = S_tᵀ q_t / √D_k

short_convolution   the causal depthwise convolution (+ SiLU) that q, k and v pass through first; its cache is the
                    last K - 1 inputs
gated_delta_rule    the chunked form for training and prefill, O(T) with matrix products inside chunks
gated_delta_step    the same recurrence token by token, for decoding from a state
l2_normalize, decay_and_beta, gated_rms_norm   the pieces around them in Qwen3-Next's `Qwen3NextGatedDeltaNet`
cached_states, store_states   read and write both states in transformers' own "linear_attention" cache layer
GatedDeltaNetKernel the "gated_deltanet" layer type: Qwen3.5's projections around the pieces above, the whole layer

Packed rows (`documents`) restart both the convolution and the delta rule at each document, so no document sees
another's tokens, exactly as if each were its own row:

    row        | a a a a a | b b b | c c c c c c |
    conv taps    <-3         <-3     <-3             taps reaching back past a document start read zero
    rule state   ---->       -->     ----->          the state is emptied where b and c start

The cache is transformers' `LinearAttentionLayer` (layer type "linear_attention" of `DYNAMIC_LAYER_TYPE_MAPPING`
and `STATIC_LAYER_TYPE_MAPPING`, in 5.16.1 as in 5.24), not a coreformer class: it already holds a conv state and a
recurrent state of fixed shape per layer, at static addresses (copied in place, so cudagraphs and a static cache
keep them), and `DynamicCache(config=...)`, `StaticCache(config=...)` and generate() build it from the layer type
alone. A layer declared "linear_attention" therefore decodes with a constant-size state and nothing here has to be
registered. What it does not do: count tokens (transformers asks an attention layer of the same cache for the
length) or take tokens back (`crop` cannot rewind a recurrent state, so assisted decoding is unavailable).
"""

from typing import Any

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from .layer_kernel import LayerKernel


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|² + eps) along the last dimension: Qwen3-Next's (and FLA's) normalisation of queries and keys, which
    keeps the delta rule's update S (I - β k kᵀ) a contraction."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token gates from the layer's projections (Qwen3-Next's `in_proj_ba`, `A_log`, `dt_bias`).

    The log decay is Mamba-2's discretisation g = -exp(A_log) · softplus(a + dt_bias) ≤ 0, in fp32 (exp(A_log) can
    overflow fp16); β = sigmoid(b) is the step size of the delta rule's correction.

    Args:
        a, b: (..., H_v) projections of the hidden states.
        a_log, dt_bias: (H_v,) per-head parameters.

    Returns:
        decay g (..., H_v) fp32 and beta (..., H_v).
    """
    decay = -a_log.float().exp() * nn.functional.softplus(a.float() + dt_bias)
    return decay, b.sigmoid()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of each head's output, scaled by `weight`, times SiLU(gate) (Qwen3-Next's `Qwen3NextRMSNormGated`,
    norm before gate). x, gate: (..., D_v); weight: (D_v,). Computed in fp32, returned in x's dtype."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * nn.functional.silu(gate.float())).to(x.dtype)


def short_convolution(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    state: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution over time, then SiLU: each channel of token t mixes the inputs t-K+1 … t.

    Written as K shifted multiply-adds rather than `conv1d`, so that one form serves whole sequences, decoding from
    a state (T = 1) and packed rows, where a tap whose input lies before the token's document start reads zero.

    Args:
        hidden_states: (B, T, C) inputs (q, k and v side by side in Qwen3-Next).
        weight: (C, K) taps, `conv1d.weight[:, 0]` of a depthwise `nn.Conv1d`; tap K-1 reads the token itself.
        bias: (C,) or None.
        state: (B, C, W) the inputs before these (zeros before the first token), W ≥ K-1; its last K-1 are used. With
            `documents`, they belong to the row's first document.
        documents: (B, T) document ids of packed rows, or None.

    Returns:
        output (B, T, C) in the input's dtype, and the new state (B, C, K-1): the last K-1 inputs, zero where they
        belong to an earlier document than the row's last.
    """
    batch, length, channels = hidden_states.shape
    past = weight.shape[-1] - 1  # the inputs before the token that its window reaches
    inputs = hidden_states.transpose(1, 2)  # (B, C, T)
    if state is None:
        state = inputs.new_zeros(batch, channels, past)
    padded = torch.cat([state[..., state.shape[-1] - past :].to(inputs.dtype), inputs], dim=-1)  # (B, C, K-1+T)
    if documents is not None:
        # The state's inputs count as the first document's, as `gated_delta_rule` treats its state.
        padded_documents = torch.cat([documents[:, :1].expand(batch, past), documents], dim=1)  # (B, K-1+T)
    wide = padded.float()  # K products summed: accumulate in fp32 whatever the compute dtype
    output = torch.zeros_like(wide[..., past:]) if bias is None else bias.float()[None, :, None].expand_as(inputs)
    for lag in range(past + 1):
        tap = wide[..., past - lag : past - lag + length]  # (B, C, T): the input `lag` tokens before each token
        if documents is not None and lag:
            same = padded_documents[:, past - lag : past - lag + length] == documents  # (B, T)
            tap = tap * same[:, None, :]
        output = output + weight[:, past - lag, None].float() * tap
    new_state = padded[..., length:]  # (B, C, K-1)
    if documents is not None:
        new_state = new_state * (padded_documents[:, length:] == documents[:, -1:])[:, None, :]
    return nn.functional.silu(output).to(hidden_states.dtype).transpose(1, 2), new_state  # (B, T, C)


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a whole sequence, chunk by chunk (Yang et al. 2025, sec. 3.3; the WY form of DeltaNet,
    Yang et al. 2024, sec. 3.2), in fp32.

    Inside a chunk of C tokens starting from state S₀, with γ_i = exp(g_1 + … + g_i) the decay since the chunk began
    and Γ_ij = γ_i / γ_j, the corrections u_i = β_i (v_i - S'_iᵀ k_i) solve one unit lower triangular system,

        (I + A) U = β V - β γ K S₀              A_ij = β_i Γ_ij k_i·k_j   (j < i)

    after which the outputs and the state the next chunk starts from are matrix products:

        O = (γ Q) S₀ + (Q Kᵀ ⊙ Γ, j ≤ i) U      S_C = γ_C S₀ + (Γ_Cj k_j)ᵀ U

    so the only sequential loop is over chunks. Packed rows mask the same terms: pairs (i, j) of different documents
    drop out of A and Q Kᵀ, a token reads S₀ only while its document continues the state's, and the state passed on
    holds the chunk's last document alone (plus S₀, where that document began earlier).

    Value heads may outnumber key heads (H_v a multiple of H_k): each query/key head serves H_v / H_k consecutive
    value heads, as in Qwen3-Next.

    Args:
        query, key: (B, H_k, T, D_k), normalised by the caller (`l2_normalize`); queries are scaled by 1/√D_k here.
        value: (B, H_v, T, D_v).
        decay: (B, H_v, T) log decays g ≤ 0; beta: (B, H_v, T).
        state: (B, H_v, D_k, D_v) from earlier tokens, or None for zeros. With `documents`, the row's first document's.
        chunk_size: tokens per chunk; any T (the last chunk is padded with tokens that change nothing).
        documents: (B, T) document ids of packed rows, or None.

    Returns:
        output (B, T, H_v, D_v) in the value's dtype, and the state after the row's last token (B, H_v, D_k, D_v),
        fp32: that of the last document alone when rows are packed.
    """
    batch, value_heads, length, value_dim = value.shape
    dtype = value.dtype
    query, key = (x.repeat_interleave(value_heads // x.shape[1], dim=1) for x in (query, key))  # (B, H_v, T, D_k)
    query = query.float() * query.shape[-1] ** -0.5
    key, value, decay, beta = key.float(), value.float(), decay.float(), beta.float()
    state = value.new_zeros(batch, value_heads, key.shape[-1], value_dim) if state is None else state.float()

    # Padding tokens have k = v = β = g = 0: no correction, no decay, so the state passes them unchanged.
    pad = -length % chunk_size
    chunks = (length + pad) // chunk_size
    query, key, value = (_in_chunks(x, pad, chunks) for x in (query, key, value))  # (B, H, N, C, D)
    decay, beta = (_in_chunks(x[..., None], pad, chunks)[..., 0] for x in (decay, beta))  # (B, H, N, C)

    # Everything inside the chunks at once; log decays are subtracted before exp so nothing overflows.
    log_gamma = decay.cumsum(-1)  # (B, H, N, C)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=value.device).tril()  # (C, C): j ≤ i
    pair_log_decay = log_gamma[..., :, None] - log_gamma[..., None, :]  # (B, H, N, C, C): log Γ_ij
    pair_decay = pair_log_decay.masked_fill(~lower, float("-inf")).exp()  # Γ_ij for j ≤ i, else 0
    if documents is not None:
        documents = torch.cat([documents, documents[:, -1:].expand(batch, pad)], dim=1)  # padding joins the last
        documents = documents.reshape(batch, 1, chunks, chunk_size)  # (B, 1, N, C)
        pair_decay = pair_decay * (documents[..., :, None] == documents[..., None, :])
    key_beta = key * beta[..., None]
    strictly_lower = (key_beta @ key.transpose(-1, -2)) * pair_decay.tril(-1)  # (B, H, N, C, C): A
    system = strictly_lower + torch.eye(chunk_size, device=value.device)
    new_values = torch.linalg.solve_triangular(system, value * beta[..., None], upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(  # U = new_values - state_keys S₀
        system, key_beta * log_gamma.exp()[..., None], upper=False, unitriangular=True
    )
    within = (query @ key.transpose(-1, -2)) * pair_decay  # (B, H, N, C, C)
    query_reads = query * log_gamma.exp()[..., None]  # γ_i q_i: the query's read of S₀
    key_writes = key * (log_gamma[..., -1:] - log_gamma).exp()[..., None]  # Γ_Cj k_j: a key's write to S_C
    chunk_decay = log_gamma[..., -1].exp()  # (B, H, N): γ_C
    outputs, state = _across_chunks(
        state, new_values, state_keys, within, query_reads, key_writes, chunk_decay, documents
    )  # (B, H, N, C, D_v)
    output = outputs.flatten(2, 3)[:, :, :length]  # (B, H, N, C, D_v) -> (B, H, T, D_v)
    return output.transpose(1, 2).to(dtype), state  # (B, T, H_v, D_v)


def _across_chunks(
    state: torch.Tensor,
    new_values: torch.Tensor,
    state_keys: torch.Tensor,
    within: torch.Tensor,
    query_reads: torch.Tensor,
    key_writes: torch.Tensor,
    chunk_decay: torch.Tensor,
    documents: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one sequential part of `gated_delta_rule`: chunk after chunk, its outputs from the state it starts from,
    then the state it passes on (the terms are the docstring's, per chunk on dim 2; `documents` (B, 1, N, C) or
    None). Returns the outputs (B, H, N, C, D_v) and the final state."""
    outputs = []
    current = documents[:, :, 0, 0] if documents is not None else None  # (B, 1): the document the state holds
    for n in range(new_values.shape[2]):
        reads, corrections, writes, carried = query_reads[:, :, n], state_keys[:, :, n], key_writes[:, :, n], 1.0
        if documents is not None:
            chunk = documents[:, :, n]  # (B, 1, C)
            continues = (chunk == current[..., None])[..., None]  # (B, 1, C, 1): this token's document holds S₀
            reads, corrections = reads * continues, corrections * continues
            last = chunk[..., -1]  # (B, 1)
            writes = writes * (chunk == last[..., None])[..., None]  # only the last document's keys pass on
            carried = (last == current)[..., None, None]  # (B, 1, 1, 1): S₀ is the last document's too
            current = last
        corrected = new_values[:, :, n] - corrections @ state  # (B, H, C, D_v): U
        outputs.append(reads @ state + within[:, :, n] @ corrected)
        state = state * (chunk_decay[:, :, n, None, None] * carried) + writes.transpose(-1, -2) @ corrected
    return torch.stack(outputs, dim=2), state


def _in_chunks(x: torch.Tensor, pad: int, chunks: int) -> torch.Tensor:
    """(B, H, T, D) -> (B, H, N, C, D): `pad` zero tokens appended, then cut into `chunks` chunks."""
    padded = nn.functional.pad(x, (0, 0, 0, pad))  # (B, H, T + pad, D)
    return padded.reshape(*x.shape[:2], chunks, padded.shape[2] // chunks, x.shape[-1])  # sized: B may be 0


def gated_delta_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (the recurrence of the module docstring), for decoding, where T is 1: no
    padding to a chunk and no triangular solve. Same arguments and results as `gated_delta_rule`, without chunks or
    documents; any T works, one token after another."""
    batch, value_heads, length, value_dim = value.shape
    dtype = value.dtype
    query, key = (x.repeat_interleave(value_heads // x.shape[1], dim=1) for x in (query, key))  # (B, H_v, T, D_k)
    query = query.float() * query.shape[-1] ** -0.5
    key, value, decay, beta = key.float(), value.float(), decay.float(), beta.float()
    state = value.new_zeros(batch, value_heads, key.shape[-1], value_dim) if state is None else state.float()
    outputs = []
    for t in range(length):
        k = key[:, :, t, :, None]  # (B, H, D_k, 1)
        state = state * decay[:, :, t, None, None].exp()
        correction = beta[:, :, t, None] * (value[:, :, t] - (state * k).sum(-2))  # (B, H, D_v)
        state = state + k * correction[:, :, None, :]
        outputs.append((state * query[:, :, t, :, None]).sum(-2))  # (B, H, D_v)
    return torch.stack(outputs, dim=1).to(dtype), state  # (B, T, H_v, D_v)


def cached_states(layer: object) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The conv state (B, C, W) and recurrent state (B, H_v, D_k, D_v) a transformers `LinearAttentionLayer` holds
    for this layer, or (None, None) before its first forward (also after `reset`, which zeroes them in place).

    Reads the layer's own attributes, which 5.16.1 and 5.24 share (`Cache.get_conv_state` came after 5.16.1)."""
    if not layer.has_previous_state[0]:
        return None, None
    return layer.conv_states[0], layer.recurrent_states[0]


def store_states(layer: object, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
    """Write the states after a forward (as `short_convolution` and `gated_delta_rule` return them) into a
    transformers `LinearAttentionLayer`.

    The conv state is handed over as this forward's "inputs" with the layer's width set to its own, K-1: the layer
    keeps the last K-1 of what it already holds followed by them, which is the new state itself (while recording its
    past for assisted decoding it keeps the concatenation, and `cached_states`' readers use the last K-1). Both are
    copied into buffers allocated once, so their addresses stay static."""
    layer.update_conv_state(conv_state, 0, conv_kernel_size=conv_state.shape[-1])
    layer.update_recurrent_state(recurrent_state, 0)


class GatedRMSNorm(nn.Module):
    """The per-head output norm of a Gated DeltaNet layer, gated by SiLU(z) (`gated_rms_norm`); checkpoint key
    `norm.weight`, as Qwen3-Next's `Qwen3NextRMSNormGated`."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNetKernel(LayerKernel):
    """The "gated_deltanet" layer type: the whole token mixer of a layer (`mix`), laid out as Qwen3.5's
    `Qwen3_5GatedDeltaNet` (Qwen3-Next's with its projections split):

        x ──in_proj_qkv──> [ q (H_k·D_k) | k (H_k·D_k) | v (H_v·D_v) ] ──conv1d (short_convolution)──> q, k, v
        x ──in_proj_z──> z (H_v·D_v)      x ──in_proj_b──> b (H_v)      x ──in_proj_a──> a (H_v)
        o = gated_delta_rule(l2(q), l2(k), v, decay_and_beta(a, b, A_log, dt_bias))
        out = o_proj( norm(o, gate=z) )

    The cache layer is transformers' own `LinearAttentionLayer` (layer type "linear_attention"), holding the conv
    state and the (H_v, D_k, D_v) state per sequence. Padded tokens are zeroed before the projections (as Qwen3-Next
    masks its padding), so that with left padding both states stay zero until a sequence's first real token.
    """

    # H_v rows each, whose outputs become the decay's exponent and the delta rule's step: their rounding would compound
    # through the recurrence (and bitsandbytes' CPU 4-bit kernel cannot pack so few rows).
    unquantized = ("in_proj_a", "in_proj_b")

    def build(self, attention: nn.Module) -> None:
        config = attention.config
        sizes = config.gated_deltanet_sizes()
        attention.key_heads, attention.value_heads = sizes["key_heads"], sizes["value_heads"]
        attention.key_dim, attention.value_dim = sizes["key_dim"], sizes["value_dim"]
        hidden = config.hidden_size
        keys, values = sizes["key_heads"] * sizes["key_dim"], sizes["value_heads"] * sizes["value_dim"]
        # The attention's projections and norms are not this layer's: the options of the config's attention layers
        # (qk_norm, attention_gate, as Qwen3-Next's full layers have them) leave it alone.
        attention.q_proj = attention.k_proj = attention.v_proj = attention.q_norm = attention.k_norm = None
        attention.gate_width = 0
        channels = 2 * keys + values
        attention.in_proj_qkv = nn.Linear(hidden, channels, bias=False)
        attention.in_proj_z = nn.Linear(hidden, values, bias=False)
        attention.in_proj_b = nn.Linear(hidden, sizes["value_heads"], bias=False)
        attention.in_proj_a = nn.Linear(hidden, sizes["value_heads"], bias=False)
        kernel_size = config.linear_conv_kernel_dim
        # A depthwise convolution, as Qwen3-Next's `conv1d` (its checkpoint key and shape); `short_convolution` reads
        # its taps.
        attention.conv1d = nn.Conv1d(
            channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=False
        )
        attention.dt_bias = nn.Parameter(torch.empty(sizes["value_heads"]))
        attention.A_log = nn.Parameter(torch.empty(sizes["value_heads"]))
        attention.norm = GatedRMSNorm(sizes["value_dim"], eps=config.layer_norm_eps)
        attention.o_proj = nn.Linear(values, hidden, bias=False)

    def init_weights(self, attention: nn.Module) -> None:
        # As Qwen3-Next draws them: per-head decay rates A in (0, 16) (A_log their logs), unit dt biases.
        init.copy_(attention.A_log, torch.empty_like(attention.A_log).uniform_(0, 16).log())
        init.ones_(attention.dt_bias)
        # torch's own Conv1d draw, U(±1/√K), as FLA's short convolution keeps it: transformers' default for a
        # convolution, N(0, initializer_range), would scale q, k and v down about twentyfold through K taps.
        bound = attention.conv1d.weight.shape[-1] ** -0.5
        init.uniform_(attention.conv1d.weight, -bound, bound)

    def mix(self, attention: nn.Module, hidden_states: torch.Tensor, plan: Any, cache: Any) -> torch.Tensor:
        hidden = plan.unpadding.pad(hidden_states) if plan.unpadding is not None else hidden_states  # (B, T, hidden)
        length = hidden.shape[1]
        if plan.mask is not None:  # the (B, past + T) padding mask
            hidden = hidden * plan.mask[:, -length:, None].to(hidden.dtype)
        layer = state_layer(cache, attention.layer_idx)
        conv_state, state = cached_states(layer) if layer is not None else (None, None)
        mixed, conv_state = short_convolution(
            attention.in_proj_qkv(hidden), attention.conv1d.weight[:, 0], state=conv_state, documents=plan.documents
        )  # (B, T, 2·H_k·D_k + H_v·D_v)
        keys = attention.key_heads * attention.key_dim
        query, key, value = mixed.split((keys, keys, mixed.shape[-1] - 2 * keys), dim=-1)
        query, key = (l2_normalize(x.unflatten(-1, (-1, attention.key_dim)).transpose(1, 2)) for x in (query, key))
        value = value.unflatten(-1, (-1, attention.value_dim)).transpose(1, 2)  # (B, H_v, T, D_v)
        decay, beta = decay_and_beta(
            attention.in_proj_a(hidden), attention.in_proj_b(hidden), attention.A_log, attention.dt_bias
        )  # (B, T, H_v) each
        decay, beta = decay.transpose(1, 2), beta.transpose(1, 2)  # (B, H_v, T)
        if length == 1:  # a decoding step: the recurrence itself, no chunk to pad
            output, state = gated_delta_step(query, key, value, decay, beta, state=state)
        else:
            output, state = gated_delta_rule(query, key, value, decay, beta, state=state, documents=plan.documents)
        if layer is not None:
            store_states(layer, conv_state, state)
        gate = attention.in_proj_z(hidden).unflatten(-1, (-1, attention.value_dim))  # (B, T, H_v, D_v)
        output = attention.o_proj(attention.norm(output, gate).flatten(-2))  # (B, T, hidden)
        return plan.unpadding.unpad(output) if plan.unpadding is not None else output


def state_layer(cache: Any, layer_idx: int) -> Any:
    """The cache layer of a "gated_deltanet" layer (transformers' linear-attention layer), or None without a cache;
    one clear error for a cache laid out for another model."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx] if len(cache.layers) > layer_idx else None
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        raise ValueError(
            "This layer is Gated DeltaNet, which caches a convolution state and a recurrent state in transformers' "
            "'linear_attention' cache layer: build the cache from the config (DynamicCache(config=model.config) or "
            "StaticCache(config=model.config, ...)) or let generate() do it."
        )
    return layer
