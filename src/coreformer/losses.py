"""Token-level cross-entropy for the language-model heads, without a full fp32 copy of the logits.

causal_lm_loss         next-token loss (labels shifted inside), the decoder's LM head
token_loss             loss per position as given (masked LM, seq2seq targets)
TokenCrossEntropy      the autograd function both use: log-sum-exp in fp32, one block of rows at a time
fused_causal_lm_loss   the same losses from the final hidden states and the vocabulary projection's weight and
fused_token_loss       bias, never forming the (tokens, vocab) logits (the heads' `skip_logits=True`, training)
LinearCrossEntropy     the autograd function both use: projection + loss a chunk of rows at a time, backward
                       recomputing each chunk's logits
labelled_rows          the rows that take a loss: the fused loss projects only those
next_token_targets, position_targets   the target of each position (labels shifted, or as given)
CAUSAL_LM_LOSS, TOKEN_LOSS   each head's (loss from logits, targets), which `language_model_outputs` reads

transformers' `ForCausalLMLoss` / `ForMaskedLMLoss` up-cast the whole (tokens, vocab) logits to fp32 before
`cross_entropy`, so a bf16 step holds the bf16 logits, their fp32 copy and fp32 log-probabilities, and writes an fp32
gradient it then casts back. Here the logits stay in their own dtype; each block of rows is up-cast in turn (small
enough to stay in cache), so the loss is the same fp32 computation (same log-sum-exp, same picked logit) and the
gradient, softmax minus one-hot, is formed in fp32 per block and stored once in the logits' dtype. Reductions follow
transformers: mean over the non-ignored targets, or sum / `num_items_in_batch` when the Trainer passes it.

The fused form goes one step further, as Liger-Kernel's fused linear cross-entropy does (Hsu et al. 2024): even in
the logits' own dtype, (tokens, vocab) logits and their gradient are the largest tensors of a small model's step
(2048 x 50,257 bf16: 206 MB each), so the projection is multiplied out one chunk of rows at a time inside the loss.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

# Rows per block: about 1 MiB of fp32 fits a CPU core's L2 (measured at 2048 x 8192 bf16, one thread, loss +
# backward: 68 ms at 1 MiB, 92 ms at 4 MiB, 214 ms in one block); on a GPU larger blocks only bound the transient
# fp32 memory (a Python loop of many small kernels would cost more than it saves).
_BLOCK_BYTES = {"cpu": 2**20}
_DEFAULT_BLOCK_BYTES = 256 * 2**20


def _rows_per_block(logits: torch.Tensor) -> int:
    budget = _BLOCK_BYTES.get(logits.device.type, _DEFAULT_BLOCK_BYTES)
    return max(1, budget // (4 * logits.shape[-1]))


def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) logits of any float dtype -> (N,) fp32 log-sum-exp, up-cast one cache-sized block of rows at a time."""
    result = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    rows = _rows_per_block(logits)
    for start in range(0, logits.shape[0], rows):
        result[start : start + rows] = torch.logsumexp(logits[start : start + rows].float(), dim=-1)
    return result


def logits_gradient(
    logits: torch.Tensor, targets: torch.Tensor, log_normalizer: torch.Tensor, row_scale: torch.Tensor
) -> torch.Tensor:
    """row_scale * (softmax(logits) - onehot(targets)): (N, V) in the logits' dtype, formed in fp32 one cache-sized
    block of rows at a time. row_scale: (N, 1) fp32, the gradient of each row's loss (0 on ignored rows)."""
    grad_logits = torch.empty_like(logits)
    rows = _rows_per_block(logits)
    for start in range(0, logits.shape[0], rows):
        block = slice(start, start + rows)
        probabilities = torch.exp(logits[block].float() - log_normalizer[block, None])
        block_targets = targets[block, None]  # (rows, 1)
        probabilities.scatter_add_(1, block_targets, probabilities.new_full(block_targets.shape, -1.0))
        grad_logits[block] = probabilities.mul_(row_scale[block])
    return grad_logits


class TokenCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of (N, V) logits of any float dtype against (N,) targets; ignored rows give 0."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        valid = targets != ignore_index
        targets = targets.masked_fill(~valid, 0)
        normalizer = log_normalizer(logits)
        target_logits = logits.gather(1, targets[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, targets, valid, normalizer)
        return (normalizer - target_logits) * valid

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, valid, normalizer = ctx.saved_tensors
        # d loss_i / d logits_i = grad_i * (softmax(logits_i) - onehot(target_i)), zero on ignored rows.
        row_scale = (grad_losses.float() * valid)[:, None]  # (N, 1)
        return logits_gradient(logits, targets, normalizer, row_scale), None, None


def token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    **kwargs,
) -> torch.Tensor:
    """logits: (..., vocab); labels: (...) target ids, `ignore_index` where no loss is taken."""
    labels = labels.to(logits.device).reshape(-1)
    losses = TokenCrossEntropy.apply(logits.reshape(-1, vocab_size), labels, ignore_index)  # (N,)
    return _token_mean(losses, labels, num_items_in_batch, ignore_index)


def _token_mean(
    losses: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None, ignore_index: int
) -> torch.Tensor:
    """transformers' reduction: the mean over non-ignored targets, or the sum over `num_items_in_batch`."""
    if num_items_in_batch is None:
        return losses.sum() / (labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(losses.device)
    return losses.sum() / num_items_in_batch


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """labels: (B, T) the input ids themselves; position t is scored against labels[:, t + 1] (or `shift_labels`)."""
    targets = next_token_targets(labels, ignore_index, shift_labels)
    return token_loss(logits, targets, vocab_size, ignore_index=ignore_index, **kwargs)


def next_token_targets(
    labels: torch.Tensor, ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **kwargs
) -> torch.Tensor:
    """(B, T) labels -> (B, T) the target of each position: labels[:, t + 1], `ignore_index` at the last position
    (or `shift_labels` as given)."""
    if shift_labels is not None:
        return shift_labels
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (B, T)


def position_targets(labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """(...) labels -> the same: each position is scored against its own label (masked LM, seq2seq)."""
    return labels


def labelled_rows(
    hidden_states: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that take a loss: (..., hidden) states and (...) targets -> (N, hidden) and (N,), N the targets not
    equal to `ignore_index`. A masked-LM batch labels ~15% of its positions, a padded seq2seq batch its real targets
    only: the vocabulary product of the other rows would be thrown away. Rows are copied out (a data-dependent shape:
    `torch.compile` breaks its graph here)."""
    targets = targets.to(hidden_states.device).reshape(-1)
    labelled = targets != ignore_index
    return hidden_states.reshape(-1, hidden_states.shape[-1])[labelled], targets[labelled]


# ---- the vocabulary projection fused with the loss ----

# Rows per chunk of the fused loss: the chunk's logits and their gradient, (rows, vocab) in the compute dtype, are the
# only vocabulary-sized tensors alive at once (the fp32 work on them goes in cache-sized blocks, as above). A budget
# of 32 MiB of fp32 (167 rows at vocabulary 50,257; 1,024 at 8,192) keeps the products large enough to run at the GEMM
# rate on a CPU; a GPU takes larger chunks for the same reason.
_CHUNK_BYTES = {"cpu": 32 * 2**20}
_DEFAULT_CHUNK_BYTES = 256 * 2**20


def _rows_per_chunk(rows: int, vocab_size: int, device: torch.device) -> int:
    budget = _CHUNK_BYTES.get(device.type, _DEFAULT_CHUNK_BYTES)
    return max(1, min(rows, budget // (4 * vocab_size)))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block: slice) -> torch.Tensor:
    """(rows, hidden) @ (vocab, hidden)ᵀ [+ bias] -> (rows, vocab), in the inputs' (compute) dtype."""
    return nn.functional.linear(hidden[block], weight, bias)


class LinearCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of `hidden @ weightᵀ + bias` against targets, a chunk of rows at a time.

        hidden (N, H) ──┐  chunk 0: rows 0..c      -> logits (c, V) -> log-sum-exp, target logit -> freed
                        ├─ chunk 1: rows c..2c     -> logits (c, V) -> ...
        weight (V, H) ──┘  ...
        backward: each chunk's logits are recomputed, softmax - one-hot formed in fp32 and stored in the compute
                  dtype, then grad_hidden[chunk] = g @ W and grad_W += gᵀ @ hidden[chunk] (accumulated in fp32).

    The full (N, V) logits never exist, forward or backward: the peak is one chunk. `compute_dtype` is the dtype the
    products run in (autocast's, decided by the caller); the inputs are cast to it here, so their gradients come back
    in their own dtypes. Ignored rows give a loss of 0 and no gradient.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        ignore_index: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        valid = targets != ignore_index
        targets = targets.masked_fill(~valid, 0)
        cast = (hidden.to(compute_dtype), weight.to(compute_dtype), None if bias is None else bias.to(compute_dtype))
        rows = _rows_per_chunk(hidden.shape[0], weight.shape[0], hidden.device)
        normalizer = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        target_logits = torch.empty_like(normalizer)
        for start in range(0, hidden.shape[0], rows):
            block = slice(start, start + rows)
            logits = _chunk_logits(*cast, block)  # (rows, V)
            normalizer[block] = log_normalizer(logits)
            target_logits[block] = logits.gather(1, targets[block, None]).squeeze(1).float()
        ctx.save_for_backward(hidden, weight, bias, targets, valid, normalizer)
        ctx.compute_dtype = compute_dtype
        return (normalizer - target_logits) * valid

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, valid, normalizer = ctx.saved_tensors
        cast_hidden, cast_weight = hidden.to(ctx.compute_dtype), weight.to(ctx.compute_dtype)
        cast_bias = None if bias is None else bias.to(ctx.compute_dtype)
        # d loss_i / d logits_i = grad_i * (softmax(logits_i) - onehot(target_i)), zero on ignored rows.
        row_scale = (grad_losses.float() * valid)[:, None]  # (N, 1)
        grad_hidden = torch.empty_like(cast_hidden) if ctx.needs_input_grad[0] else None
        grad_weight, grad_bias = None, None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, H)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)  # (V,)
        rows = _rows_per_chunk(hidden.shape[0], weight.shape[0], hidden.device)
        for start in range(0, hidden.shape[0], rows):
            block = slice(start, start + rows)
            logits = _chunk_logits(cast_hidden, cast_weight, cast_bias, block)  # (rows, V), recomputed
            grad_logits = logits_gradient(logits, targets[block], normalizer[block], row_scale[block])  # (rows, V)
            if grad_hidden is not None:
                grad_hidden[block] = grad_logits @ cast_weight  # (rows, H)
            if grad_weight is not None:  # fp32 += the chunk's product in the compute dtype, converted on the fly
                grad_weight.add_(grad_logits.T @ cast_hidden[block])  # (V, H)
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0, dtype=torch.float32))
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def fused_token_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    **kwargs,
) -> torch.Tensor:
    """`token_loss(linear(hidden_states, weight, bias), labels)` without the (..., vocab) logits.

    hidden_states: (..., hidden) what the vocabulary projection reads; weight: (vocab, hidden); bias: (vocab,) or
    None; labels: (...) target ids. Only the labelled rows are projected (`labelled_rows`). Under autocast the
    products run in autocast's dtype, as `nn.Linear` would.
    """
    rows, targets = labelled_rows(hidden_states, labels, ignore_index)  # (N, hidden), (N,)
    device_type = hidden_states.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden_states.dtype
    with torch.autocast(device_type, enabled=False):  # the dtype is decided above; the function casts explicitly
        losses = LinearCrossEntropy.apply(rows, weight, bias, targets, ignore_index, compute_dtype)  # (N,)
    return _token_mean(losses, targets, num_items_in_batch, ignore_index)


def fused_causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """`causal_lm_loss` from the hidden states (B, T, hidden) and the projection, without the logits."""
    targets = next_token_targets(labels, ignore_index, shift_labels)
    return fused_token_loss(hidden_states, weight, bias, targets, ignore_index=ignore_index, **kwargs)


class LanguageModelLoss(NamedTuple):
    """One head's loss: from the logits (`skip_logits=False`), and the target of each position, from which
    `language_model_outputs` picks the labelled rows for the fused loss (`skip_logits=True`)."""

    from_logits: Callable[..., torch.Tensor]  # (logits, labels, vocab_size=..., **kwargs)
    targets: Callable[..., torch.Tensor]  # (labels, **kwargs) -> (B, T) the target of each position


CAUSAL_LM_LOSS = LanguageModelLoss(causal_lm_loss, next_token_targets)  # labels shifted inside (decoder)
TOKEN_LOSS = LanguageModelLoss(token_loss, position_targets)  # labels per position (masked LM, seq2seq)
