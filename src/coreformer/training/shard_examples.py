"""A pretraining run's examples read from token shards (`--data-dir`): the rows each objective builds from text
(data.py, objectives/), built on demand from a `ShardedTokens` split, so a process reads only the ids of the batches
it trains on and memory holds a few numbers per document, never the corpus.

    ShardWindows(tokens, width, prefix, suffix, end)   each document (+ `end`) cut into pieces of `width` ids, each
                                                       piece wrapped in `prefix`/`suffix` (tokenize_dataset's windows,
                                                       causal_lm.document_windows)
    ShardBlocks(tokens, block_size, separator)         documents joined by `separator`, cut into full blocks
                                                       (causal_lm.pack_into_blocks, over the whole split)
    PackedRows(windows, block_size)                    windows packed into rows (data.pack_windows: best fit within
                                                       each run of PACK_WINDOWS windows)
    Documents                                          what the tables read: a `ShardedTokens` split, or
    DocumentIds(ids, lengths)                          documents tokenized in memory (a streamed run's chunk)

Each is a table as `GlobalBatches` reads a `datasets.Dataset`: `len(table)`, `table[[i, j, ...]]` -> a dict of
columns ("input_ids", and "lengths" for packed rows), and `table.shuffle(seed)`. The same documents give the same
rows as the text path (tests/training/test_shard_pretraining.py holds each table to its text-path twin), with one
difference: `ShardBlocks` cuts the split's whole stream, where `pack_into_blocks` drops each map batch's tail.

    windows (width 4, prefix [CLS], suffix [SEP])   a a a a a a  ->  [CLS] a a a a [SEP]  [CLS] a a [SEP]
    blocks (block 4, separator </s>)                a a a </s> b b </s> c c c c </s> ...  ->  [a a a </s>] [b b </s> c]
"""

from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .data import best_fit_rows

PACK_WINDOWS = 1000  # windows packed together, as pack_windows' map batches: the same rows from the same windows


class Documents(Protocol):
    """Documents of token ids by index (`ShardedTokens` is one)."""

    def __len__(self) -> int: ...

    def document(self, index: int) -> np.ndarray: ...

    def lengths(self) -> np.ndarray: ...


class DocumentIds:
    """Documents tokenized in memory: their ids one after another and each one's count of ids."""

    def __init__(self, ids: np.ndarray, lengths: np.ndarray):
        self.ids, self._lengths = ids, np.asarray(lengths, dtype=np.int64)
        self.ends = np.cumsum(self._lengths)

    def __len__(self) -> int:
        return len(self._lengths)

    def document(self, index: int) -> np.ndarray:
        return self.ids[int(self.ends[index]) - int(self._lengths[index]) : int(self.ends[index])]

    def lengths(self) -> np.ndarray:
        return self._lengths


class ShardTable(ABC):
    """What the tables share: rows by index, and a shuffled view (what the held-out pool is drawn from)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def row(self, index: int) -> dict[str, Any]:
        """Row `index`: its "input_ids" (and a packed row's "lengths")."""

    def __getitem__(self, indices: Sequence[int]) -> dict[str, list]:
        rows = [self.row(int(index)) for index in indices]
        return {key: [row[key] for row in rows] for key in (rows[0] if rows else {"input_ids": None})}

    def shuffle(self, seed: int) -> "_Reordered":
        """The rows in a seeded order (numpy's generator, as `datasets.Dataset.shuffle`)."""
        return _Reordered(self, np.random.default_rng(seed).permutation(len(self)))


class _Reordered(ShardTable):
    def __init__(self, table: ShardTable, order: np.ndarray):
        self.table, self.order = table, order

    def __len__(self) -> int:
        return len(self.order)

    def row(self, index: int) -> dict[str, Any]:
        return self.table.row(int(self.order[index]))


class ShardWindows(ShardTable):
    """Document d's ids, followed by `end`, cut into pieces of `width` ids (the last shorter), each wrapped in `prefix`
    and `suffix`: window j of the split is piece k of document d, found by bisecting the windows' starts."""

    def __init__(
        self, tokens: Documents, width: int, *, prefix: Sequence[int] = (), suffix: Sequence[int] = (),
        end: Sequence[int] = (),
    ):  # fmt: skip
        if width < 1:
            raise ValueError(
                f"Windows of {width + len(prefix) + len(suffix)} ids leave no room beside the tokenizer's "
                f"{len(prefix) + len(suffix)} special tokens; use a larger block size."
            )
        self.tokens, self.width = tokens, width
        self.prefix, self.suffix, self.end = (np.asarray(ids, dtype=np.int64) for ids in (prefix, suffix, end))
        self.content = tokens.lengths() + len(self.end)  # ids cut per document
        counts = -(-self.content // width)  # ceil: an empty document has a window only when `end` gives it ids
        self.first_window = np.concatenate(([0], np.cumsum(counts)))

    def __len__(self) -> int:
        return int(self.first_window[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(document, piece) of window `index`."""
        document = bisect_right(self.first_window, index) - 1
        return document, index - int(self.first_window[document])

    def lengths(self, start: int, stop: int) -> np.ndarray:
        """The lengths of windows [start, stop), read from the index alone (for packing)."""
        windows = np.arange(start, stop)
        documents = np.searchsorted(self.first_window, windows, side="right") - 1
        pieces = windows - self.first_window[documents]
        rest = self.content[documents] - pieces * self.width
        return np.minimum(rest, self.width) + len(self.prefix) + len(self.suffix)

    def row(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        document, piece = self.locate(index)
        ids = self.tokens.document(document)
        start = piece * self.width
        body = ids[start : start + self.width].astype(np.int64)
        tail = self.end[max(0, start - len(ids)) : max(0, start + self.width - len(ids))]
        return {"input_ids": np.concatenate((self.prefix, body, tail, self.suffix))}


class ShardBlocks(ShardTable):
    """The split's documents, each followed by `separator`, as one stream cut into blocks of `block_size` ids (the
    stream's tail that fills no block is left out). Document i starts at position ends[i - 1] + i of the stream."""

    def __init__(self, tokens: Documents, block_size: int, *, separator: int):
        if block_size < 1:
            raise ValueError(f"`block_size` must be >= 1, got {block_size}.")
        self.tokens, self.block_size, self.separator = tokens, block_size, separator
        lengths = tokens.lengths() + 1
        self.starts = np.concatenate(([0], np.cumsum(lengths)))  # document i's ids + separator: [starts[i], [i+1])

    def __len__(self) -> int:
        return int(self.starts[-1]) // self.block_size

    def row(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        start, stop = index * self.block_size, (index + 1) * self.block_size
        document = bisect_right(self.starts, start) - 1
        pieces = []
        while start < stop:
            ids = self.tokens.document(document)
            offset = start - int(self.starts[document])  # where the block picks the document (+ separator) up
            take = min(stop - start, len(ids) + 1 - offset)
            piece = ids[offset : offset + take].astype(np.int64)
            pieces.append(piece if len(piece) == take else np.append(piece, self.separator))
            start, document = start + take, document + 1
        return {"input_ids": np.concatenate(pieces)}


class PackedRows(ShardTable):
    """Windows packed into rows of at most `block_size`: each run of PACK_WINDOWS consecutive windows packed on its
    own by best fit (`best_fit_rows`), as `pack_windows` packs each map batch. A full window is a row of its own, so
    only the windows shorter than `block_size` (about one a document) go through the packing: the plan is computed
    once, in time and memory that grow with the documents and the windows' count, not with the ids."""

    def __init__(self, windows: ShardWindows, block_size: int):
        self.windows, self.block_size = windows, block_size
        rows: list[np.ndarray] = []  # each run's rows, flattened: window indices, one row after another
        row_sizes: list[np.ndarray] = []
        for start in range(0, len(windows), PACK_WINDOWS):
            lengths = windows.lengths(start, min(start + PACK_WINDOWS, len(windows)))
            full = np.flatnonzero(lengths == block_size)
            short = np.flatnonzero(lengths < block_size)
            packed = best_fit_rows(lengths[short].tolist(), block_size)  # best fit decreasing puts full ones first
            rows += [start + full, *(start + short[row] for row in packed)]
            row_sizes += [np.ones(len(full), np.int64), np.array([len(row) for row in packed], np.int64)]
        self.members = np.concatenate(rows) if rows else np.empty(0, np.int64)
        self.first_member = np.concatenate(([0], np.cumsum(np.concatenate(row_sizes)))) if rows else np.zeros(1, int)

    def __len__(self) -> int:
        return len(self.first_member) - 1

    def row(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        members = self.members[self.first_member[index] : self.first_member[index + 1]]
        windows = [self.windows.row(int(window))["input_ids"] for window in members]
        return {"input_ids": np.concatenate(windows), "lengths": [len(window) for window in windows]}
