"""Building blocks around the attention core: norms, the MLP, position embeddings and the residual `Block`.

A `Block` is self-attention, optional cross-attention and an MLP, each a residual branch whose norm sits before the
branch (pre-norm, GPT-2) or after the residual sum (post-norm, BERT/BART):

    pre:  x = x + dropout(f(norm(x)))        post: x = norm(x + dropout(f(x)))

The stacks that assemble blocks live in `modeling_base.py`.
"""

import math

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import Attention
from .configuration_coreformer import CoreformerConfig
from .forward_plan import ForwardPlan

# Activations that transformers writes out elementwise in Python, each mapped to the one fused kernel computing the
# same formula (max difference 2.4e-7 in fp32): GPT-2's tanh-approximate GELU is ~3x faster fused, forward+backward.
FUSED_ACTIVATIONS = {"gelu_new": "gelu_pytorch_tanh", "gelu_fast": "gelu_pytorch_tanh"}


def build_activation(name: str) -> nn.Module:
    """The `ACT2FN` activation `name`, as its fused equivalent where one exists."""
    return ACT2FN[FUSED_ACTIVATIONS.get(name, name)]


def build_norm(config: CoreformerConfig) -> nn.Module:
    """The configured norm over the hidden size: `nn.LayerNorm` (with a bias unless `norm_bias=False`) or
    `nn.RMSNorm`."""
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)


class MLP(nn.Module):
    """Position-wise feed-forward: down(act(up(x))), or down(act(gate(x)) * up(x)) when gated (SwiGLU)."""

    def __init__(self, config: CoreformerConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.gate_proj = (
            nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias) if config.gated_mlp else None
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = build_activation(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act_fn(self.up_proj(hidden_states)))
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """Fixed sinusoids of "Attention Is All You Need" (sec. 3.5): row p = [sin(p·ω_i), cos(p·ω_i)] interleaved."""
    position = torch.arange(num_positions, dtype=torch.float32)[:, None]
    frequencies = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(num_positions, dim)
    table[:, 0::2] = torch.sin(position * frequencies)
    table[:, 1::2] = torch.cos(position * frequencies[: dim // 2])
    return table


class SinusoidalPositions(nn.Module):
    """Adds no parameters: looks position ids up in a fixed sinusoid table.

    The table is a non-persistent buffer, so `_init_weights` recomputes it (models are built on the meta device).
    """

    def __init__(self, config: CoreformerConfig):
        super().__init__()
        self.num_positions = config.max_position_embeddings
        self.dim = config.hidden_size
        self.register_buffer("table", sinusoidal_table(self.num_positions, self.dim), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.table[position_ids]  # (B, T, hidden)


class RotaryEmbedding(nn.Module):
    """(cos, sin) of rotary positions (RoFormer, Su et al. 2021), computed once per forward for every layer.

    `inv_freq` is a non-persistent buffer: `_init_weights` recomputes it, otherwise a model built on the meta device
    would load with garbage frequencies and no warning.
    """

    def __init__(self, config: CoreformerConfig, theta: float | None = None):
        super().__init__()
        self.rotary_dim = int(config.head_dim * config.partial_rotary_factor)  # the first channels of each head
        self.theta = config.rope_theta if theta is None else theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim))

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in fp32: positions beyond a few thousand lose their low bits in bf16.
        angles = position_ids[..., None].float() * self.inv_freq.float()  # (B, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (B, T, D)
        return angles.cos().to(hidden_states.dtype), angles.sin().to(hidden_states.dtype)


class Block(GradientCheckpointingLayer):
    """Self-attention, optional cross-attention, MLP; each a residual branch with a pre- or post-norm.

    `attention_norm=False` replaces the self-attention norm with `nn.Identity` (ModernBERT's first layer, whose
    attention reads the normalised embeddings); the stack decides it from `config.first_layer_attention_norm`.
    """

    def __init__(
        self,
        config: CoreformerConfig,
        layer_idx: int,
        *,
        is_causal: bool,
        cross_attention: bool = False,
        layer_type: str = "full",
        attention_norm: bool = True,
    ):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.layer_type = layer_type
        self.self_attn = Attention(config, layer_idx, is_causal=is_causal, layer_type=layer_type)
        self.self_attn_norm = build_norm(config) if attention_norm else nn.Identity()
        self.cross_attn = (
            Attention(config, layer_idx, is_causal=False, is_cross_attention=True) if cross_attention else None
        )
        self.cross_attn_norm = build_norm(config) if cross_attention else None
        self.mlp = MLP(config)
        self.mlp_norm = build_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def _residual(
        self, hidden_states: torch.Tensor, norm: nn.Module, branch: nn.Module, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply one residual branch (pre- or post-norm); an attention branch returns (output, weights), the MLP its
        output alone (weights None)."""
        output = branch(norm(hidden_states) if self.pre_norm else hidden_states, **kwargs)
        output, weights = output if isinstance(output, tuple) else (output, None)
        hidden_states = hidden_states + self.dropout(output)
        return (hidden_states if self.pre_norm else norm(hidden_states)), weights

    def forward(
        self,
        hidden_states: torch.Tensor,
        plan: ForwardPlan,
        encoder_hidden_states: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns the new hidden states and the self- and cross-attention probabilities (or None).

        Args:
            hidden_states: (B, T, hidden), or the (N, hidden) real tokens of a padded batch when the plan unpads and
                the stack does not record hidden states (`ForwardPlan.padded_states`: then padded in and out, and
                unpadded only inside, so that the recorded states are the ones the computation uses).
            plan: what the stack decided once for this forward; this block reads its layer type's entry.
            encoder_hidden_states: (B, S, hidden), the keys/values of cross-attention.
        """
        unpadding = plan.unpadding if plan.padded_states else None
        if unpadding is not None:
            hidden_states = unpadding.unpad(hidden_states)  # (B, T, hidden) -> (N, hidden)
        hidden_states, self_weights = self._residual(
            hidden_states,
            self.self_attn_norm,
            self.self_attn,
            plan=plan.layers[self.layer_type],
            past_key_values=past_key_values,
            **kwargs,
        )
        cross_weights = None
        if self.cross_attn is not None:
            hidden_states, cross_weights = self._residual(
                hidden_states,
                self.cross_attn_norm,
                self.cross_attn,
                plan=plan.cross,
                key_value_states=encoder_hidden_states,
                past_key_values=past_key_values,
                **kwargs,
            )
        hidden_states, _ = self._residual(hidden_states, self.mlp_norm, self.mlp)
        if unpadding is not None:
            hidden_states = unpadding.pad(hidden_states)  # (N, hidden) -> (B, T, hidden)
        return hidden_states, self_weights, cross_weights
