"""Data for both runs: text loading (embedded corpus | local files | Hub), tokenization, and collator pieces.

    load_embedded_corpus(seed, validation_fraction, max_documents)  the Python standard library's own source files
    load_text_dataset(source, text_column, ...)                      embedded corpus | local file(s) | Hub dataset
    iter_texts(dataset)                                              the texts, re-iterable, for `train_tokenizer`
    tokenize_dataset(dataset, tokenizer, ...)                        text -> input_ids (long documents -> windows)
    tokenization_fingerprint(dataset, tokenizer, ...)                its cache key, from the tokenizer's content
    special_tokens_around(tokenizer)                                 the ids a tokenizer puts around one sequence
    pad_sequences, as_ids, SeededCollator                            what every objective's collator is built from
    pack_windows(dataset, block_size)                                whole windows -> rows of at most block_size
    best_fit_rows(lengths, capacity)                                 which windows share a row (best-fit decreasing)
    row_documents(example) / packed_rows(rows, pad_value, ...)       a packed row's documents; rows -> (B, L) tensors
                                                                     with position_ids restarting at each document

Packed rows (--packing packed). Whole windows (each at most block_size ids) share a row; their position ids restart
at 0, which the model reads as document boundaries (no attention_mask; transformers' `find_packed_sequence_indices`),
so each document attends only to itself. A row's unfilled tail is padding laid out as one more document: its own
position ids, labels -100, never attended to by a real document, left out of the token counts.

    windows      [a a a a a] [b b b] [c c c c c c] [d d]          block_size 8
    rows         [c c c c c c d d]   [a a a a a b b b]   ...      best-fit decreasing, per `map` batch
    position_ids [0 1 2 3 4 5 0 1]   [0 1 2 3 4 0 1 2]
    a short row  [e e e e e <pad> <pad> <pad>]  positions [0 1 2 3 4 0 1 2]  (the tail is its own document)

The objectives' collators live beside their objectives (objectives/*.py). Every collator is a dataclass called on a
list of examples (dicts with "input_ids") that returns a dict of tensors. Its randomness comes from its own
`torch.Generator` seeded with `seed` (reseeded per DataLoader worker, see `SeededCollator`), so a run is
reproducible without touching the global RNG. Nothing here imports the modeling files.
"""

import bisect
import copy
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import datasets
import torch
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from coreformer_settings.data_sources import local_builder

from .corpora import read_source, stdlib_root, stdlib_source_files


def load_embedded_corpus(
    seed: int = 0, validation_fraction: float = 0.05, max_documents: int | None = None
) -> datasets.DatasetDict:
    """The Python standard library's source files as a pretraining corpus: real code and prose, on every machine.

    One document per file (docstrings included); files that are empty or not UTF-8 are skipped. The corpus is
    whatever the running interpreter ships (CPython 3.11: ~610 files, ~10.7M characters), so it is identical across
    runs on one installation, not across Python versions.

    Args:
        seed: Shuffles the files before the split (and before `max_documents` picks its sample).
        validation_fraction: Share of documents held out; the split is by document, so no file is in both.
        max_documents: Read only this many documents (a seeded sample), to keep quick runs quick.

    Returns:
        "train" and "validation" splits with columns "text" and "path" (relative to the stdlib root).
    """
    if max_documents is not None and max_documents < 2:
        raise ValueError(f"`max_documents` must be >= 2 (one train and one validation document), got {max_documents}.")
    root = stdlib_root()
    files = stdlib_source_files()
    random.Random(seed).shuffle(files)
    texts, paths = [], []
    for path in files:
        if max_documents is not None and len(texts) == max_documents:
            break
        text = read_source(path)
        if text is not None and text.strip():
            texts.append(text)
            paths.append(path.relative_to(root).as_posix())
    if not texts:
        raise ValueError(f"No readable .py files under the standard library at {root}.")
    return split_documents(datasets.Dataset.from_dict({"text": texts, "path": paths}), validation_fraction, seed=None)


def load_text_dataset(
    source: str | None,
    text_column: str = "text",
    *,
    seed: int = 0,
    validation_fraction: float = 0.05,
    max_documents: int | None = None,
    config_name: str | None = None,
    **load_kwargs: Any,
) -> datasets.DatasetDict:
    """Training text from wherever it is, as "train" / "validation" splits with a "text" column.

    Args:
        source: `None` for `load_embedded_corpus`; a local file or glob (`data/*.jsonl`) whose extension picks the
            builder (.txt/.text -> text, .json/.jsonl -> json, .csv -> csv, .parquet -> parquet); otherwise a Hub
            dataset name, downloaded by `datasets` only because the caller named it.
        text_column: Column holding the text; renamed to "text", other columns are dropped.
        seed: Seeds the validation split when the source has none (and the embedded corpus' shuffle).
        validation_fraction: Held-out share when the source has no "validation" split.
        max_documents: Keep at most this many documents (the first ones, before splitting).
        config_name: The Hub dataset's configuration (e.g. "wikitext-2-raw-v1").
        **load_kwargs: Passed to `datasets.load_dataset` (e.g. `sample_by="document"` for .txt files).

    Raises:
        ValueError: A local file that does not exist, an extension with no builder, a dataset with no non-blank
            text, or a `text_column` that is not there (the message lists the columns that are).
    """
    if source is None:
        return load_embedded_corpus(seed, validation_fraction, max_documents)
    loaded = _loaded_splits(source, config_name, load_kwargs)
    splits = {
        name: _text_split(loaded[name], name, source, text_column, max_documents)
        for name in ("train", "validation")
        if name in loaded
    }
    if len(splits["train"]) == 0:
        raise ValueError(f"{source!r} holds no non-blank text in column {text_column!r}.")
    if "validation" in splits and len(splits["validation"]) > 0:
        return datasets.DatasetDict(splits)
    return split_documents(splits["train"], validation_fraction, seed=seed)


def _loaded_splits(source: str, config_name: str | None, load_kwargs: dict[str, Any]) -> datasets.DatasetDict:
    """The splits of a local file (its builder picked by extension) or a Hub dataset, checked to have "train"."""
    builder, data_files = local_builder(source)
    if builder is not None:
        loaded = datasets.load_dataset(builder, data_files=data_files, **load_kwargs)
    else:
        loaded = datasets.load_dataset(source, config_name, **load_kwargs)
    if not isinstance(loaded, datasets.DatasetDict):  # `split=` in load_kwargs returns a single Dataset
        loaded = datasets.DatasetDict({"train": loaded})
    if "train" not in loaded:
        raise ValueError(f"{source!r} has no 'train' split; it has {sorted(loaded)}.")
    return loaded


def _text_split(
    split: datasets.Dataset, name: str, source: str, text_column: str, max_documents: int | None
) -> datasets.Dataset:
    """One split reduced to a "text" column of non-blank documents (the training split cut to `max_documents`)."""
    if text_column not in split.column_names:
        raise ValueError(
            f"{source!r} has no column {text_column!r}; its columns are {split.column_names}. "
            "Name one of them with --text-column (text_column: in a config file)."
        )
    split = split.select_columns([text_column])
    if text_column != "text":
        split = split.rename_column(text_column, "text")
    if name == "train" and max_documents is not None:
        split = split.select(range(min(max_documents, len(split))))
    # Blank lines of a .txt file (and empty cells) are not documents: they would pack as bare separators.
    return split.filter(
        lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True, desc=f"{name}: skip blank text"
    )


def iter_texts(dataset: datasets.Dataset, column: str = "text", batch_size: int = 1000) -> Iterable[str]:
    """The texts of `dataset`, read in batches each time they are iterated: `train_tokenizer` streams them once per
    pass (an encoder's WordPiece takes two) without holding the corpus in memory."""
    return _BatchedTexts(dataset, column, batch_size)


@dataclass(frozen=True)
class _BatchedTexts:
    dataset: datasets.Dataset
    column: str
    batch_size: int

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self.dataset), self.batch_size):
            yield from self.dataset[start : start + self.batch_size][self.column]


def split_documents(dataset: datasets.Dataset, validation_fraction: float, seed: int | None) -> datasets.DatasetDict:
    """Hold out whole documents; `seed=None` keeps the given order (already shuffled) and takes the head."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"`validation_fraction` must be in [0, 1), got {validation_fraction}.")
    count = len(dataset)
    held_out = min(max(round(count * validation_fraction), 1 if validation_fraction > 0 else 0), count - 1)
    order = list(range(count))
    if seed is not None:
        random.Random(seed).shuffle(order)
    return datasets.DatasetDict(
        {"train": dataset.select(order[held_out:]), "validation": dataset.select(order[:held_out])}
    )


# ---------------------------------------------------------------------------------------------------------------------
# Tokenization and packing
# ---------------------------------------------------------------------------------------------------------------------


def tokenize_dataset(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    text_column: str = "text",
    max_length: int | None = None,
    add_special_tokens: bool = True,
    batch_size: int = 1000,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Replace the text with an "input_ids" column.

    Args:
        max_length: Cut each document into consecutive windows of at most `max_length` ids, the tokenizer's special
            tokens added to every window (`[CLS] .. [SEP]`, `<s> .. </s>`), so a long file becomes several examples
            instead of losing its tail. `None` keeps whole documents (for `pack_into_blocks`).
        add_special_tokens: `False` for the decoder before packing; its separators come from `pack_into_blocks`.

    Literal special-token text in a document ("</s>" in an HTML helper's source) is split like ordinary text, so
    only the pipeline places control tokens.
    """
    if max_length is not None:
        prefix, suffix = special_tokens_around(tokenizer) if add_special_tokens else ([], [])
        width = max_length - len(prefix) - len(suffix)
        if width < 1:
            raise ValueError(
                f"Windows of {max_length} ids leave no room beside the tokenizer's {len(prefix) + len(suffix)} "
                f"special tokens; use a larger block size."
            )

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(
            batch[text_column],
            add_special_tokens=add_special_tokens and max_length is None,
            split_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,  # no "longer than the maximum sequence length": documents are windowed or packed after
        )["input_ids"]
        if max_length is None:
            return {"input_ids": encoded}
        # Cut here rather than through the tokenizer's `return_overflowing_tokens`: tokenizers 0.23.2 returns only
        # a sliver of the first overflow, which silently dropped the rest of every long document.
        return {
            "input_ids": [prefix + ids[at : at + width] + suffix for ids in encoded for at in range(0, len(ids), width)]
        }

    settings = dict(text_column=text_column, max_length=max_length, add_special_tokens=add_special_tokens)
    return dataset.map(
        encode,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        new_fingerprint=tokenization_fingerprint(dataset, tokenizer, encode, settings),
        desc="tokenizing" if max_length is None else f"tokenizing into windows of {max_length}",
    )


def tokenization_fingerprint(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    encode: Callable[[dict[str, list]], dict[str, list]],
    settings: dict[str, Any],
) -> str | None:
    """The cache key of `tokenize_dataset`'s map, from what decides what it writes: the dataset's own fingerprint,
    the tokenizer's content (its class and its fast backend's serialisation: vocabulary, normalizer, special tokens),
    the code that encodes and its settings. datasets' default hashes the tokenizer object, the folder it was loaded
    from included, so the same tokenizer from another folder (each rank's copy of the one the main process trained,
    a resumed run's checkpoint) missed the main process's cache and tokenized the whole text again. None, datasets'
    own, for a tokenizer without a fast backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return Hasher.hash([dataset._fingerprint, type(tokenizer).__name__, backend.to_str(), encode.__code__, settings])


def special_tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after one sequence: `[CLS]` and `[SEP]`, `<s>` and `</s>`, or none."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    wrapped = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(wrapped) - len(plain) + 1):
        if plain and wrapped[start : start + len(plain)] == plain:
            return wrapped[:start], wrapped[start + len(plain) :]
    raise ValueError(
        f"The tokenizer's special tokens do not wrap a sequence ({probe!r} -> {plain} alone, {wrapped} with special "
        f"tokens); windows need a template of the form `prefix $A suffix`."
    )


def best_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `capacity`: best-fit decreasing (longest first, each into the
    row it fills most; TRL's "bfd"). Deterministic: ties keep the input order. Rows come out in the order opened."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row) sorted: the first with room >= length is the best fit
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        if length > capacity:
            raise ValueError(f"A window of {length} ids does not fit a row of {capacity}.")
        spot = bisect.bisect_left(free, (length, -1))
        if spot == len(free):
            rows.append([])
            room, row = capacity, len(rows) - 1
        else:
            room, row = free.pop(spot)
        rows[row].append(index)
        if room - length > 0:
            bisect.insort(free, (room - length, row))
    return rows


def pack_windows(
    dataset: datasets.Dataset, block_size: int, *, batch_size: int = 1000, num_proc: int | None = None
) -> datasets.Dataset:
    """Whole windows ("input_ids", each at most `block_size` ids) packed into rows of at most `block_size`.

    Each `map` batch of `batch_size` windows is packed on its own (`best_fit_rows`), so a row's unfilled room is at
    most what the batch's last rows leave; no window is cut.

    Returns:
        "input_ids" (the row's windows one after another) and "lengths" (each window's length, in order).
    """

    def pack(batch: dict[str, list]) -> dict[str, list]:
        windows = batch["input_ids"]
        rows = best_fit_rows([len(window) for window in windows], block_size)
        return {
            "input_ids": [list(chain.from_iterable(windows[i] for i in row)) for row in rows],
            "lengths": [[len(windows[i]) for i in row] for row in rows],
        }

    return dataset.map(
        pack,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        desc=f"packing windows into rows of {block_size}",
    )


def row_documents(example: dict[str, Any]) -> list[torch.Tensor]:
    """The documents of a `pack_windows` row, each 1-D."""
    return list(torch.split(as_ids(example), [int(length) for length in example["lengths"]]))


def packed_rows(
    rows: Sequence[Sequence[torch.Tensor]], pad_value: int, *, tail: int = 0, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of documents -> (values (B, L), position_ids (B, L)) with positions restarting at 0 at each document.

    L is `length`, or the longest row plus `tail`; a row shorter than L ends in `pad_value`, laid out as one more
    document (its positions restart too, so no real document attends to it). `tail=1` gives every row such a
    document: seq2seq pairs decoder document i with encoder document i, so both sides must count their tails alike.
    """
    totals = [sum(len(document) for document in row) for row in rows]
    width = length if length is not None else max(totals, default=0) + tail
    values = torch.full((len(rows), width), pad_value, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        lengths = [len(document) for document in row] + ([width - totals[index]] if width > totals[index] else [])
        if totals[index]:
            values[index, : totals[index]] = torch.cat(list(row))
        positions[index] = torch.cat([torch.arange(count) for count in lengths])
    return values, positions


def pad_sequences(sequences: Sequence[torch.Tensor], value: int, multiple: int | None = None) -> torch.Tensor:
    """Right-pad 1-D tensors to one length (rounded up to `multiple`); (B, T)."""
    length = max((len(s) for s in sequences), default=0)
    if multiple:
        length = math.ceil(length / multiple) * multiple
    out = torch.full((len(sequences), length), value, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        out[row, : len(sequence)] = sequence
    return out


def as_ids(example: dict[str, Any], key: str = "input_ids") -> torch.Tensor:
    return torch.as_tensor(example[key], dtype=torch.long).reshape(-1)


@dataclass(kw_only=True)
class SeededCollator:
    """Randomness from a private `torch.Generator`, never the global RNG.

    In the main process (`num_workers=0`, the Trainer default) one stream seeded with `seed` runs through every
    epoch. A DataLoader worker holds a copy of the collator made when the epoch's iterator starts, so it reseeds from
    `seed` and the worker's own seed, which differs per worker and per epoch (and follows `torch.manual_seed`);
    otherwise every worker, every epoch, would repeat the same masks. A `pinned` copy draws from its seed alone,
    in any process: for callers that seed each batch themselves.
    """

    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _worker_seed: int | None = field(default=None, init=False, repr=False)
    _pinned: bool = field(default=False, init=False, repr=False)

    def pinned(self, seed: int) -> "SeededCollator":
        """A copy drawing from `seed` alone, whichever process or DataLoader worker calls it: pretraining seeds each
        global batch from its number (batches.py), and the worker that happens to build it must not change it."""
        pinned = copy.copy(self)  # not dataclasses.replace: __post_init__'s tables (vocabulary-sized) stay shared
        pinned.seed, pinned._generator, pinned._pinned = seed, torch.Generator().manual_seed(seed), True
        return pinned

    @property
    def generator(self) -> torch.Generator:
        if self._pinned:
            return self._generator
        info = torch.utils.data.get_worker_info()
        worker_seed = None if info is None else info.seed
        if self._generator is None or self._worker_seed != worker_seed:
            seed = self.seed if worker_seed is None else hash((self.seed, worker_seed)) % 2**63
            self._generator = torch.Generator().manual_seed(seed)
            self._worker_seed = worker_seed
        return self._generator
