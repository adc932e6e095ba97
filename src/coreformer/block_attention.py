"""Block-local attention ("block" layers): the sequence cut into blocks of b tokens, a query sees only its own block.

    positions   0 1 2 3 | 4 5 6 7 | 8 9          (b = 4; the last block may be short)
    mask          [■■■■]                          query q sees key k iff q // b == k // b
                          [■■■■]                  (and k <= q when causal)
                                    [■■]

Not a sliding configuration: a band is the same around every query, a block is not (token 3 sees 0..3, token 4 only
itself). Blocks count from the first position of each document: the row's start, and on packed rows (several
documents end to end) each document's own start, so that a document gets the blocks it gets alone:

    row          a0 a1 a2 a3 a4 a5 | b0 b1 b2 b3 b4 | c0 c1          (b = 4; documents of 6, 5 and 2)
    blocks        1  1  1  1  2  2    3  3  3  3  4    5  5          `document_blocks`: restart at each document
    row chunks   [a0 a1 a2 a3][a4 a5 b0 b1][b2 b3 b4 c0][c1 . . .]   a block spans at most two chunks

    document_blocks       (B, L) document ids -> (B, L) block ids (the overlay's and the kernel's)
    block_attention       the O(L·b) kernel:
        one document per row: the (B, H, L, D) tokens regrouped as (B·L/b, H, b, D), dense attention in each block
        packed rows: each row chunk of b queries against the chunk before and its own (and the one after, when
            bidirectional), masked to the same block id: (B·L/b, H, b, w·b), w = 2 or 3, still O(L·b)
"""

import torch
from torch import nn


def document_blocks(documents: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, L) document ids -> (B, L) block ids, a new block at every document start and every `block_size` tokens
    into a document: equal ids mean the same block of the same document."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    in_document = index - torch.where(starts, index, 0).cummax(-1).values  # (B, L): 0 at each document start
    return (starts | (in_document % block_size == 0)).cumsum(-1)


def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    block_size: int,
    causal: bool,
    padding_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense attention within each block of `block_size` tokens; equal to the dense block mask on real tokens.

    Args:
        query, key, value: (B, H, L, D) (key/value heads already repeated). Any L (padded inside to whole blocks).
        padding_mask: (B, L), True for real tokens, or None. A query that sees no real key (padding) attends to
            itself, so that no row is empty.
        documents: (B, L) document ids of a packed row, or None: blocks then restart at each document's first token
            (`document_blocks`), exactly as each document alone counts them.

    Returns:
        (B, L, H, D)
    """
    batch, heads, length, head_dim = query.shape
    padded = -(-length // block_size) * block_size
    valid = torch.ones(batch, length, dtype=torch.bool, device=query.device)
    if padding_mask is not None:
        valid = padding_mask.bool()
    if padded != length:
        query, key, value = (nn.functional.pad(states, (0, 0, 0, padded - length)) for states in (query, key, value))
        valid = nn.functional.pad(valid, (0, padded - length), value=False)
    chunks = padded // block_size

    def regroup(states: torch.Tensor) -> torch.Tensor:  # (B, H, L, D) -> (B·L/b, H, b, D)
        states = states.view(batch, heads, chunks, block_size, head_dim).transpose(1, 2)  # (B, L/b, H, b, D)
        return states.reshape(batch * chunks, heads, block_size, head_dim)

    if documents is None:
        keys, values = regroup(key), regroup(value)
        allowed = valid.view(batch * chunks, 1, 1, block_size).expand(-1, 1, block_size, -1)  # (B·L/b, 1, b, b)
        if causal:
            allowed = allowed & torch.ones(block_size, block_size, dtype=torch.bool, device=query.device).tril()
        own = torch.eye(block_size, dtype=torch.bool, device=query.device)  # (b, b): each query's own slot
    else:
        block_ids = nn.functional.pad(document_blocks(documents, block_size), (0, padded - length), value=-1)
        keys, values, allowed, own = _around_chunks(regroup(key), regroup(value), block_ids, valid, block_size, causal)
    allowed = allowed | (own & ~allowed.any(dim=-1, keepdim=True))
    output = nn.functional.scaled_dot_product_attention(
        regroup(query), keys, values, attn_mask=allowed, dropout_p=dropout, scale=scaling
    )  # (B·L/b, H, b, D)
    output = output.view(batch, chunks, heads, block_size, head_dim).transpose(2, 3)  # (B, L/b, b, H, D)
    return output.reshape(batch, padded, heads, head_dim)[:, :length]


def _around_chunks(
    keys: torch.Tensor,
    values: torch.Tensor,
    block_ids: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows: each chunk's keys/values (B·C, H, b, D) widened to the chunk before and its own (and the one
    after, when bidirectional), (B·C, H, w·b, D); the (B·C, 1, b, w·b) mask of keys in the query's block (block ids
    (B, L'), -1 at the tail) and real; and the (b, w·b) slot of each query's own key. A block of b tokens starting
    anywhere spans at most two chunks, so no key of a query's block is left out."""
    chunks = block_ids.shape[1] // block_size
    batch = block_ids.shape[0]

    def around(states: torch.Tensor, fill) -> torch.Tensor:  # (B, C, b, ...) -> (B, C, w·b, ...), not circular
        before = nn.functional.pad(states, (0, 0) * (states.dim() - 2) + (1, 0), value=fill)[:, :-1]
        after = nn.functional.pad(states, (0, 0) * (states.dim() - 2) + (0, 1), value=fill)[:, 1:]
        return torch.cat([before, states] if causal else [before, states, after], dim=2)

    def widened(states: torch.Tensor) -> torch.Tensor:  # (B·C, H, b, D) -> (B·C, H, w·b, D)
        heads, head_dim = states.shape[1], states.shape[-1]
        by_chunk = states.view(batch, chunks, heads, block_size, head_dim).transpose(2, 3)  # (B, C, b, H, D)
        wide = around(by_chunk, 0.0)  # (B, C, w·b, H, D)
        return wide.transpose(2, 3).reshape(batch * chunks, heads, -1, head_dim)

    query_ids = block_ids.view(batch, chunks, block_size)  # (B, C, b)
    # -2 for padding and beyond the row: no query's id (the tail's queries are -1, and see only themselves).
    key_ids = around(query_ids.masked_fill(~valid.view(batch, chunks, block_size), -2), -2)  # (B, C, w·b)
    allowed = query_ids[..., :, None] == key_ids[..., None, :]  # (B, C, b, w·b)
    offsets = torch.arange(block_size, device=block_ids.device)
    slots = torch.arange(key_ids.shape[-1], device=block_ids.device) - block_size  # key slot - query slot 0
    if causal:
        allowed = allowed & (slots[None, :] <= offsets[:, None])
    own = slots[None, :] == offsets[:, None]  # (b, w·b)
    return widened(keys), widened(values), allowed.view(batch * chunks, 1, block_size, -1), own
