"""Sparse attention kernels: "sliding" (band) and "strided" (Sparse Transformer) layers without an L x L matrix.

    sliding_window_attention   each query sees the keys at most w positions away      O(L·w)
    strided_attention          ... less than s away (A1) and every s-th key (A2)      O(L·(s + L/s))

Both cut the work into dense pieces and join them exactly:

    BandChunks       queries in chunks of c, each with the c + w (c + 2w bidirectional) keys its band reaches,
                     overlapping windows of one token stream (views, no copy):

                         stream   |··········|··········|··········|
                         chunk j            [====c====]
                         its keys      [-w-][====c====][-w-]

    ResidueClasses   tokens regrouped by position mod s, (B, T) -> (B, s, T/s): A2 is dense attention in a class.

Packed rows (several documents end to end, `documents` (B, T) ids beside the row ids) keep the same cost: a key of
another document is masked inside the band and inside the class, as a key of another row already is:

    row      | a a a a a | b b b b b b b b b |
    band       [-w-][q]                          q = b1 sees b0 and itself, never the a's inside its window

On CPU without attention dropout both go through torch's fused flash kernels (`_FusedSparseAttention`), which keep
for backward only what full attention under sdpa keeps; elsewhere through sdpa (or written out) and autograd.
`SparseKernel` binds one of them to its layer type (`layer_types.py`, the table of layer types); the forward plan
decides once per forward whether each layer runs it (`forward_plan.py`), and `Attention` calls it.
"""

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from .layer_kernel import LayerKernel


class _OverlappingWindows(torch.autograd.Function):
    """Windows of `span` rows every `step` rows of a (S, H, D) stream, as one strided view (no copy):
    (S, H, D) -> (count, H, span, D).

    The backward adds the windows' gradients back with `_fold_windows`: autograd's own backward for overlapping
    views (unfold, as_strided) is a generic scatter that took a quarter of the band kernel's time at L=8192.
    """

    @staticmethod
    def forward(ctx, stream: torch.Tensor, count: int, span: int, step: int) -> torch.Tensor:
        ctx.shape, ctx.step = stream.shape, step
        return _windows_view(stream, count, span, step)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_stream = grad.new_zeros(ctx.shape)
        _fold_windows(grad_stream, grad, ctx.step)
        return grad_stream, None, None, None


def _windows_view(stream: torch.Tensor, count: int, span: int, step: int) -> torch.Tensor:
    """(S, H, D) contiguous -> (count, H, span, D) view: window j holds rows [j·step, j·step + span)."""
    heads, head_dim = stream.shape[1:]
    return stream.as_strided((count, heads, span, head_dim), (step * heads * head_dim, head_dim, heads * head_dim, 1))


def _fold_windows(grad_stream: torch.Tensor, grad: torch.Tensor, step: int) -> None:
    """Add the gradients (count, H, span, D) of windows every `step` rows back into the (S, H, D) stream they view,
    in ceil(span / step) pieces: within a piece the windows cover disjoint rows, so each piece is one add."""
    count, _, span, _ = grad.shape
    for start in range(0, span, step):
        width = min(step, span - start)
        _windows_view(grad_stream[start:], count, width, step).add_(grad[:, :, start : start + width])


_HAS_FUSED_CPU_KERNELS = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
)


def _fused_kernels_apply(query: torch.Tensor, dropout: float) -> bool:
    """Whether the sparse kernels call torch's fused CPU flash-attention kernels directly (`_FusedSparseAttention`):
    on CPU, without attention dropout (which those kernels do not implement), in a torch that has them (they are
    private ops: a release without them falls back to the autograd path instead of failing)."""
    return query.device.type == "cpu" and dropout == 0.0 and _HAS_FUSED_CPU_KERNELS


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask -> the form torch's fused CPU kernels add to the scores: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _flash_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused CPU flash attention (what sdpa runs on CPU), called directly for the log-sum-exp it computes:
    (N, H, M, D) queries, (N, H, S, D) keys/values (any strides, the last dimension contiguous) and an additive mask
    broadcastable to (N, H, M, S) -> output (N, H, M, D) and lse (N, H, M) in fp32, both token-major in memory
    ((N, M, H, ·)). A row whose keys are all masked gets output 0 and lse 0 (the caller must discard that lse)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask=mask, scale=scaling)


def _flash_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of `_flash_forward`, shapes as there. Given the output and lse of a larger softmax that these keys
    are one part of, it returns that softmax's gradients through this part: the kernel recomputes the probabilities
    as exp(score - lse), the joint ones then, and reads `out` only for rowsum(grad · out), the softmax gradient's
    joint term (as blockwise/ring flash attention splits the keys)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, key, value, out, lse, 0.0, False, attn_mask=mask, scale=scaling
    )


def _token_stream(states: torch.Tensor, rows: int) -> torch.Tensor:
    """(B, T, H, X) -> (B · rows, H, X), the rows end to end, each zero-padded to `rows` tokens, contiguous: a view
    where the tokens already lie that way, else a copy."""
    batch, length, heads, width = states.shape
    if rows == length and states.is_contiguous():
        return states.view(batch * rows, heads, width)
    padded = states.new_zeros(batch, rows, heads, width)
    padded[:, :length] = states
    return padded.view(batch * rows, heads, width)


class BandChunks(NamedTuple):
    """A (B, T) batch cut into chunks of c queries, each with only the keys/values its band can reach: c + w of them
    (c + 2w in an encoder), as in Longformer's chunked local attention (Beltagy et al. 2020). Band attention then
    costs O(L·w) time and memory and never forms an L x L matrix.

    The rows of the batch are laid end to end as one token stream, (B, T, H, D) -> (B · T', H, D) with each row
    padded to T' = ceil(T / c) · c (the caller's memory itself where it already lies that way), so that the chunks'
    keys are overlapping windows of that stream (`windows`, a view); keys from a neighbouring row, from the padding
    or from outside the stream are masked.

    queries: (J, H, c, D) with J = B · T' / c; key_stream, value_stream: (B · T', H, D).
    band: (c, span) boolean, True where the key lies inside the query's band; own: (c, span), True at the query
    itself; visible: (J, span) boolean, True where the key is a real token of the chunk's row. A query sees the keys
    of its band that are visible, as under the dense mask, and itself only where none is (`allowed`), so that no row
    is empty. Window j spans stream rows [j·c - before, j·c - before + span).
    same_document: (J, c, span) boolean for packed rows, True where the key belongs to the query's document; None
    for one document per row.
    """

    queries: torch.Tensor
    key_stream: torch.Tensor
    value_stream: torch.Tensor
    band: torch.Tensor
    own: torch.Tensor
    visible: torch.Tensor
    before: int
    batch: int
    length: int
    same_document: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        window: int,
        causal: bool,
        padding_mask: torch.Tensor | None,
        chunk_size: int | None = None,
        documents: torch.Tensor | None = None,
    ) -> "BandChunks":
        """query, key, value: (B, H, T, D); padding_mask: (B, T), True for real tokens, or None; documents: (B, T)
        document ids of packed rows, or None."""
        batch, heads, length, _ = query.shape
        chunk = chunk_size or max(window, 64)
        per_row = -(-length // chunk)
        count = batch * per_row
        before, after = window, (0 if causal else window)
        span = chunk + before + after

        key_stream, value_stream = (_token_stream(states.transpose(1, 2), per_row * chunk) for states in (key, value))
        queries = _token_stream(query.transpose(1, 2), per_row * chunk)  # (B · T', H, D)
        queries = queries.view(count, chunk, heads, -1).transpose(1, 2)  # (J, H, c, D)

        device = query.device
        # Query t of a chunk sits at window position t + w: distance = query - key position, 0 for itself.
        distance = torch.arange(chunk, device=device)[:, None] + before - torch.arange(span, device=device)
        band = (distance <= window) & ((distance >= 0) if causal else (distance >= -window))  # (c, span)
        # Which stream position holds a real token, and of which row (-1 outside the stream).
        real = padding_mask.bool() if padding_mask is not None else query.new_ones(batch, length, dtype=torch.bool)
        real = nn.functional.pad(real, (0, per_row * chunk - length), value=False).flatten()
        real = nn.functional.pad(real, (before, after), value=False)  # (before + B · T' + after,)
        row = torch.arange(batch, device=device).repeat_interleave(per_row * chunk)
        row = nn.functional.pad(row, (before, after), value=-1)
        chunk_row = torch.arange(count, device=device) // per_row
        same_row = row.as_strided((count, span), (chunk, 1)) == chunk_row[:, None]  # (J, span)
        visible = real.as_strided((count, span), (chunk, 1)) & same_row
        same_document = None
        if documents is not None:
            # The stream's document ids (-1 outside it); each query's own id against its window's.
            stream = nn.functional.pad(documents, (0, per_row * chunk - length), value=-1).flatten()
            stream = nn.functional.pad(stream, (before, after), value=-1)  # (before + B · T' + after,)
            query_documents = stream[before : before + count * chunk].view(count, chunk, 1)  # (J, c, 1)
            same_document = stream.as_strided((count, 1, span), (chunk, span, 1)) == query_documents  # (J, c, span)
        return cls(
            queries, key_stream, value_stream, band, distance == 0, visible, before, batch, length, same_document
        )

    @property
    def span(self) -> int:
        return self.band.shape[1]

    def windows(self, stream: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Keys (or values) of chunks [start, stop): (J', H, span, D), a view of the stream where those windows lie
        inside it (all but the first and last chunks), else of a zero-padded copy of the rows they reach."""
        count, _, chunk = self.queries.shape[:3]
        stop = count if stop is None else stop
        first, last = start * chunk - self.before, (stop - 1) * chunk - self.before + self.span
        if first < 0 or last > len(stream):
            padded = stream.new_zeros(last - first, *stream.shape[1:])
            padded[max(-first, 0) : len(stream) - first] = stream[max(first, 0) : last]
            stream, first = padded, 0
        windows = _OverlappingWindows.apply if torch.is_grad_enabled() and stream.requires_grad else _windows_view
        return windows(stream[first:], stop - start, self.span, chunk)

    def fold(self, grad_stream: torch.Tensor, grad: torch.Tensor, start: int) -> None:
        """Add the gradients (J', H, span, D) of `windows(stream, start, ...)` into the stream's gradient."""
        chunk = self.queries.shape[2]
        first, last = start * chunk - self.before, (start + len(grad) - 1) * chunk - self.before + self.span
        if first >= 0 and last <= len(grad_stream):
            _fold_windows(grad_stream[first:], grad, chunk)
            return
        padded = grad_stream.new_zeros(last - first, *grad_stream.shape[1:])
        _fold_windows(padded, grad, chunk)
        grad_stream[max(first, 0) : last] += padded[max(-first, 0) : len(grad_stream) - first]

    def allowed(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Which keys the queries of chunks [start, stop) may see: (J', 1, c, span) boolean, where J' is 1 when all
        their keys are visible (one mask then serves every chunk, as for the inner chunks of an unpadded batch)."""
        visible = self.visible[start:stop]
        if self.same_document is None and bool(visible.all()):
            return self.band[None, None]
        allowed = self.band & visible[:, None, None, :]  # (J', 1, c, span)
        if self.same_document is not None:
            allowed = allowed & self.same_document[start:stop, None]  # keys of other documents in the band
        # A query with no visible key in its band (a left-padding query, the stream's tail padding) sees itself, so
        # that no row is empty; any other query, padding or not, sees exactly what the dense causal/padding mask
        # gives it. (generate() reads the logits of a right-padded row's last position, a padding query: the same
        # numbers with or without this kernel, i.e. with a dynamic or a static cache.)
        return allowed | (self.own & ~allowed.any(-1, keepdim=True))

    def groups(self) -> list[tuple[int, int]]:
        """Chunk ranges [start, stop) for the fused kernels: the first and last chunks alone (their windows reach
        outside the stream), the rest in ranges whose key windows hold an eighth of the stream's rows, so that their
        gradients (and a padded batch's masks) stay small next to the stream, yet give every thread work."""
        count, heads, chunk = self.queries.shape[:3]
        size = max(-(-count * chunk // (8 * self.span)), -(-4 * torch.get_num_threads() // heads), 1)
        head = min(-(-self.before // chunk), count)  # chunks whose windows start before the stream
        tail = max(count - -(-(self.span - self.before - chunk) // chunk), head)  # ... or end after it
        inner = [(start, min(start + size, tail)) for start in range(head, tail, size)]
        return (
            [(start, start + 1) for start in range(head)] + inner + [(start, start + 1) for start in range(tail, count)]
        )

    def calls(self, dtype: torch.dtype) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per fused kernel call (`groups`): the chunks, their key and value windows and their additive mask, one
        mask serving every range whose keys are all visible."""
        all_visible, shared = self.visible.all(-1).tolist(), None
        for start, stop in self.groups():
            if self.same_document is None and all(all_visible[start:stop]):
                shared = _additive_mask(self.band[None, None], dtype) if shared is None else shared
                mask = shared
            else:
                mask = _additive_mask(self.allowed(start, stop), dtype)
            keys, values = self.windows(self.key_stream, start, stop), self.windows(self.value_stream, start, stop)
            yield slice(start, stop), keys, values, mask

    def to_chunks(self, states: torch.Tensor) -> torch.Tensor:
        """Token-order tensors in the chunks' layout: (B, T, H, X) -> (J, H, c, X)."""
        count, _, chunk = self.queries.shape[:3]
        if count // self.batch * chunk != self.length:
            states = nn.functional.pad(states, (0, 0, 0, 0, 0, count // self.batch * chunk - self.length))
        return states.reshape(count, chunk, *states.shape[2:]).transpose(1, 2)

    def to_sequence(self, chunked: torch.Tensor) -> torch.Tensor:
        """Per-chunk results back in token order: (J, H, c, X) -> (B, T, H, X)."""
        count, heads, chunk, width = chunked.shape
        per_row = count // self.batch
        chunked = chunked.transpose(1, 2).reshape(self.batch, per_row * chunk, heads, width)
        return chunked[:, : self.length]

    def attend(self, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused forward: output (B, T, H, D) and log-sum-exp (B, T, H) (fp32) of every query over its band."""
        count, heads, chunk, head_dim = self.queries.shape
        out = self.queries.new_empty(count, chunk, heads, head_dim)  # token-major, as the kernel writes it
        lse = self.queries.new_empty(count, chunk, heads, 1, dtype=torch.promote_types(out.dtype, torch.float32))
        for rows, keys, values, mask in self.calls(out.dtype):
            part_out, part_lse = _flash_forward(self.queries[rows], keys, values, mask, scaling)
            out[rows], lse[rows, ..., 0] = part_out.transpose(1, 2), part_lse.transpose(1, 2)
        return self.to_sequence(out.transpose(1, 2)), self.to_sequence(lse.transpose(1, 2))[..., 0]

    def attend_backward(
        self,
        grad: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scaling: float,
        into: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused backward through the band's keys of a softmax with output `out` and log-sum-exp `lse` (B, T, H):
        grad (B, T, H, D) -> gradients of query, key, value, each (B, T, H, D), added to `into` when given (in
        place where those lie as the stream)."""
        grad, out, lse = self.to_chunks(grad), self.to_chunks(out), self.to_chunks(lse[..., None])[..., 0]
        count, heads, chunk, head_dim = self.queries.shape
        if into is None:
            grad_queries, grad_keys, grad_values = (self.key_stream.new_zeros(self.key_stream.shape) for _ in range(3))
        else:
            grad_queries, grad_keys, grad_values = (
                _token_stream(states, count // self.batch * chunk) for states in into
            )
        for rows, keys, values, mask in self.calls(grad.dtype):
            grad_query, grad_key, grad_value = _flash_backward(
                grad[rows], self.queries[rows], keys, values, out[rows], lse[rows], mask, scaling
            )
            grad_queries.view(count, chunk, heads, head_dim)[rows] += grad_query.transpose(1, 2)
            self.fold(grad_keys, grad_key, rows.start)
            self.fold(grad_values, grad_value, rows.start)
        chunked = (
            grads.view(count, chunk, heads, head_dim).transpose(1, 2)
            for grads in (grad_queries, grad_keys, grad_values)
        )
        return tuple(self.to_sequence(grads) for grads in chunked)


def _by_residue(states: torch.Tensor, stride: int) -> torch.Tensor:
    """(B, T, H, X) -> (B, s, H, M, X) with M = ceil(T / s): class r holds positions r, r + s, r + 2s, ...
    A view when T is a multiple of s."""
    batch, length, heads, width = states.shape
    per_class = -(-length // stride)
    if per_class * stride != length:
        states = nn.functional.pad(states, (0, 0, 0, 0, 0, per_class * stride - length))
    return states.view(batch, per_class, stride, heads, width).permute(0, 2, 3, 1, 4)


class ResidueClasses(NamedTuple):
    """A (B, T) batch regrouped by position modulo s, where the keys a whole multiple of s away from a query (the far
    part A2 of the strided pattern, Child et al. 2019) are dense attention within its class: O(L²/s), not O(L²).

    queries, keys, values: (B, s, H, M, D), M = ceil(T / s) per class, views of the tokens where they lie as
    (B, T, H, D) in memory and T is a multiple of s.
    allowed: (B|1, s|1, 1, M, M) boolean: another member of the class (an earlier one when causal), a real token.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    allowed: torch.Tensor
    length: int

    @classmethod
    def build(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        stride: int,
        causal: bool,
        padding_mask: torch.Tensor | None,
        documents: torch.Tensor | None = None,
    ) -> "ResidueClasses":
        """query, key, value: (B, H, T, D); padding_mask: (B, T), True for real tokens, or None; documents: (B, T)
        document ids of packed rows, or None."""
        batch, _, length, _ = query.shape
        per_class = -(-length // stride)
        index = torch.arange(per_class, device=query.device)
        others = (index[None, :] < index[:, None]) if causal else (index[None, :] != index[:, None])  # (M, M)
        one_document = documents is None
        if one_document and per_class * stride == length and (padding_mask is None or bool(padding_mask.all())):
            allowed = others[None, None, None]  # every member real: one mask for all rows and classes
        else:
            real = padding_mask.bool() if padding_mask is not None else query.new_ones(batch, length, dtype=torch.bool)
            real = _by_residue(real[:, :, None, None], stride)[:, :, 0, :, 0]  # (B, s, M); the tail pad is not real
            allowed = others & real[:, :, None, None, :]  # (B, s, 1, M, M)
            if not one_document:
                by_class = _by_residue(documents[:, :, None, None], stride)[:, :, 0, :, 0]  # (B, s, M)
                allowed = allowed & (by_class[..., None, :, None] == by_class[..., None, None, :])
        states = (_by_residue(states.transpose(1, 2), stride) for states in (query, key, value))
        return cls(*states, allowed, length)

    @property
    def has_far(self) -> torch.Tensor:
        """(B, T, 1) boolean: whether the query sees any key of its class (else its far part is empty)."""
        batch, stride, _, per_class, _ = self.queries.shape
        return self.to_sequence(self.allowed.any(-1).expand(batch, stride, 1, per_class)[..., None])[..., 0]

    def to_sequence(self, classes: torch.Tensor) -> torch.Tensor:
        """(B, s, H, M, X) -> (B, T, H, X)"""
        batch, stride, heads, per_class, width = classes.shape
        return classes.permute(0, 3, 1, 2, 4).reshape(batch, per_class * stride, heads, width)[:, : self.length]

    def _calls(self, dtype: torch.dtype) -> Iterator[tuple[slice, torch.Tensor]]:
        """(batch rows, mask) per fused kernel call, classes and heads together as the kernel's heads (B, s·H, M, ·):
        one call where one mask serves every row, else one per batch row with that row's (1, s·H, M, M) mask."""
        batch, stride, heads, per_class, _ = self.queries.shape
        if self.allowed.shape[:2] == (1, 1):
            yield slice(None), _additive_mask(self.allowed[0], dtype)  # (1, M, M), broadcast over (B, s·H)
            return
        expanded = self.allowed.expand(-1, stride, heads, -1, -1)  # (B|1, s, H, M, M)
        for rows in [slice(None)] if len(expanded) == 1 else [slice(row, row + 1) for row in range(batch)]:
            yield rows, _additive_mask(expanded[rows].reshape(-1, stride * heads, per_class, per_class), dtype)

    def _flat(self, states: torch.Tensor) -> torch.Tensor:
        """(B, T, H, X) tokens, or (B, s, H, M, X) classes -> (B, s·H, M, X), the kernels' layout (a view for
        (B, T, H, X)-contiguous tokens)."""
        if states.dim() == 4:
            states = _by_residue(states, self.queries.shape[1])
        return states.reshape(states.shape[0], -1, *states.shape[3:])

    def _unflat(self, flat: torch.Tensor) -> torch.Tensor:
        """(B, s·H, M, X) -> (B, T, H, X)"""
        batch, stride, heads = self.queries.shape[:3]
        return self.to_sequence(flat.view(batch, stride, heads, *flat.shape[2:]))

    def attend(self, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused forward: output (B, T, H, D) and log-sum-exp (B, T, H) over each query's class (its lse is
        meaningless where `has_far` is False)."""
        queries, keys, values = (self._flat(states) for states in (self.queries, self.keys, self.values))
        results = [
            _flash_forward(queries[rows], keys[rows], values[rows], mask, scaling)
            for rows, mask in self._calls(queries.dtype)
        ]
        out, lse = (torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*results))
        return self._unflat(out), self._unflat(lse[..., None])[..., 0]

    def attend_backward(
        self, grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused backward through the class keys, as `BandChunks.attend_backward`."""
        grad, out, lse = self._flat(grad), self._flat(out), self._flat(lse[..., None])[..., 0]
        queries, keys, values = (self._flat(states) for states in (self.queries, self.keys, self.values))
        results = [
            _flash_backward(grad[rows], queries[rows], keys[rows], values[rows], out[rows], lse[rows], mask, scaling)
            for rows, mask in self._calls(queries.dtype)
        ]
        return tuple(self._unflat(torch.cat(parts) if len(parts) > 1 else parts[0]) for parts in zip(*results))


def _join(
    band_out: torch.Tensor,
    band_lse: torch.Tensor,
    far_out: torch.Tensor,
    far_lse: torch.Tensor,
    has_far: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over A1 ∪ A2 from each part's softmax: weights exp(lse_i - lse), lse = log(exp(lse1) + exp(lse2)).
    In fp32 whatever the compute dtype, cast once: in bf16 an lse near 8 is only known to ±0.016, and the weights
    to ±1.6%. (B, T, H, D) outputs and (B, T, H) lse -> output, lse."""
    accumulate = torch.promote_types(dtype, torch.float32)
    far_lse = far_lse.masked_fill(~has_far, float("-inf"))  # an empty far part weighs nothing
    lse = torch.logaddexp(band_lse, far_lse)
    out = band_out.to(accumulate) * (band_lse - lse).exp()[..., None]
    return out.addcmul_(far_out.to(accumulate), (far_lse - lse).exp()[..., None]).to(dtype), lse


class _SparsePattern(NamedTuple):
    """The band (stride None) or strided pattern a sparse kernel computes, and how it is cut."""

    window: int
    stride: int | None
    causal: bool
    scaling: float
    chunk_size: int | None

    def parts(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        padding_mask: torch.Tensor | None,
        documents: torch.Tensor | None = None,
    ):
        """The disjoint key sets whose softmaxes join into the pattern's: the band, and for strided the classes."""
        shared = dict(causal=self.causal, padding_mask=padding_mask, documents=documents)
        band = BandChunks.build(query, key, value, window=self.window, chunk_size=self.chunk_size, **shared)
        if self.stride is None:
            return [band]
        return [band, ResidueClasses.build(query, key, value, stride=self.stride, **shared)]


class _FusedSparseAttention(torch.autograd.Function):
    """Band or strided attention through torch's fused CPU flash kernels, keeping for backward only what full
    attention under sdpa keeps: query, key, value, the output and its log-sum-exp (B, T, H). Layouts and masks are
    rebuilt in backward (views of q/k/v where they lie token-major), and each part's gradients come from the kernels'
    own backward given the joint output and lse (`_flash_backward`). (B, H, T, D) query/key/value -> (B, T, H, D).

    Through autograd instead, sdpa kept its inputs (padded copies of the key/value streams and a float copy of the
    (J, 1, c, span) mask) and the strided join its per-class scores and probabilities. One call at L=8192 (4 heads
    of 64, window and stride 128, fp32, forward + backward) peaked at 101 MiB (sliding) and 229 MiB (strided) that
    way, 38 MiB each this way; full attention under sdpa, 34 MiB."""

    @staticmethod
    def forward(ctx, query, key, value, padding_mask, documents, pattern: _SparsePattern):
        band, *far = pattern.parts(query, key, value, padding_mask, documents)
        out, lse = band.attend(pattern.scaling)
        if far:
            out, lse = _join(out, lse, *far[0].attend(pattern.scaling), far[0].has_far, query.dtype)
        ctx.pattern = pattern
        ctx.save_for_backward(query, key, value, padding_mask, documents, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, padding_mask, documents, out, lse = ctx.saved_tensors
        band, *far = ctx.pattern.parts(query, key, value, padding_mask, documents)
        # The classes first: the band then adds its gradients into theirs (in place where they lie as its stream).
        far_grads = far[0].attend_backward(grad, out, lse, ctx.pattern.scaling) if far else None
        grads = band.attend_backward(grad, out, lse, ctx.pattern.scaling, into=far_grads)
        return *(grad.transpose(1, 2) for grad in grads), None, None, None  # (B, T, H, D) -> (B, H, T, D)


def _softmax_part(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one part of the keys, written out, with its log-sum-exp so that it can join another:
    (..., T, D) queries, (..., S, D) keys/values, (..., T, S) mask -> output (..., T, D), lse (..., T, 1), both in
    fp32 (at least) whatever the compute dtype, as in eager_attention_forward, for `_join` to round once."""
    # A masked score is the most negative float rather than -inf, so that a row with no visible key stays finite
    # (its lse is then discarded).
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, torch.finfo(dtype).min)
    probs = nn.functional.dropout(torch.softmax(scores, dim=-1), p=dropout)
    return torch.matmul(probs, value.to(dtype)), torch.logsumexp(scores, dim=-1, keepdim=True)


def _compute_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in the dtype sdpa would compute in: autocast's where it is on (it casts sdpa's inputs), else q's."""
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    return query.to(dtype), key.to(dtype), value.to(dtype)


def sliding_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    window: int,
    causal: bool,
    padding_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    chunk_size: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Band attention in O(L·w) time and memory: each query sees the keys at most `window` positions away (only
    earlier ones when causal), over `BandChunks`, with flash attention inside each chunk.

    Computes exactly what the dense band mask does, without ever forming an L x L score or mask matrix. On CPU
    without attention dropout through `_FusedSparseAttention` (which keeps for backward what full sdpa keeps);
    elsewhere through sdpa and autograd.

    Args:
        query: (B, H, T, D); key, value: (B, H, T, D) (key/value heads already repeated).
        window: keys at most `window` positions away are visible.
        padding_mask: (B, T) boolean, True for real tokens, or None.
        documents: (B, T) document ids of packed rows (keys of another document are masked), or None.

    Returns:
        (B, T, H, D)
    """
    query, key, value = _compute_dtype(query, key, value)
    if _fused_kernels_apply(query, dropout):
        pattern = _SparsePattern(window, None, causal, scaling, chunk_size)
        return _FusedSparseAttention.apply(query, key, value, padding_mask, documents, pattern)
    chunks = BandChunks.build(
        query,
        key,
        value,
        window=window,
        causal=causal,
        padding_mask=padding_mask,
        chunk_size=chunk_size,
        documents=documents,
    )
    keys, values = chunks.windows(chunks.key_stream), chunks.windows(chunks.value_stream)  # (J, H, span, D)
    output = nn.functional.scaled_dot_product_attention(
        chunks.queries, keys, values, attn_mask=chunks.allowed(), dropout_p=dropout, scale=scaling
    )  # (J, H, c, D)
    return chunks.to_sequence(output)


def strided_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    stride: int,
    causal: bool,
    padding_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    chunk_size: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse Transformer strided attention (Child et al. 2019, sec. 4.2) in O(L·(s + L/s)): a query sees the keys
    less than s positions away (A1) and every key a multiple of s away (A2), only earlier ones when causal.

    Each part is computed where it is dense, with its log-sum-exp, and the two are joined exactly (`_join`):
      A1, the band |q - k| < s: `BandChunks` with window s - 1 (chunks of s queries by default).
      A2 \\ {query}: `ResidueClasses`, tokens regrouped by position mod s, (B, H, T, D) -> (B, s, H, T/s, D), where
          it is dense attention within each class minus the diagonal.
    On CPU without attention dropout both parts run in torch's fused flash kernels (`_FusedSparseAttention`);
    elsewhere they are written out (scores of O(L·s + L²/s) size) and go through autograd, dropout key by key.

    Args:
        query: (B, H, T, D); key, value: (B, H, T, D) (key/value heads already repeated).
        padding_mask: (B, T) boolean, True for real tokens, or None.
        documents: (B, T) document ids of packed rows (keys of another document are masked), or None.

    Returns:
        (B, T, H, D)
    """
    query, key, value = _compute_dtype(query, key, value)
    pattern = _SparsePattern(stride - 1, stride, causal, scaling, chunk_size or max(stride, 64))
    if _fused_kernels_apply(query, dropout):
        return _FusedSparseAttention.apply(query, key, value, padding_mask, documents, pattern)
    band, far = pattern.parts(query, key, value, padding_mask, documents)
    keys, values = band.windows(band.key_stream), band.windows(band.value_stream)  # (J, H, span, D)
    band_out, band_lse = _softmax_part(band.queries, keys, values, band.allowed(), scaling, dropout)
    far_out, far_lse = _softmax_part(far.queries, far.keys, far.values, far.allowed, scaling, dropout)
    band_out, band_lse = band.to_sequence(band_out), band.to_sequence(band_lse)[..., 0]
    far_out, far_lse = far.to_sequence(far_out), far.to_sequence(far_lse)[..., 0]
    return _join(band_out, band_lse, far_out, far_lse, far.has_far, query.dtype)[0]


class SparseKernel(LayerKernel):
    """A sliding or strided layer's kernel: `function` with the type's parameter bound (`window=` or `stride=`).
    It computes what the type's dense mask computes, so the plan runs it only where it applies
    (`LayerType.dense_fallback`)."""

    def __init__(self, function: Callable[..., torch.Tensor], **parameter: int):
        self.function = function
        self.parameter = parameter

    def attend(self, attention, query, key, value, mask, cache, plan):
        dropout = attention.attention_dropout if attention.training else 0.0
        return self.function(
            query,
            key,
            value,
            **self.parameter,
            causal=attention.is_causal,
            padding_mask=mask,
            scaling=attention.scaling,
            dropout=dropout,
            documents=plan.documents,
        )
