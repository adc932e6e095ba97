"""Block-local attention ("block" layers): the sequence cut into blocks of b tokens, a query sees only its own block.

    positions   0 1 2 3 | 4 5 6 7 | 8 9          (b = 4; the last block may be short)
    mask          [■■■■]                          query q sees key k iff q // b == k // b
                          [■■■■]                  (and k <= q when causal)
                                    [■■]

Not a sliding configuration: a band is the same around every query, a block is not (token 3 sees 0..3, token 4 only
itself). Blocks count from the first position of the row, as the mask overlay (`layer_types.block_overlay`) does.

`block_attention` computes it in O(L·b): the (B, H, L, D) tokens regrouped as (B·L/b, H, b, D), dense attention in
each block through sdpa.
"""

import torch
from torch import nn


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
        documents: (B, L) document ids of a packed row, or None: a key of another document is hidden within a block,
            as the dense path's document mask hides it (blocks still count from the row's start).

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
    blocks = padded // block_size

    def regroup(states: torch.Tensor) -> torch.Tensor:  # (B, H, L, D) -> (B·L/b, H, b, D)
        states = states.view(batch, heads, blocks, block_size, head_dim).transpose(1, 2)  # (B, L/b, H, b, D)
        return states.reshape(batch * blocks, heads, block_size, head_dim)

    allowed = valid.view(batch * blocks, 1, 1, block_size).expand(-1, 1, block_size, -1)  # (B·L/b, 1, b, b)
    if documents is not None:
        ids = nn.functional.pad(documents, (0, padded - length), value=-1).view(batch * blocks, 1, block_size)
        allowed = allowed & (ids[..., :, None] == ids[..., None, :])  # (B·L/b, 1, b, b): same document
    if causal:
        allowed = allowed & torch.ones(block_size, block_size, dtype=torch.bool, device=query.device).tril()
    diagonal = torch.eye(block_size, dtype=torch.bool, device=query.device)
    allowed = allowed | (diagonal & ~allowed.any(dim=-1, keepdim=True))
    output = nn.functional.scaled_dot_product_attention(
        regroup(query), regroup(key), regroup(value), attn_mask=allowed, dropout_p=dropout, scale=scaling
    )  # (B·L/b, H, b, D)
    output = output.view(batch, blocks, heads, block_size, head_dim).transpose(2, 3)  # (B, L/b, b, H, D)
    return output.reshape(batch, padded, heads, head_dim)[:, :length]
