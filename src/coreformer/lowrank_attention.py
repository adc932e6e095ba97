"""Low-rank attention ("lowrank" layers): Linformer (Wang et al. 2020), keys and values projected along the sequence.

    keys/values (B, H, S, D) --E, F: (k, S)--> (B, H, k, D)     softmax over k projected rows, O(L·k)

E and F have one column per position up to `max_position_embeddings` and are cut to the first S columns. The
projection mixes all positions, so the type is bidirectional only and never cached (`layer_types.py`).

E and F are read as matrices, not called as layers, so they are plain parameters (`SequenceProjection`), not
`nn.Linear`s: quantizers (bitsandbytes, torchao) replace every linear layer and store its weight packed, which
`weight[:, :S]` would read as numbers -- silently wrong logits under bitsandbytes 8-bit. They stay fp32 under a
low-precision load by the model's declaration (`CoreformerPreTrainedModel._keep_in_fp32_modules_strict`).
"""

import torch
from torch import nn

from .layer_kernel import LayerKernel


class SequenceProjection(nn.Module):
    """One of Linformer's E, F: a (k, max_positions) `weight` (checkpoint key `<name>.weight`, as when it was an
    `nn.Linear`), fp32 whatever the dtype the model is built in. Not a layer: `LowRankKernel.project` cuts and
    applies it along the sequence. `_init_weights` draws it by its class: transformers initialises only the modules
    that hold parameters themselves, and the attention module holding this one holds none."""

    def __init__(self, max_positions: int, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rank, max_positions, dtype=torch.float32))


class LowRankKernel(LayerKernel):
    """Linformer's E and F (eq. 7), as `k_seq_proj` / `v_seq_proj` of the attention module (checkpoint keys)."""

    def build(self, attention: nn.Module) -> None:
        config = attention.config
        attention.k_seq_proj = SequenceProjection(config.max_position_embeddings, config.lowrank_k)
        attention.v_seq_proj = SequenceProjection(config.max_position_embeddings, config.lowrank_k)

    def project(
        self, attention: nn.Module, key: torch.Tensor, value: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(B, H, S, D) keys/values -> (B, H, k, D); the projected rows mix all (real) positions: nothing left to
        mask."""
        length = key.shape[2]
        if padding_mask is not None:
            keep = padding_mask[:, None, :, None].to(key.dtype)  # padded positions must not leak into the rows
            key, value = key * keep, value * keep
        # In E's precision (fp32) at least: a bf16 E would round the weights the declaration keeps in fp32.
        dtype = torch.promote_types(attention.k_seq_proj.weight.dtype, key.dtype)
        project_k = attention.k_seq_proj.weight[:, :length].to(dtype)  # (k, S)
        project_v = attention.v_seq_proj.weight[:, :length].to(dtype)
        projected_key = (project_k @ key.to(dtype)).to(key.dtype)  # (B, H, k, D)
        return projected_key, (project_v @ value.to(dtype)).to(value.dtype), None
