"""LSH attention (Reformer, Kitaev et al. 2020): each query attends to the nearby keys that hash into its bucket.

    draw_rotations        the random rotations of one layer, (H, D, n_hashes, n_buckets / 2), from a seeded generator
    hash_buckets          angular LSH (Andoni et al. 2015): argmax over [xR, -xR], (B, H, L, D) -> (B, H, n, L)
    length_normalized     the shared-QK keys: each query scaled to unit root-mean-square (Reformer's `_len_norm`)
    lsh_attention         the O(L log L) kernel: sort by bucket, chunk, attend, unsort, join the rounds
    lsh_visible_mask      the same pattern as a dense (B, H, T, S) mask: cached decoding, attention maps, references
    HashingProjection     the shared query-key projection (the layer's `q_proj`): what it computes is hashed
    LshKernel             the "lsh" layer type: rotations as a buffer, the kernel, cached decoding, probabilities

Queries and keys share one projection (Reformer sec. 3): a key is its query, length-normalised, so a token's query
and key fall into the same bucket. Per hash round, the keys a query sees are the tokens of its own bucket at most
`bucket_size` places away in bucket order (earlier tokens only when causal); a token sees itself only when it sees
nothing else (Reformer's self mask). The rounds are joined by log-sum-exp into one softmax over the union of the
keys they reach, each key counted once.

    per round r:     buckets          3 1 0 3 1 1 0 3            (position 0..7, pads in an extra last bucket)
                        | stable sort by (bucket, position)
                     sorted           0:2 0:6 1:1 1:4 1:5 3:0 3:3 3:7       bucket:position
                        | chunks of c = bucket_size
                     chunks           [2 6 1 4] [5 0 3 7]
                        | each chunk's queries against its keys: the chunk before and its own
                        |   (and the one after, when bidirectional), masked to the same bucket and fewer
                        |   than c places apart in sorted order (and to earlier positions, when causal)
                     out_r, lse_r     per sorted query: softmax output and log-sum-exp of its scores
                        | unsort (the inverse permutation)
    join rounds:     out = sum_r softmax_r(lse_r) * out_r, with a key reached in N rounds scored -log N in each
                     (Reformer sec. 3, "multi-round LSH attention"), so the union is counted once

Within one bucket, sorted order is position order, so "fewer than c places apart" counts the tokens of that bucket
between query and key. A query's keys therefore depend only on the tokens up to it (when causal) and never on padding:
later tokens cannot change earlier outputs, cached decoding reproduces the full forward, and padding changes nothing.
transformers' `LSHSelfAttention` instead attends to everything in the chunk and the one before, whatever its bucket,
reaching across a chunk boundary into whatever sorted there (later tokens and padding move those boundaries);
`reformer_compatible=True` computes that pattern, for comparison with it.

Packed rows (several documents end to end, `documents` (B, L) ids): a token's bucket id also names its round and its
document (by the document's first position), so the sort is by (round, document, bucket, position) and "the same
bucket" is the same bucket of the same document. Each document then sorts into a run of its own, in which it is hashed,
sorted and chunked exactly as alone; a chunk's reach into its neighbour meets other documents only as other buckets.

    row      a0 a1 a2 a3 | b0 b1 b2          buckets  1 0 1 1 | 0 1 0
    sorted   a1 | a0 a2 a3 | b0 b2 | b1      (document, bucket): (a,0) | (a,1) | (b,0) | (b,1)

Time O(n·L·log L) (the sort) plus O(n·L·c·D); memory O(n·L·c).

A bucket is an argmax, so a small change to a hashed vector moves its token to another bucket and changes which keys
it sees, not only by how much. What feeds the hash is therefore kept from coarse rounding by the model's declarations
(`CoreformerPreTrainedModel`): the rotations stay fp32 under any load dtype, and the query-key projection is never
quantized (under torchao int8, a tiny "lsh" decoder with an int8 `q_proj` kept 77% of its fp32 top-1 tokens where the
same model with full layers kept 95%; with its `q_proj` unquantized, 95%) and stays fp32 under fp16 loads (under bf16
it computes in the model's dtype, as every other layer does).
"""

from functools import partial

import torch
from torch import nn
from transformers import initialization as init

from .layer_kernel import LayerKernel

# Reformer's fp32 mask values (`LSHSelfAttention.mask_value_float32`, `self_mask_value_float32`): finite, so that a
# query whose only key is itself keeps it (weight 1), and any other visible key outweighs it completely.
MASKED_SCORE = -1e9
SELF_SCORE = -1e5


def draw_rotations(num_heads: int, head_dim: int, num_hashes: int, num_buckets: int, seed: int) -> torch.Tensor:
    """Gaussian random rotations (H, D, n_hashes, n_buckets / 2), fp32, from a CPU generator seeded with `seed`: the
    same numbers on every device, and the global random generator untouched."""
    if num_buckets < 2 or num_buckets % 2:
        raise ValueError(f"LSH needs an even number of buckets (at least 2), got {num_buckets}.")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(num_heads, head_dim, num_hashes, num_buckets // 2, generator=generator)


def hash_buckets(
    vectors: torch.Tensor, rotations: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Angular LSH (Andoni et al. 2015; Reformer sec. 3): h(x) = argmax([xR; -xR]) for each round's rotation R.

    Args:
        vectors: (B, H, L, D) (keys; their direction is what is hashed).
        rotations: (H, D, n_hashes, n_buckets / 2).
        padding_mask: (B, L), True (nonzero) for real tokens; padding goes to an extra bucket, n_buckets.

    Returns:
        (B, H, n_hashes, L) bucket ids in [0, n_buckets]; no gradient.
    """
    with torch.no_grad():
        # fp32 whatever the compute dtype, so that a bucket does not flip with the rounding of a bf16 product.
        rotated = torch.einsum("bhld,hdnr->bhnlr", vectors.float(), rotations.float())  # (B, H, n, L, n_buckets/2)
        buckets = torch.cat([rotated, -rotated], dim=-1).argmax(dim=-1)  # (B, H, n, L)
        if padding_mask is not None:
            pad_bucket = 2 * rotations.shape[-1]
            buckets = buckets.masked_fill(~padding_mask.bool()[:, None, None, :], pad_bucket)
    return buckets


def length_normalized(query: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The shared-QK key of each query: scaled to unit root-mean-square over the head dimension (Reformer's
    `_len_norm`; with scaling 1/sqrt(D), a score is then |q| cos(q, k))."""
    variance = query.float().pow(2).mean(-1, keepdim=True)
    return (query.float() * torch.rsqrt(variance + eps)).to(query.dtype)


def _look_around(chunks: torch.Tensor, after: bool) -> torch.Tensor:
    """(B, H, C, c, ...) -> (B, H, C, w·c, ...): each chunk preceded by the chunk before it (and followed by the one
    after); circular, as Reformer's `_look_adjacent` (the first chunk's "before" is the last)."""
    parts = [chunks.roll(1, dims=2), chunks] + ([chunks.roll(-1, dims=2)] if after else [])
    return torch.cat(parts, dim=3)


def _round_tables(buckets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each round by (bucket, position): (B, H, n, L) buckets -> `order` (B, H, n, L), the position at each
    sorted place, and `place` (B, H, n, L), the flat sorted index r·L + s of each round's copy of each position."""
    rounds, length = buckets.shape[2:]
    positions = torch.arange(length, device=buckets.device)
    # A unique key per token (position breaks ties), so the sort is stable whatever sort torch uses.
    order = (buckets * length + positions).argsort(dim=-1)  # (B, H, n, L)
    sorted_places = torch.arange(rounds * length, device=buckets.device).view(rounds, length).expand_as(order)
    place = torch.empty_like(order).scatter_(-1, order, sorted_places)  # inverse permutation, offset by round
    return order, place


def _duplicate_counts(
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    buckets: torch.Tensor,
    place: torch.Tensor,
    bucket_size: int,
    causal: bool,
) -> torch.Tensor:
    """N_ij: in how many rounds key j is in query i's window, for each (query slot, key slot) of the chunks.
    query_pos (B, H, C, c) and key_pos (B, H, C, w·c) positions; buckets, place (B, H, n, L) -> (B, H, C, c, w·c)."""
    counts = torch.zeros(*key_pos.shape[:3], query_pos.shape[-1], key_pos.shape[-1], device=key_pos.device)
    batch, heads = query_pos.shape[:2]
    for round_idx in range(buckets.shape[2]):
        table = torch.stack([buckets[:, :, round_idx], place[:, :, round_idx]], dim=-1)  # (B, H, L, 2)
        q = table.gather(2, query_pos.reshape(batch, heads, -1, 1).expand(-1, -1, -1, 2)).view(*query_pos.shape, 2)
        k = table.gather(2, key_pos.reshape(batch, heads, -1, 1).expand(-1, -1, -1, 2)).view(*key_pos.shape, 2)
        same = q[..., :, None, 0] == k[..., None, :, 0]
        distance = q[..., :, None, 1] - k[..., None, :, 1]
        near = (distance >= 0) & (distance < bucket_size) if causal else distance.abs() < bucket_size
        counts += same & near
    return counts


def lsh_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    buckets: torch.Tensor,
    *,
    num_buckets: int,
    bucket_size: int,
    causal: bool,
    padding_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    reformer_compatible: bool = False,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """LSH attention over sorted chunks, in O(n·L·c) memory: equal to dense attention under `lsh_visible_mask`.

    Args:
        query: (B, H, L, D); key, value: (B, H, L, D) (the keys normally `length_normalized(query)`).
        buckets: (B, H, n_hashes, L) from `hash_buckets` (ids in [0, num_buckets]; num_buckets is padding's).
        bucket_size: c, the chunk length: per round a query sees the keys of its bucket fewer than c places away.
        padding_mask: (B, L), True for real tokens, or None. Any L works (padded inside to a multiple of c).
        reformer_compatible: compute transformers' `LSHSelfAttention` pattern instead (every key of the chunk and
            the one before, circularly across rounds; duplicates not discounted); for comparisons only.
        documents: (B, L) document ids of a packed row, or None: sorted by (document, bucket, position), each
            document is hashed, sorted and chunked as if alone (a bucket is one document's).

    Returns:
        (B, L, H, D) in the query's dtype.
    """
    batch, heads, length = query.shape[:3]
    if reformer_compatible and documents is not None:
        raise ValueError("reformer_compatible=True is transformers' pattern over one sequence: pass documents=None.")
    query, key, value, buckets, valid = _padded_to_chunks(
        query, key, value, buckets, padding_mask, documents, num_buckets=num_buckets, bucket_size=bucket_size
    )
    rounds = buckets.shape[2]
    place, sorted_pos, chunk_pos, key_pos, allowed = _sorted_layout(
        buckets, valid, bucket_size=bucket_size, causal=causal, reformer_compatible=reformer_compatible
    )

    gather_sorted = partial(_gathered_sorted, sorted_pos=sorted_pos, bucket_size=bucket_size)
    dtype = torch.promote_types(query.dtype, torch.float32)  # scores, softmax and the join in fp32 at least
    keys = _look_around(gather_sorted(key), after=key_pos.shape[-1] > 2 * bucket_size)  # (B, H, C, w·c, D)
    values = _look_around(gather_sorted(value), after=key_pos.shape[-1] > 2 * bucket_size)
    scores = torch.matmul(gather_sorted(query).to(dtype), keys.to(dtype).transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, MASKED_SCORE)  # (B, H, C, c, w·c)
    if rounds > 1 and not reformer_compatible:
        with torch.no_grad():
            counts = _duplicate_counts(chunk_pos, key_pos, buckets, place, bucket_size, causal)
        scores = scores - counts.clamp_min(1).log()
    scores = scores.masked_fill(chunk_pos[..., :, None] == key_pos[..., None, :], SELF_SCORE)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, H, C, c, 1)
    # softmax, not exp(scores - lse): a query that sees only itself has an lse near SELF_SCORE, where fp32 steps by
    # 0.008, and exp(scores - lse) would then sum to 1 ± 0.008 (transformers' Reformer has that error).
    probs = nn.functional.dropout(torch.softmax(scores, dim=-1), p=dropout)
    out = torch.matmul(probs, values.to(dtype))  # (B, H, C, c, D)
    out = _joined_rounds(out, lse, place)[:, :, :length]  # (B, H, L, D)
    return out.transpose(1, 2).to(query.dtype)  # (B, L, H, D)


@torch.no_grad()
def _sorted_layout(
    buckets: torch.Tensor, valid: torch.Tensor, *, bucket_size: int, causal: bool, reformer_compatible: bool
) -> tuple[torch.Tensor, ...]:
    """Where each token sorts and what each chunk's queries may see, from the (B, H, n, L') bucket ids: `place`
    (B, H, n, L'), `sorted_pos` (B, H, n·L'), the position at each sorted place; its chunks `chunk_pos` (B, H, C, c);
    the positions of each chunk's key slots `key_pos` (B, H, C, w·c); `allowed` (B, H, C, c, w·c)."""
    batch, heads, rounds, padded = buckets.shape
    order, place = _round_tables(buckets)
    sorted_pos = order.reshape(batch, heads, rounds * padded)  # (B, H, n·L): position at each sorted place
    chunk_pos = sorted_pos.view(batch, heads, -1, bucket_size)  # (B, H, C, c), C = n·L / c
    key_pos = _look_around(chunk_pos, after=not causal and not reformer_compatible)  # (B, H, C, w·c)
    allowed = _allowed(chunk_pos, key_pos, buckets, order, valid, bucket_size, causal, reformer_compatible)
    return place, sorted_pos, chunk_pos, key_pos, allowed


def _gathered_sorted(states: torch.Tensor, *, sorted_pos: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """`states` (B, H, L', D) in sorted order, in chunks of `bucket_size`: (B, H, C, c, D); sorted_pos (B, H, n·L')."""
    batch, heads, _, head_dim = states.shape
    index = sorted_pos[..., None].expand(-1, -1, -1, head_dim)
    return states.gather(2, index).view(batch, heads, -1, bucket_size, head_dim)  # (B, H, C, c, D)


def _padded_to_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    buckets: torch.Tensor,
    padding_mask: torch.Tensor | None,
    documents: torch.Tensor | None,
    *,
    num_buckets: int,
    bucket_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, key, value, buckets, valid) padded to whole chunks of `bucket_size`, L -> L'; buckets (B, H, n, L')
    with padding in a bucket of its own and one id per (round, document, bucket), ordered so that sorting by
    (id, position) sorts by (round, document, bucket, position); valid (B, L'), True for real tokens. `documents`:
    (B, L) document ids of a packed row, or None for one document per row."""
    batch, _, length, _ = query.shape
    rounds = buckets.shape[2]
    padded = -(-length // bucket_size) * bucket_size
    valid = torch.ones(batch, length, dtype=torch.bool, device=query.device)
    if padding_mask is not None:
        valid = padding_mask.bool()
    if padded != length:  # pad to whole chunks; the extra tokens sort last, as padding, and are never keys
        extra = padded - length
        query, key, value = (nn.functional.pad(states, (0, 0, 0, extra)) for states in (query, key, value))
        valid = nn.functional.pad(valid, (0, extra), value=False)
        buckets = nn.functional.pad(buckets, (0, extra), value=num_buckets)
    # Padding in its own bucket whatever the caller hashed (it must not take places in a real bucket's order), and
    # the rounds and documents apart: an id per (round, document, bucket), a document named by its first position
    # (the padding to whole chunks is a document of its own), padding last in each document.
    buckets = buckets.masked_fill(~valid[:, None, None, :], num_buckets)
    starts = torch.zeros(batch, padded, dtype=buckets.dtype, device=buckets.device)
    if documents is not None:
        starts = _document_starts(documents, padded)
    rounds_apart = torch.arange(rounds, device=buckets.device).view(1, 1, rounds, 1) * padded
    buckets = buckets + (rounds_apart + starts[:, None, None, :]) * (num_buckets + 1)
    return query, key, value, buckets, valid


def _document_starts(documents: torch.Tensor, padded: int) -> torch.Tensor:
    """(B, L) document ids -> (B, L') the first position of each token's document; the L' - L positions that pad the
    row to whole chunks form one more document."""
    documents = torch.cat([documents, (documents[:, -1:] + 1).expand(-1, padded - documents.shape[1])], dim=1)
    index = torch.arange(padded, device=documents.device).expand_as(documents)
    new = torch.ones_like(documents, dtype=torch.bool)
    new[:, 1:] = documents[:, 1:] != documents[:, :-1]  # (B, L'): True at each document's first token
    return torch.where(new, index, 0).cummax(-1).values


def _joined_rounds(out: torch.Tensor, lse: torch.Tensor, place: torch.Tensor) -> torch.Tensor:
    """The rounds' outputs unsorted and joined, each weighted by its share of the total softmax mass.
    out (B, H, C, c, D), lse (B, H, C, c, 1), place (B, H, n, L') -> (B, H, L', D)."""
    batch, heads, rounds, padded = place.shape
    head_dim = out.shape[-1]
    # Unsort: each round's copy of each position, (B, H, n·L, ...) -> (B, H, n, L, ...).
    unsort = place.reshape(batch, heads, rounds * padded)
    out = out.view(batch, heads, -1, head_dim).gather(2, unsort[..., None].expand(-1, -1, -1, head_dim))
    out = out.view(batch, heads, rounds, padded, head_dim)
    lse = lse.view(batch, heads, -1).gather(2, unsort).view(batch, heads, rounds, padded)
    weights = torch.softmax(lse, dim=2)[..., None]  # (B, H, n, L, 1): exp(lse_r - lse) joins the rounds
    return (out * weights).sum(dim=2)  # (B, H, L', D)


def _allowed(
    chunk_pos: torch.Tensor,
    key_pos: torch.Tensor,
    buckets: torch.Tensor,
    order: torch.Tensor,
    valid: torch.Tensor,
    bucket_size: int,
    causal: bool,
    reformer_compatible: bool,
) -> torch.Tensor:
    """Which key slot each query slot of the chunks may see (before the self rule): (B, H, C, c, w·c)."""
    batch, heads, num_chunks = chunk_pos.shape[:3]
    valid_keys = valid[:, None, :].expand(batch, heads, -1).gather(2, key_pos.flatten(2)).view(key_pos.shape)
    allowed = valid_keys[..., None, :].expand(*chunk_pos.shape, key_pos.shape[-1])
    if causal:
        allowed = allowed & (chunk_pos[..., :, None] >= key_pos[..., None, :])
    if reformer_compatible:
        return allowed
    # The sorted place of each slot, unwrapped: a key slot from the chunk before the first (or after the last) is
    # out of range rather than the circular neighbour, so no query ever reaches across the ends.
    span = key_pos.shape[-1] // bucket_size
    query_place = torch.arange(num_chunks * bucket_size, device=key_pos.device).view(num_chunks, bucket_size)
    offsets = torch.arange(span * bucket_size, device=key_pos.device) - bucket_size
    key_place = query_place[:, :1] + offsets  # (C, w·c)
    distance = query_place[:, :, None] - key_place[:, None, :]  # (C, c, w·c)
    near = (distance >= 0) & (distance < bucket_size) if causal else distance.abs() < bucket_size
    near = near & (key_place >= 0)[:, None, :] & (key_place < num_chunks * bucket_size)[:, None, :]
    sorted_buckets = buckets.gather(-1, order)  # (B, H, n, L): the bucket at each sorted place
    sorted_buckets = sorted_buckets.view(batch, heads, num_chunks, bucket_size)  # (B, H, C, c)
    same = sorted_buckets[..., :, None] == _look_around(sorted_buckets, after=span > 2)[..., None, :]
    return allowed & same & near


def lsh_visible_mask(
    query_buckets: torch.Tensor,
    key_buckets: torch.Tensor,
    *,
    query_positions: torch.Tensor,
    bucket_size: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The keys each query sees under LSH attention, as a dense mask with the self rule applied: what `lsh_attention`
    computes equals dense softmax attention under this mask. O(n·T·S): for cached decoding and attention maps.

    Args:
        query_buckets: (B, H, n, T); key_buckets: (B, H, n, S), both from `hash_buckets` (the queries' buckets are
            those of their own keys).
        query_positions: (T,) each query's own index among the S keys (S - T + t when the last T keys are new).
        key_padding_mask: (B, S), True for real keys, or None.
        documents: (B, S) document ids of the keys of a packed row, or None: a query then ranks and sees the keys of
            its own document only, as that document alone.

    Returns:
        (B, H, T, S) boolean, True where the query attends.
    """
    keys = key_buckets.shape[-1]
    key_index = torch.arange(keys, device=key_buckets.device)
    candidates = torch.ones(1, 1, query_positions.shape[0], keys, dtype=torch.bool, device=key_buckets.device)
    if key_padding_mask is not None:
        candidates = candidates & key_padding_mask.bool()[:, None, None, :]
    if causal:
        candidates = candidates & (key_index <= query_positions[:, None])
    if documents is not None:
        candidates = candidates & (documents[:, None, query_positions, None] == documents[:, None, None, :])
    visible = torch.zeros((), dtype=torch.bool, device=key_buckets.device)
    for round_idx in range(key_buckets.shape[2]):
        same = candidates & (query_buckets[:, :, round_idx, :, None] == key_buckets[:, :, round_idx, None, :])
        # Place of each key in its bucket's order (a running count); the query's is that of its own key.
        rank = same.cumsum(dim=-1)  # (B, H, T, S)
        own = rank.gather(-1, query_positions.view(1, 1, -1, 1).expand(*rank.shape[:2], -1, 1))
        visible = visible | (same & ((own - rank).abs() < bucket_size))
    is_self = key_index == query_positions[:, None]  # (T, S)
    others = visible & ~is_self
    return others | (is_self & ~others.any(dim=-1, keepdim=True))


def _masked_softmax(query: torch.Tensor, key: torch.Tensor, visible: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax(Q Kᵀ · scaling) over the visible keys, in fp32: (B, H, T, D), (B, H, S, D), (B, H, T, S) -> (B, H, T, S).
    Every row has a visible key (`lsh_visible_mask` keeps the query itself where nothing else is)."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


class HashingProjection(nn.Linear):
    """The query-key projection of an "lsh" layer (its `q_proj`, same checkpoint keys): its output is hashed, so it
    is never quantized, and kept fp32 under fp16 loads (by name, from `post_init`). Computes in its own precision
    and returns the activations' dtype, so the rest of the layer is unchanged."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias=bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states.to(self.weight.dtype)).to(hidden_states.dtype)


class LshKernel(LayerKernel):
    """The "lsh" layer type (`layer_types.py`): shared query-key, rotations kept as `lsh_rotations`, the sorted-chunk
    kernel on uncached forwards and prefills, the dense form of the same pattern on cached decoding steps.

    The rotations are a persistent buffer, saved with the weights: the hash is part of the function, so a saved model
    hashes identically whatever device or torch version draws random numbers; `_init_weights` draws them for a new
    model (built on the meta device) from a generator seeded with `lsh_hash_seed + layer_idx`.
    """

    keeps_cache = True

    def build(self, attention: nn.Module) -> None:
        config = attention.config
        # Reformer's shared query-key: a token's key is its own query (length-normalised in `attend`), hashed.
        attention.k_proj = None
        query = attention.q_proj
        attention.q_proj = HashingProjection(query.in_features, query.out_features, bias=query.bias is not None)
        shape = (attention.num_heads, attention.head_dim, config.lsh_num_hashes, config.lsh_num_buckets // 2)
        # fp32 whatever the dtype the model is built in (a bf16 load keeps it so too: `_keep_in_fp32_modules_strict`).
        attention.register_buffer("lsh_rotations", torch.empty(shape, dtype=torch.float32))

    def init_weights(self, attention: nn.Module) -> None:
        config = attention.config
        heads, head_dim, rounds, half = attention.lsh_rotations.shape
        seed = config.lsh_hash_seed + attention.layer_idx
        init.copy_(attention.lsh_rotations, draw_rotations(heads, head_dim, rounds, 2 * half, seed))

    def attend(self, attention, query, key, value, padding_mask, cache, plan):
        """`key` is the (rotated) query itself (no key projection): normalised here into the shared key."""
        config = attention.config
        key = length_normalized(key)
        past = 0
        if cache is not None:
            # An int now: a static layer's length is a tensor that its own update advances in place.
            past = int(cache.get_seq_length(attention.layer_idx))
            if plan.output_attentions and past:
                raise ValueError(
                    "output_attentions=True on a cached decoding step of an 'lsh' layer is not supported: request "
                    "attentions on a forward without a cache (use_cache=False), or on the prefill only."
                )
            cached_key, cached_value = cache.update(key, value, attention.layer_idx)
        if not past:  # no earlier tokens: the sorted-chunk kernel over these tokens
            return lsh_attention(
                query,
                key,
                value,
                hash_buckets(key, attention.lsh_rotations, padding_mask),
                num_buckets=config.lsh_num_buckets,
                bucket_size=config.lsh_bucket_size,
                causal=attention.is_causal,
                padding_mask=padding_mask,
                scaling=attention.scaling,
                dropout=attention.attention_dropout if attention.training else 0.0,
                documents=plan.documents,
            )
        # A decoding step: the new queries against every cached key, under the pattern's dense form.
        positions = past + torch.arange(query.shape[2], device=query.device)
        visible = self._visible(attention, cached_key, positions, padding_mask)
        probs = _masked_softmax(query, cached_key, visible, attention.scaling)
        probs = nn.functional.dropout(probs, p=attention.attention_dropout, training=attention.training)
        return torch.matmul(probs, cached_value.float()).transpose(1, 2).to(query.dtype)  # (B, T, H, D)

    def probabilities(self, attention, query, key, plan):
        """The dense (B, H, T, T) probabilities of an uncached forward (or a prefill): `key` is the rotated query."""
        key = length_normalized(key)
        positions = torch.arange(query.shape[2], device=query.device)
        visible = self._visible(attention, key, positions, plan.mask, plan.documents)
        return _masked_softmax(query, key, visible, attention.scaling).to(query.dtype)

    @staticmethod
    def _visible(
        attention: nn.Module,
        keys: torch.Tensor,
        positions: torch.Tensor,
        padding_mask: torch.Tensor | None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The pattern for the queries at `positions` over all (B, H, S, D) `keys` (of the (B, S) `documents` of a
        packed row, or None): (B, H, T, S) boolean."""
        length = keys.shape[2]
        if padding_mask is not None and padding_mask.shape[-1] != length:
            # A static cache's buffer runs past the mask: those slots are empty (and later than every query).
            padding_mask = nn.functional.pad(padding_mask.bool(), (0, length - padding_mask.shape[-1]), value=False)
        buckets = hash_buckets(keys, attention.lsh_rotations, padding_mask)  # (B, H, n, S)
        return lsh_visible_mask(
            buckets[..., positions],
            buckets,
            query_positions=positions,
            bucket_size=attention.config.lsh_bucket_size,
            causal=attention.is_causal,
            key_padding_mask=padding_mask,
            documents=documents,
        )
