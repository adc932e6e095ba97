"""Token-level cross-entropy for the language-model heads, without a full fp32 copy of the logits.

causal_lm_loss         next-token loss (labels shifted inside), the decoder's LM head
token_loss             loss per position as given (masked LM, seq2seq targets)
TokenCrossEntropy      the autograd function both use: log-sum-exp in fp32, one block of rows at a time
fused_causal_lm_loss   the same losses from the final hidden states and the vocabulary projection's weight and
fused_token_loss       bias, never forming the (tokens, vocab) logits (the heads' `skip_logits=True`, training)
LinearCrossEntropy     the autograd function both use: projection + loss + gradients a chunk of rows at a time
labelled_rows          the rows that take a loss: the fused loss projects only those
linear_cross_entropy   the fused loss of rows that all have a target (what the heads call after their transform)
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
(2048 x 50,257 bf16: 206 MB each), so the projection is multiplied out one chunk of rows at a time inside the loss,
and only for the rows that have a target. Each chunk's gradients are formed right away, so the step runs the same
three vocabulary products as the unfused loss (a backward recomputing the logits ran four: 1.51x the unfused loss's
time at vocabulary 50,257; now 0.89x, one thread, measured under load from other jobs).
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


def losses_and_gradient_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy, (N,) fp32, and its gradient softmax - onehot(targets) written over the (N, V)
    logits in their own dtype: one fp32 pass per cache-sized block of rows (up-cast once, exponentials once)."""
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    rows = _rows_per_block(logits)
    for start in range(0, logits.shape[0], rows):
        block = slice(start, start + rows)
        block_targets = targets[block, None]  # (rows, 1)
        values = logits[block].float()  # (rows, V)
        target_logits = values.gather(1, block_targets)
        largest = values.amax(1, keepdim=True)
        exponentials = values.sub_(largest).exp_()  # exp(x - max), in place of the fp32 copy
        sums = exponentials.sum(1, keepdim=True)
        losses[block] = (largest + sums.log() - target_logits).squeeze(1)  # log-sum-exp - target logit
        probabilities = exponentials.div_(sums)
        probabilities.scatter_add_(1, block_targets, probabilities.new_full(block_targets.shape, -1.0))
        logits[block] = probabilities
    return losses


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

# Rows per chunk of the fused loss: the chunk's logits, overwritten by their gradient, (rows, vocab) in the compute
# dtype, are the only vocabulary-sized tensor alive at once (the fp32 work on them goes in cache-sized blocks, as
# above). A budget of 32 MiB of fp32 (167 rows at vocabulary 50,257; 1,024 at 8,192) keeps the products large enough
# to run at the GEMM rate on a CPU (128 MiB was no faster: 0.90x the unfused loss against 0.89x, under load); a GPU
# takes larger chunks for the same reason.
_CHUNK_BYTES = {"cpu": 32 * 2**20}
_DEFAULT_CHUNK_BYTES = 256 * 2**20


def _rows_per_chunk(rows: int, vocab_size: int, device: torch.device) -> int:
    budget = _CHUNK_BYTES.get(device.type, _DEFAULT_CHUNK_BYTES)
    return max(1, min(rows, budget // (4 * vocab_size)))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block: slice) -> torch.Tensor:
    """(rows, hidden) @ (vocab, hidden)ᵀ [+ bias] -> (rows, vocab), in the inputs' (compute) dtype."""
    return nn.functional.linear(hidden[block], weight, bias)


# Rows per slice when a compute-dtype product is added into an fp32 sum: on CPU a mixed-dtype `add_` takes torch's
# unvectorized promotion path (a (50,257 x 384) bf16 -> fp32 add_: 125 ms; up-cast then add: 35 ms, one thread), and
# up-casting the whole product at once would hold a second (V, H) fp32 tensor; GPUs promote inside the kernel.
_ACCUMULATE_BYTES = {"cpu": 4 * 2**20}


def _accumulate_(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part for an fp32 `total` and a `part` in the compute dtype, a few MiB of rows at a time on CPU."""
    budget = _ACCUMULATE_BYTES.get(total.device.type)
    if budget is None:
        total.add_(part)
        return
    rows = max(1, budget // (4 * total[0].numel()))
    for start in range(0, total.shape[0], rows):
        total[start : start + rows].add_(part[start : start + rows].float())


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weightᵀ + bias` against targets, a chunk of rows at a time, the gradients
    formed in the same pass (Liger-Kernel's fused linear cross-entropy, Hsu et al. 2024).

        hidden (N, H) ──┐  chunk 0: rows 0..c  -> logits (c, V) -> log-sum-exp, target logit
                        │                      -> g = softmax - one-hot (in place of the logits, fp32 per block)
                        │                      -> grad_hidden[chunk] = g @ W, grad_W += gᵀ @ hidden[chunk] -> freed
        weight (V, H) ──┘  chunk 1: rows c..2c -> ...
        backward: the gradients above times the incoming scalar.

    The full (N, V) logits never exist: the peak is one chunk, plus the (V, H) fp32 weight gradient, which a
    backward would hold at the same point of the step (the loss is the last op of the forward). Three vocabulary
    products per chunk, as the unfused loss runs (a backward that recomputed each chunk's logits ran four).
    `compute_dtype` is the dtype the products run in (autocast's, decided by the caller); the inputs are cast to it
    here, and their gradients come back in their own dtypes. Every row must have a target (`labelled_rows`).
    `with_gradients` False (evaluation, no grad) runs the loss alone.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        compute_dtype: torch.dtype,
        with_gradients: bool,
    ) -> torch.Tensor:
        cast_hidden, cast_weight = hidden.to(compute_dtype), weight.to(compute_dtype)
        cast_bias = None if bias is None else bias.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden) if with_gradients else None  # (N, H)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_gradients else None
        grad_bias = None
        if with_gradients and bias is not None:
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)  # (V,)
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,), summed once below
        rows = _rows_per_chunk(hidden.shape[0], weight.shape[0], hidden.device)
        for start in range(0, hidden.shape[0], rows):
            block = slice(start, start + rows)
            logits = _chunk_logits(cast_hidden, cast_weight, cast_bias, block)  # (rows, V)
            if not with_gradients:
                normalizer = log_normalizer(logits)  # (rows,) fp32
                losses[block] = normalizer - logits.gather(1, targets[block, None]).squeeze(1).float()
                continue
            losses[block] = losses_and_gradient_(logits, targets[block])
            grad_logits = logits  # (rows, V): overwritten by softmax - one-hot
            grad_hidden[block] = grad_logits @ cast_weight  # (rows, H)
            _accumulate_(grad_weight, grad_logits.T @ cast_hidden[block])  # (V, H): fp32 += compute-dtype product
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0, dtype=torch.float32))
        ctx.gradients = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.gradients is None:
            raise RuntimeError(
                "The fused loss formed its gradients in the forward pass and handed them out on the first backward: "
                "a second backward through it (retain_graph=True) is not supported. Compute the loss again."
            )
        # d (scale * loss) / d x = scale * d loss / d x: the gradients of the forward pass, scaled in place once.
        grads = tuple(
            None if grad is None or not needed else grad.mul_(grad_total).to(dtype)
            for grad, needed, dtype in zip(ctx.gradients, ctx.needs_input_grad, ctx.dtypes)
        )
        ctx.gradients = None
        return (*grads, None, None, None)


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
    return linear_cross_entropy(rows, weight, bias, targets, num_items_in_batch)


def linear_cross_entropy(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """The token mean of `LinearCrossEntropy` over rows that all have a target: (N, hidden) rows, (N,) targets, as
    `labelled_rows` returns them (the heads gather the rows before their transform, then call this)."""
    device_type = rows.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else rows.dtype
    leaves = (rows, weight) if bias is None else (rows, weight, bias)
    with_gradients = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in leaves)
    with torch.autocast(device_type, enabled=False):  # the dtype is decided above; the function casts explicitly
        total = LinearCrossEntropy.apply(rows, weight, bias, targets, compute_dtype, with_gradients)  # ()
    if num_items_in_batch is None:
        return total / targets.shape[0]
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


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
