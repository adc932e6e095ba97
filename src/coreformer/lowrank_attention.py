"""Low-rank attention ("lowrank" layers): Linformer (Wang et al. 2020), keys and values projected along the sequence.

    keys/values (B, H, S, D) --E, F: (k, S)--> (B, H, k, D)     softmax over k projected rows, O(L·k)

E and F have one column per position up to `max_position_embeddings` and are cut to the first S columns. The
projection mixes all positions, so the type is bidirectional only and never cached (`layer_types.py`).
"""

import torch
from torch import nn

from .layer_kernel import LayerKernel


class LowRankKernel(LayerKernel):
    """Linformer's E and F (eq. 7), as `k_seq_proj` / `v_seq_proj` of the attention module (checkpoint keys)."""

    def build(self, attention: nn.Module) -> None:
        config = attention.config
        attention.k_seq_proj = nn.Linear(config.max_position_embeddings, config.lowrank_k, bias=False)
        attention.v_seq_proj = nn.Linear(config.max_position_embeddings, config.lowrank_k, bias=False)

    def project(
        self, attention: nn.Module, key: torch.Tensor, value: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(B, H, S, D) keys/values -> (B, H, k, D); the projected rows mix all (real) positions: nothing left to
        mask."""
        length = key.shape[2]
        if padding_mask is not None:
            keep = padding_mask[:, None, :, None].to(key.dtype)  # padded positions must not leak into the rows
            key, value = key * keep, value * keep
        project_k = attention.k_seq_proj.weight[:, :length].to(key.dtype)  # (k, S)
        project_v = attention.v_seq_proj.weight[:, :length].to(value.dtype)
        return project_k @ key, project_v @ value, None  # (B, H, k, D)
