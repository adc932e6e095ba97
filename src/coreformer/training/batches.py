"""The data order of a pretraining run: global batch numbers, and the loader that hands each process its share.

    derive_seed(seed, stream, index)     a seed for item `index` of a named stream, the same on every machine
    reseeded(collator, seed)             a seeded collator drawing from `seed` alone (batch g's masks and dropout)
    GlobalBatches                        global batch number g -> (g, collated batch)
    strided_loader(batches, start, step, ...)    a DataLoader over g = start, start + step, ... without end

Why runs are exact. Every example a run sees is fixed by its global batch number g: batch g holds the examples at
positions [g * batch_size, (g + 1) * batch_size) of an endless stream of seeded per-epoch permutations, and its
masking and dropout draw from seeds derived from (seed, g). On rank r of W, micro-batch j is global batch
g = consumed + j * W + r, which is exactly how a single process with `grad_accum * W` micro-batches per step would
number them. So a 2-process run and a 1-process run with `--grad-accum 2` put the same examples, masks and dropout
into each optimizer step, and a resumed run restarts at the first unconsumed g (no batches to skip over).
"""

import hashlib
from collections.abc import Iterator
from typing import Any

import datasets
import torch

from .data import SeededCollator


def derive_seed(seed: int, stream: str, index: int) -> int:
    """A seed for item `index` of `stream` ("shuffle", "train", "eval", "dropout"), the same on every machine."""
    digest = hashlib.blake2b(f"{seed}/{stream}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def reseeded(collator: Any, seed: int) -> Any:
    """A copy of a seeded collator (MLM, denoising) drawing from `seed` alone, in the loop's process or a loader
    worker alike; others as they are."""
    return collator.pinned(seed) if isinstance(collator, SeededCollator) else collator


class GlobalBatches(torch.utils.data.Dataset):
    """Global batch number g -> (g, collated batch): the examples at stream positions [g*B, (g+1)*B).

    The stream is an endless concatenation of per-epoch permutations of `dataset` (epoch e is shuffled with
    `derive_seed(seed, "shuffle", e)`; `shuffle=False` keeps the order), so a batch may span two epochs. The collator
    is reseeded per batch with `derive_seed(seed, stream, g)`: what batch g looks like does not depend on which
    process builds it, in which order, or after how many others.
    """

    def __init__(
        self, dataset: datasets.Dataset, collator: Any, batch_size: int, *, seed: int, stream: str, shuffle: bool
    ):
        self.dataset, self.collator, self.batch_size = dataset, collator, batch_size
        self.seed, self.stream, self.shuffle = seed, stream, shuffle
        self._permutations: dict[int, torch.Tensor] = {}  # the epoch's order, 8 bytes an example (not a list's 40)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if not self.shuffle:
            return offset
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "shuffle", epoch))
            self._permutations = {epoch: torch.randperm(len(self.dataset), generator=generator)}
        return int(self._permutations[epoch][offset])

    def __getitem__(self, g: int) -> tuple[int, dict[str, torch.Tensor]]:
        start = g * self.batch_size
        rows = self.dataset[[self._index(position) for position in range(start, start + self.batch_size)]]
        examples = [dict(zip(rows, values)) for values in zip(*rows.values())]
        return g, reseeded(self.collator, derive_seed(self.seed, self.stream, g))(examples)


class _Strided(torch.utils.data.Sampler):
    """start, start + step, start + 2 * step, ... without end (the loop decides when to stop)."""

    def __init__(self, start: int, step: int):
        self.start, self.step = start, step

    def __iter__(self) -> Iterator[int]:
        index = self.start
        while True:
            yield index
            index += self.step


def _identity(item: Any) -> Any:
    return item  # DataLoader(batch_size=None) would run default_convert; batches are already tensors


def strided_loader(
    batches: GlobalBatches, start: int, step: int, *, num_workers: int, pin_memory: bool
) -> torch.utils.data.DataLoader:
    """Global batches start, start + step, ... (one process's share when step is the world size)."""
    return torch.utils.data.DataLoader(
        batches,
        batch_size=None,
        sampler=_Strided(start, step),
        num_workers=num_workers,
        collate_fn=_identity,
        pin_memory=pin_memory,
    )
