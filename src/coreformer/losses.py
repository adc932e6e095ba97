"""Token-level cross-entropy for the language-model heads, without a full fp32 copy of the logits.

causal_lm_loss       next-token loss (labels shifted inside), the decoder's LM head
token_loss           loss per position as given (masked LM, seq2seq targets)
TokenCrossEntropy    the autograd function both use: log-sum-exp in fp32, one block of rows at a time

transformers' `ForCausalLMLoss` / `ForMaskedLMLoss` up-cast the whole (tokens, vocab) logits to fp32 before
`cross_entropy`, so a bf16 step holds the bf16 logits, their fp32 copy and fp32 log-probabilities, and writes an fp32
gradient it then casts back. Here the logits stay in their own dtype; each block of rows is up-cast in turn (small
enough to stay in cache), so the loss is the same fp32 computation (same log-sum-exp, same picked logit) and the
gradient, softmax minus one-hot, is formed in fp32 per block and stored once in the logits' dtype. Reductions follow
transformers: mean over the non-ignored targets, or sum / `num_items_in_batch` when the Trainer passes it.
"""

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


class TokenCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of (N, V) logits of any float dtype against (N,) targets; ignored rows give 0."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        valid = targets != ignore_index
        targets = targets.masked_fill(~valid, 0)
        log_normalizer = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        rows = _rows_per_block(logits)
        for start in range(0, logits.shape[0], rows):
            log_normalizer[start : start + rows] = torch.logsumexp(logits[start : start + rows].float(), dim=-1)
        target_logits = logits.gather(1, targets[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, targets, valid, log_normalizer)
        return (log_normalizer - target_logits) * valid

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, valid, log_normalizer = ctx.saved_tensors
        # d loss_i / d logits_i = grad_i * (softmax(logits_i) - onehot(target_i)), zero on ignored rows.
        row_scale = (grad_losses.float() * valid)[:, None]  # (N, 1)
        grad_logits = torch.empty_like(logits)
        rows = _rows_per_block(logits)
        for start in range(0, logits.shape[0], rows):
            block = slice(start, start + rows)
            probabilities = torch.exp(logits[block].float() - log_normalizer[block, None])
            block_targets = targets[block, None]  # (rows, 1)
            probabilities.scatter_add_(1, block_targets, probabilities.new_full(block_targets.shape, -1.0))
            grad_logits[block] = probabilities.mul_(row_scale[block])
        return grad_logits, None, None


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
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (B, T)
    return token_loss(logits, shift_labels, vocab_size, ignore_index=ignore_index, **kwargs)
