"""Pretraining on a streamed source (`--streaming`): documents read as they come from a datasets source (local files
or the Hub, `datasets.load_dataset(..., streaming=True)`), tokenized on the fly, never stored whole.

    StreamedText(args, rank, world)       the source streamed: this process's share of the training documents, and
                                          the held-out documents (read once, at most HELD_OUT_DOCUMENTS)
    StreamedBatches(text, ...)            this process's micro-batches (g, batch), g = start, start + step, ...,
                                          built chunk by chunk; `next_position` is where the next one starts
    StreamPosition                        (pass, chunk, row): a micro-batch's start; checkpoints hold one a process

How the batches are made. A process's training documents (its share, `datasets.distributed.split_dataset_by_node`:
whole files when they divide among the processes, else every W-th document; then those the held-out rule leaves in)
are read in chunks of CHUNK_DOCUMENTS. Each chunk is tokenized (by --num-workers processes, in order; the plain ids,
as `coreformer tokenize` makes them), the objective builds its rows from the chunk's ids as it builds them from shards
(`Objective.sharded_examples`: windows, blocks or packed rows; blocks do not cross chunks), the rows are shuffled
within the chunk (seeded by pass and chunk), and each micro-batch is the next --batch-size rows, collated with the
seed of its global number as every run's batches are. After the last chunk of its share a process starts the next
pass from the first.

    documents   d0 d1 ... d999 | d1000 ... d1999 | ...      chunks of CHUNK_DOCUMENTS (this process's share)
    rows        r r r r r r r  | r r r r r r      | ...      the objective's rows of each chunk, shuffled within it
    batches     [B rows] [B rows] [B ...                     micro-batch j: rows [j * B, (j + 1) * B) of that stream

Resuming. A micro-batch's rows follow from where it starts: (pass, chunk, row of the chunk's shuffled rows). Each
process keeps the position after its last micro-batch, and a checkpoint records every process's; a resumed run reads
its share again up to that chunk (those documents are read, not tokenized) and skips the rows before that row. So a
stopped run resumes to the batches of the uninterrupted one on the same number of processes; another number would
give other shares, and is refused.

The held-out documents are the source's own validation split if it has one, else those whose hash falls under
--validation-fraction (`shards.is_held_out`, the rule `coreformer tokenize` applies): decided by the text alone, so the
same on every run and for any number of processes, and never in training.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from coreformer_settings.data_sources import local_builder
from coreformer_settings.evaluation import HELD_OUT_DOCUMENTS

from .arguments import PretrainingError
from .batches import derive_seed, reseeded
from .shard_examples import DocumentIds
from .shards import Encoder, encoded_chunks, is_held_out, token_dtype, vocabulary_size

CHUNK_DOCUMENTS = 1000  # documents tokenized and laid out together: rows are shuffled within a chunk


@dataclass(frozen=True)
class StreamPosition:
    """Where a process's next micro-batch starts: `row` of the shuffled rows of `chunk` in pass `passes`."""

    passes: int = 0
    chunk: int = 0
    row: int = 0


class StreamedText:
    """The documents of a streamed source, as text: a process's share of the training ones, and the held-out ones."""

    def __init__(self, args: Any, rank: int, world: int):
        self.source, self.column = args.dataset, args.text_column
        self.fraction, self.seed = args.validation_fraction, args.seed
        self.rank, self.world = rank, world
        try:
            builder, files = local_builder(self.source)
        except ValueError as error:  # a missing file, an unknown extension
            raise PretrainingError(str(error)) from None
        try:
            if builder is not None:
                loaded = datasets.load_dataset(builder, data_files=files, streaming=True)
            else:
                loaded = datasets.load_dataset(self.source, args.dataset_config, streaming=True)
        except Exception as error:  # DatasetNotFoundError, ConnectionError offline, ...
            raise PretrainingError(
                f"Cannot stream dataset {self.source!r}: {type(error).__name__}: {error}. Pass local files "
                f"(.txt/.json/.jsonl/.csv/.parquet) or a datasets Hub name."
            ) from error
        if "train" not in loaded:
            raise PretrainingError(f"{self.source!r} has no 'train' split; it has {sorted(loaded)}.")
        self.splits = loaded

    def _texts(self, documents: datasets.IterableDataset) -> Iterator[str]:
        """The non-blank texts of the text column (the first document says whether the column is there)."""
        for document in documents:
            if self.column not in document:
                raise PretrainingError(
                    f"{self.source!r} has no column {self.column!r}; its columns are {sorted(document)}. Name one of "
                    f"them with --text-column (text_column: in a config file)."
                )
            text = document[self.column]
            if text and text.strip():
                yield text

    def held_out(self) -> list[str]:
        """The held-out documents, at most HELD_OUT_DOCUMENTS: the validation split's, or the training split's that the
        hash holds out (reading it until there are enough, or it ends)."""
        if "validation" in self.splits:
            return list(islice(self._texts(self.splits["validation"]), HELD_OUT_DOCUMENTS))
        held = (text for text in self._texts(self.splits["train"]) if is_held_out(text, self.fraction, self.seed))
        return list(islice(held, HELD_OUT_DOCUMENTS))

    def training_documents(self) -> Iterator[str]:
        """This process's share of the training documents, in the source's order."""
        from datasets.distributed import split_dataset_by_node

        share = split_dataset_by_node(self.splits["train"], rank=self.rank, world_size=self.world)
        if "validation" in self.splits:
            yield from self._texts(share)
        else:
            yield from (text for text in self._texts(share) if not is_held_out(text, self.fraction, self.seed))


@dataclass
class _Chunk:
    index: int
    texts: list[str] = field(default_factory=list)


class StreamedBatches:
    """A process's micro-batches, global numbers start, start + step, ... (as `strided_loader`), from the position
    a resumed run left off; endless (the loop stops it)."""

    def __init__(
        self,
        text: StreamedText,
        objective: Any,
        tokenizer: PreTrainedTokenizerBase,
        collator: Any,
        args: Any,
        *,
        start: int,
        step: int,
        position: StreamPosition,
        num_workers: int,
    ):
        self.text, self.objective, self.tokenizer, self.collator, self.args = text, objective, tokenizer, collator, args
        self.g, self.step, self.num_workers = start, step, num_workers
        self.next_position = position
        self.encoder = Encoder(tokenizer, token_dtype(vocabulary_size(tokenizer)))
        self._rows = self._row_stream(position)

    def __iter__(self) -> "StreamedBatches":
        return self

    def __next__(self) -> tuple[int, dict[str, Any]]:
        rows = [next(self._rows) for _ in range(self.args.batch_size)]
        g, self.g = self.g, self.g + self.step
        return g, reseeded(self.collator, derive_seed(self.args.seed, "train", g))(rows)

    def _chunks(self, first: int) -> Iterator[_Chunk]:
        """The share's documents in chunks, from chunk `first` on (the ones before are read and dropped)."""
        documents = self.text.training_documents()
        index = 0
        while texts := list(islice(documents, CHUNK_DOCUMENTS)):
            if index >= first:
                yield _Chunk(index, texts)
            index += 1

    def _row_stream(self, position: StreamPosition) -> Iterator[dict[str, Any]]:
        passes, first, skip = position.passes, position.chunk, position.row
        while True:
            rows = 0
            for chunk, (ids, lengths) in encoded_chunks(self.encoder, self._chunks(first), self.num_workers):
                table = self.objective.sharded_examples(DocumentIds(ids, lengths), self.tokenizer, self.args)
                seed = derive_seed(self.args.seed, f"stream pass {passes}", chunk.index)
                order = np.random.default_rng(seed).permutation(len(table))
                for row in range(skip, len(table)):
                    self.next_position = StreamPosition(passes, chunk.index, row + 1)
                    rows += 1
                    yield table.row(int(order[row]))
                skip = 0
            if rows == 0 and first == 0:
                raise PretrainingError(
                    f"This process's share of {self.text.source!r} gives no training example of --block-size "
                    f"{self.args.block_size} tokens; use more text or a smaller --block-size."
                )
            passes, first = passes + 1, 0
