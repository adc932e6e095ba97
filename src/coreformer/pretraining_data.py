"""Pretraining data: a corpus that needs no download, text loading, tokenization, and one collator per family.

    load_embedded_corpus(seed, validation_fraction, max_documents)  the Python standard library's own source files
    load_text_dataset(source, text_column, ...)                      embedded corpus | local file(s) | Hub dataset
    iter_texts(dataset)                                              the texts, for `train_tokenizer`
    tokenize_dataset(dataset, tokenizer, ...)                        text -> input_ids (long documents -> windows)
    pack_into_blocks(dataset, block_size, eos_token_id)              decoder: documents + </s> cut into full blocks

    MaskedLMCollator        encoder  BERT masking: 15% selected, of those 80% [MASK] / 10% random / 10% unchanged
    PackedCausalLMCollator  decoder  stacks packed blocks, labels = input_ids, optional per-document position_ids
    DenoisingCollator       seq2seq  BART: sentence permutation + text infilling (Poisson spans -> one <mask> each)

Their building blocks are public and tested alone: `mask_tokens`, `packed_position_ids`, `permute_sentences`,
`infill_spans`, `sentence_end_token_ids`.

Every collator is a dataclass called on a list of examples (dicts with "input_ids") that returns a dict of tensors.
Its randomness comes from its own `torch.Generator` seeded with `seed` (reseeded per DataLoader worker, see
`_SeededCollator`), so a run is reproducible without touching the global RNG.

The labels follow the models' contracts: the causal LM shifts labels inside its loss, so labels == input_ids; the
seq2seq model builds decoder_input_ids by shifting labels right (decoder_start_token_id = eos), so no collator
returns them. Nothing here imports the modeling files.
"""

import glob
import math
import os
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

# Directories of the standard library that are not its own prose and code: third-party packages, test suites (large,
# repetitive, full of deliberately broken text), and `encodings`, whose ~120 modules are generated charmap tables so
# alike that splitting them between train and validation would leak one into the other.
_SKIPPED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
)

# File extension -> `datasets` builder. A .txt file gives one example per line (pass `sample_by="document"` through
# `load_text_dataset(**load_kwargs)` for one per file).
_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}


# ---------------------------------------------------------------------------------------------------------------------
# Corpora
# ---------------------------------------------------------------------------------------------------------------------


def stdlib_source_files() -> list[Path]:
    """The standard library's .py files outside `_SKIPPED_STDLIB_DIRS`, sorted, so the list is the same every call."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in _SKIPPED_STDLIB_DIRS]  # prune the walk
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files)


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
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files()
    random.Random(seed).shuffle(files)
    texts, paths = [], []
    for path in files:
        if max_documents is not None and len(texts) == max_documents:
            break
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            texts.append(text)
            paths.append(path.relative_to(root).as_posix())
    if not texts:
        raise ValueError(f"No readable .py files under the standard library at {root}.")
    return _split_documents(datasets.Dataset.from_dict({"text": texts, "path": paths}), validation_fraction, seed=None)


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
    builder, data_files = _local_builder(source)
    if builder is not None:
        loaded = datasets.load_dataset(builder, data_files=data_files, **load_kwargs)
    else:
        loaded = datasets.load_dataset(source, config_name, **load_kwargs)
    if not isinstance(loaded, datasets.DatasetDict):  # `split=` in load_kwargs returns a single Dataset
        loaded = datasets.DatasetDict({"train": loaded})
    if "train" not in loaded:
        raise ValueError(f"{source!r} has no 'train' split; it has {sorted(loaded)}.")

    splits = {}
    for name in ("train", "validation"):
        if name not in loaded:
            continue
        split = loaded[name]
        if text_column not in split.column_names:
            raise ValueError(
                f"{source!r} has no column {text_column!r}; its columns are {split.column_names}. "
                "Pass `text_column=` with one of them."
            )
        split = split.select_columns([text_column])
        if text_column != "text":
            split = split.rename_column(text_column, "text")
        if name == "train" and max_documents is not None:
            split = split.select(range(min(max_documents, len(split))))
        # Blank lines of a .txt file (and empty cells) are not documents: they would pack as bare separators.
        splits[name] = split.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    if len(splits["train"]) == 0:
        raise ValueError(f"{source!r} holds no non-blank text in column {text_column!r}.")
    if "validation" in splits and len(splits["validation"]) > 0:
        return datasets.DatasetDict(splits)
    return _split_documents(splits["train"], validation_fraction, seed=seed)


def iter_texts(dataset: datasets.Dataset, column: str = "text", batch_size: int = 1000) -> Iterator[str]:
    """Yield the texts of `dataset` in batches (the iterator `train_tokenizer` consumes)."""
    for start in range(0, len(dataset), batch_size):
        yield from dataset[start : start + batch_size][column]


def _local_builder(source: str) -> tuple[str | None, list[str] | None]:
    """(builder, files) for a local source, (None, None) for a Hub name; raises the local-file ValueErrors."""
    path = Path(source).expanduser()
    is_glob = any(char in source for char in "*?[")
    files = sorted(glob.glob(str(path))) if is_glob else None
    suffix = path.suffix.lower()
    # A Hub name is "name" or "owner/name"; anything that exists, looks like a path, or ends in a data extension is
    # local, so a typo in a file name is reported here instead of becoming a Hub request.
    looks_local = (
        is_glob
        or path.exists()
        or source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or "\\" in source  # a Windows path; Hub names never hold a backslash
        or suffix in _BUILDERS
    )
    if not looks_local:
        return None, None
    if files is None:
        if not path.exists():
            raise ValueError(f"Local data file {source!r} does not exist.")
        if path.is_dir():
            raise ValueError(f"{source!r} is a directory; pass a file or a glob such as '{source}/*.jsonl'.")
        files = [str(path)]
    if not files:
        raise ValueError(f"No local data file matches {source!r}.")
    if suffix not in _BUILDERS:
        raise ValueError(
            f"Cannot load {source!r}: unknown extension {suffix or '(none)'!r}; expected one of {', '.join(_BUILDERS)}."
        )
    if all(os.path.getsize(file) == 0 for file in files):  # `datasets` fails on empty files with no useful message
        raise ValueError(f"{source!r} is empty: no text to train on.")
    return _BUILDERS[suffix], files


def _split_documents(dataset: datasets.Dataset, validation_fraction: float, seed: int | None) -> datasets.DatasetDict:
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
    windowed = max_length is not None

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(
            batch[text_column],
            add_special_tokens=add_special_tokens,
            truncation=windowed,
            max_length=max_length,
            return_overflowing_tokens=windowed,
            split_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return {"input_ids": encoded["input_ids"]}

    return dataset.map(
        encode, batched=True, batch_size=batch_size, num_proc=num_proc, remove_columns=dataset.column_names
    )


def pack_into_blocks(
    dataset: datasets.Dataset,
    block_size: int,
    *,
    eos_token_id: int,
    column: str = "input_ids",
    batch_size: int = 1000,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Concatenate tokenized documents, each followed by `eos_token_id`, and cut the stream into full blocks.

        doc0 </s> doc1 </s> doc2 </s> ...  ->  [block_size] [block_size] ...  (a block may start mid-document)

    No padding: each `map` batch of `batch_size` documents drops the tail that does not fill a block (as run_clm
    does), under one block per batch, so raise `batch_size` to waste less.

    Returns:
        A dataset with one "input_ids" column, every row exactly `block_size` long.
    """
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1, got {block_size}.")

    def pack(batch: dict[str, list]) -> dict[str, list]:
        stream = list(chain.from_iterable(chain(document, (eos_token_id,)) for document in batch[column]))
        usable = len(stream) - len(stream) % block_size
        return {"input_ids": [stream[start : start + block_size] for start in range(0, usable, block_size)]}

    return dataset.map(
        pack, batched=True, batch_size=batch_size, num_proc=num_proc, remove_columns=dataset.column_names
    )


def sentence_end_token_ids(
    tokenizer: PreTrainedTokenizerBase, endings: Sequence[str] = ("\n", ". ", "! ", "? ")
) -> tuple[int, ...]:
    """Ids of the tokens after which `DenoisingCollator` may cut a sentence: eos, and every token whose text holds
    one of `endings`.

    A line is the sentence by default: in a byte-level vocabulary the space after a full stop belongs to the next
    word ("Ġword"), so "." alone cannot tell "end." from "os.path" (which is most of the "." in a code corpus).
    """
    texts = tokenizer.batch_decode([[token_id] for token_id in range(len(tokenizer))])
    ids = {token_id for token_id, text in enumerate(texts) if any(ending in text for ending in endings)}
    ids -= set(tokenizer.all_special_ids)  # "<s>" holds no newline, but keep every control token out regardless
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


# ---------------------------------------------------------------------------------------------------------------------
# Collators
# ---------------------------------------------------------------------------------------------------------------------


def _pad(sequences: Sequence[torch.Tensor], value: int, multiple: int | None = None) -> torch.Tensor:
    """Right-pad 1-D tensors to one length (rounded up to `multiple`); (B, T)."""
    length = max((len(s) for s in sequences), default=0)
    if multiple:
        length = math.ceil(length / multiple) * multiple
    out = torch.full((len(sequences), length), value, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        out[row, : len(sequence)] = sequence
    return out


def _ids(example: dict[str, Any], key: str = "input_ids") -> torch.Tensor:
    return torch.as_tensor(example[key], dtype=torch.long).reshape(-1)


@dataclass(kw_only=True)
class _SeededCollator:
    """Randomness from a private `torch.Generator`, never the global RNG.

    In the main process (`num_workers=0`, the Trainer default) one stream seeded with `seed` runs through every
    epoch. A DataLoader worker holds a copy of the collator made when the epoch's iterator starts, so it reseeds from
    `seed` and the worker's own seed, which differs per worker and per epoch (and follows `torch.manual_seed`);
    otherwise every worker, every epoch, would repeat the same masks.
    """

    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _worker_seed: int | None = field(default=None, init=False, repr=False)

    @property
    def generator(self) -> torch.Generator:
        info = torch.utils.data.get_worker_info()
        worker_seed = None if info is None else info.seed
        if self._generator is None or self._worker_seed != worker_seed:
            seed = self.seed if worker_seed is None else hash((self.seed, worker_seed)) % 2**63
            self._generator = torch.Generator().manual_seed(seed)
            self._worker_seed = worker_seed
        return self._generator


def mask_tokens(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    *,
    mask_token_id: int,
    replacement_ids: torch.Tensor,
    generator: torch.Generator,
    mlm_probability: float = 0.15,
    mask_replace_prob: float = 0.8,
    random_replace_prob: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking (Devlin et al. 2019, section 3.1 and appendix C.2).

    Args:
        input_ids: (B, T) ids.
        maskable: (B, T) bool, False on special and padding tokens, which are never selected.
        replacement_ids: 1-D ids a "random token" is drawn from (the vocabulary without special tokens).

    Returns:
        (inputs, labels), both (B, T): each maskable token is selected with `mlm_probability`; a selected token
        becomes `mask_token_id` with `mask_replace_prob`, a random token with `random_replace_prob`, else stays.
        `labels` holds the original id where selected and -100 everywhere else.
    """
    selected = (torch.rand(input_ids.shape, generator=generator) < mlm_probability) & maskable  # (B, T)
    labels = input_ids.masked_fill(~selected, -100)
    # One uniform draw per token splits the selected ones 80 / 10 / 10 without a second Bernoulli on the rest.
    action = torch.rand(input_ids.shape, generator=generator)
    to_mask = selected & (action < mask_replace_prob)
    to_random = selected & (action >= mask_replace_prob) & (action < mask_replace_prob + random_replace_prob)
    random_ids = replacement_ids[torch.randint(len(replacement_ids), input_ids.shape, generator=generator)]
    inputs = input_ids.masked_fill(to_mask, mask_token_id)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, labels


@dataclass(kw_only=True)
class MaskedLMCollator(_SeededCollator):
    """Pads encoder examples and masks them for MLM; returns input_ids, attention_mask, labels (+ token_type_ids).

    Args:
        mask_token_id / pad_token_id / vocab_size: From the tokenizer (`from_tokenizer` reads them).
        special_token_ids: Never selected ([CLS], [SEP], ...); padding is excluded too, wherever it sits.
        mlm_probability, mask_replace_prob, random_replace_prob: BERT's 0.15 / 0.8 / 0.1.
        return_token_type_ids: Add zeros (or the examples' own) for models with `type_vocab_size > 0`.
        pad_to_multiple_of: Round the padded length up (tensor-core friendly shapes).
        seed: Seeds the masking; two collators with one seed mask the same batches alike.
    """

    mask_token_id: int
    pad_token_id: int
    vocab_size: int
    special_token_ids: tuple[int, ...] = ()
    mlm_probability: float = 0.15
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    return_token_type_ids: bool = False
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        for name in ("mlm_probability", "mask_replace_prob", "random_replace_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"`{name}` must be in [0, 1], got {getattr(self, name)}.")
        if self.mask_replace_prob + self.random_replace_prob > 1.0:
            raise ValueError("`mask_replace_prob + random_replace_prob` must be <= 1 (the rest stays unchanged).")
        never = set(self.special_token_ids) | {self.pad_token_id, self.mask_token_id}
        self._never_selected = torch.tensor(sorted(never), dtype=torch.long)
        self._replacement_ids = torch.tensor([i for i in range(self.vocab_size) if i not in never], dtype=torch.long)

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> "MaskedLMCollator":
        kwargs.setdefault("return_token_type_ids", "token_type_ids" in tokenizer.model_input_names)
        return cls(
            mask_token_id=tokenizer.mask_token_id,
            pad_token_id=tokenizer.pad_token_id,
            vocab_size=len(tokenizer),
            special_token_ids=tuple(tokenizer.all_special_ids),
            **kwargs,
        )

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [_ids(example) for example in examples]
        input_ids = _pad(ids, self.pad_token_id, self.pad_to_multiple_of)  # (B, T)
        if all("attention_mask" in example for example in examples):
            attention_mask = _pad([_ids(example, "attention_mask") for example in examples], 0, self.pad_to_multiple_of)
        else:
            attention_mask = _pad([torch.ones_like(i) for i in ids], 0, self.pad_to_multiple_of)
        special = torch.isin(input_ids, self._never_selected)
        inputs, labels = mask_tokens(
            input_ids,
            maskable=~special & attention_mask.bool(),
            mask_token_id=self.mask_token_id,
            replacement_ids=self._replacement_ids,
            generator=self.generator,
            mlm_probability=self.mlm_probability,
            mask_replace_prob=self.mask_replace_prob,
            random_replace_prob=self.random_replace_prob,
        )
        batch = {"input_ids": inputs, "attention_mask": attention_mask, "labels": labels}
        if self.return_token_type_ids:
            if all("token_type_ids" in example for example in examples):
                batch["token_type_ids"] = _pad(
                    [_ids(e, "token_type_ids") for e in examples], 0, self.pad_to_multiple_of
                )
            else:
                batch["token_type_ids"] = torch.zeros_like(input_ids)
        return batch


def packed_position_ids(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) positions that restart at 0 after every `eos_token_id` (and at the start of each block).

    Given with `attention_mask=None`, transformers' `find_packed_sequence_indices` (masking_utils.py) reads the
    restarts as document boundaries and keeps attention inside each document.
    """
    length = input_ids.shape[-1]
    steps = torch.arange(length).expand_as(input_ids)  # (B, T)
    after_eos = torch.zeros_like(input_ids, dtype=torch.bool)
    after_eos[:, 1:] = input_ids[:, :-1] == eos_token_id
    starts = torch.where(after_eos, steps, 0)
    return steps - torch.cummax(starts, dim=-1).values  # distance to the latest document start


@dataclass(kw_only=True)
class PackedCausalLMCollator:
    """Stacks `pack_into_blocks` rows; returns input_ids, labels (= input_ids; the model shifts) [, position_ids].

    No attention_mask: every block is full, and transformers only looks for packed documents in `position_ids` when
    the mask is None. With `return_position_ids=False` a block is one causal stream in which a document sees the
    end of the one before it (GPT-2 practice); with True each document attends only to itself.
    """

    eos_token_id: int | None = None
    return_position_ids: bool = False

    def __post_init__(self) -> None:
        if self.return_position_ids and self.eos_token_id is None:
            raise ValueError("`return_position_ids=True` needs `eos_token_id`: documents are found by their eos.")

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids = torch.stack([_ids(example) for example in examples])  # (B, block_size); rows must be equal
        batch = {"input_ids": input_ids, "labels": input_ids.clone()}
        if self.return_position_ids:
            batch["position_ids"] = packed_position_ids(input_ids, self.eos_token_id)
        return batch


def permute_sentences(ids: torch.Tensor, sentence_end_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Cut `ids` (1-D) after every sentence-end token and shuffle the pieces (BART's sentence permutation)."""
    ends = torch.isin(ids, sentence_end_ids).nonzero().flatten() + 1
    bounds = [0, *[int(end) for end in ends if end < len(ids)], len(ids)]
    sentences = [ids[start:stop] for start, stop in zip(bounds[:-1], bounds[1:])]
    if len(sentences) < 2:
        return ids
    order = torch.randperm(len(sentences), generator=generator)
    return torch.cat([sentences[i] for i in order])


def infill_spans(
    ids: torch.Tensor, *, mask_token_id: int, mask_ratio: float, poisson_lambda: float, generator: torch.Generator
) -> torch.Tensor:
    """BART's text infilling (Lewis et al. 2020, section 2.2): spans of Poisson(`poisson_lambda`) length covering
    ceil(`mask_ratio` * len) tokens each become ONE `mask_token_id`; a 0-length span inserts a mask.

    Spans never overlap, so exactly that many tokens are hidden: lay the kept tokens and the k spans out as
    (kept + k) slots and pick which k slots are spans uniformly; gaps between spans are free, so two spans may sit
    side by side (two masks in a row), as in fairseq.
    """
    length = len(ids)
    to_mask = math.ceil(length * mask_ratio)
    if to_mask == 0:
        return ids
    # Draw span lengths until they cover `to_mask`, then trim the last one (fairseq's add_whole_word_mask).
    drawn = torch.empty(0)
    while drawn.sum() < to_mask:
        drawn = torch.cat([drawn, torch.poisson(torch.full((to_mask,), poisson_lambda), generator=generator)])
    total = torch.cumsum(drawn, 0)
    count = int(torch.searchsorted(total, torch.tensor(float(to_mask)))) + 1  # first span reaching the budget
    spans = drawn[:count].long()
    spans[-1] -= int(total[count - 1]) - to_mask  # now sum(spans) == to_mask; the last span keeps >= 1 token

    spans = spans[torch.randperm(count, generator=generator)]  # the trimmed span may sit anywhere, not always last

    slots = length - to_mask + count
    is_span = torch.zeros(slots, dtype=torch.bool)
    is_span[torch.randperm(slots, generator=generator)[:count]] = True
    consumed = torch.ones(slots, dtype=torch.long)  # original tokens each slot covers: 1 kept, or its span length
    consumed[is_span] = spans
    starts = torch.cumsum(consumed, 0) - consumed  # (slots,) where each slot begins in `ids`
    # A 0-length span at the very end starts at `length`; clamp the gather, the slot is a mask anyway.
    return torch.where(is_span, mask_token_id, ids[starts.clamp(max=length - 1)])


@dataclass(kw_only=True)
class DenoisingCollator(_SeededCollator):
    """BART denoising: returns input_ids / attention_mask (the corrupted source, padded) and labels (the original
    document, padded with -100). decoder_input_ids come from the model shifting labels right.

    Each example is `<s> body </s>` (as `tokenize_dataset` writes it); `<s>` and `</s>` stay in place, the body's
    sentences are permuted, then spans are infilled over the permuted body.

    Args:
        mask_token_id / pad_token_id / bos_token_id / eos_token_id: From the tokenizer (`from_tokenizer`).
        sentence_end_ids: Tokens that end a sentence (see `sentence_end_token_ids`); empty turns permutation off.
        mask_ratio: Share of body tokens hidden (BART: 0.3).
        poisson_lambda: Mean span length (BART: 3).
        permute: Apply sentence permutation (BART's final model uses both).
    """

    mask_token_id: int
    pad_token_id: int
    bos_token_id: int | None
    eos_token_id: int | None
    sentence_end_ids: tuple[int, ...] = ()
    mask_ratio: float = 0.3
    poisson_lambda: float = 3.0
    permute: bool = True
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.mask_ratio <= 1.0:
            raise ValueError(f"`mask_ratio` must be in [0, 1], got {self.mask_ratio}.")
        if self.poisson_lambda <= 0:
            raise ValueError(f"`poisson_lambda` must be > 0, got {self.poisson_lambda}.")
        self._sentence_end_ids = torch.tensor(sorted(self.sentence_end_ids), dtype=torch.long)

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> "DenoisingCollator":
        kwargs.setdefault("sentence_end_ids", sentence_end_token_ids(tokenizer))
        return cls(
            mask_token_id=tokenizer.mask_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **kwargs,
        )

    def corrupt(self, ids: torch.Tensor) -> torch.Tensor:
        """The noised source for one 1-D example."""
        start = 1 if len(ids) and ids[0] == self.bos_token_id else 0
        stop = len(ids) - 1 if len(ids) > start and ids[-1] == self.eos_token_id else len(ids)
        body = ids[start:stop]
        if self.permute and len(self._sentence_end_ids):
            body = permute_sentences(body, self._sentence_end_ids, self.generator)
        body = infill_spans(
            body,
            mask_token_id=self.mask_token_id,
            mask_ratio=self.mask_ratio,
            poisson_lambda=self.poisson_lambda,
            generator=self.generator,
        )
        return torch.cat([ids[:start], body, ids[stop:]])

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        originals = [_ids(example) for example in examples]
        sources = [self.corrupt(ids) for ids in originals]
        input_ids = _pad(sources, self.pad_token_id, self.pad_to_multiple_of)  # (B, S)
        attention_mask = _pad([torch.ones_like(s) for s in sources], 0, self.pad_to_multiple_of)
        labels = _pad(originals, -100, self.pad_to_multiple_of)  # (B, L)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
