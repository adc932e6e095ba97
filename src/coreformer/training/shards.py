"""Token shards: text tokenized once into flat files of token ids, which pretraining reads through memory maps.

    write_shards(settings, tokenizer) -> manifest     `coreformer tokenize`: load, split, tokenize in parallel, shard,
                                                      resume
    ShardedTokens(folder, split="train")              one split's documents and windows by index, memory-mapped
    check_tokenizer(manifest, tokenizer)              ShardsError naming both tokenizers when they differ
    read_manifest(folder) -> dict
    tokenizer_hash(tokenizer) -> "sha256:..."         the tokenizer's content, whichever folder it was loaded from
    token_dtype(vocab_size) -> uint16 | uint32        the narrowest type holding every id
    is_held_out(text, fraction, seed) -> bool         a document's split, from its text alone

The folder (FORMAT_VERSION 1):

    OUT/
      manifest.json         format, recipe (source files and sizes, --text-column, --shard-tokens, ...), tokenizer
                            (name, content hash, vocabulary size), dtype, totals, and per split its completed shards
                            (files, tokens, documents, source position, checksum); "complete" once all are written
      train-00000.bin       token ids, raw little-endian uint16 (every id < 65536) or uint32, documents back to back
      train-00000.idx       little-endian uint64: where each document of the .bin ends, counted in tokens
      train-00001.bin/.idx  ...
      validation-00000.bin/.idx
      tokenizer/            the tokenizer the ids come from (saved once the shards are complete): pretraining on the
                            folder (--data-dir) loads it from here

    train-00000.bin   [ a a a a | b b | c c c c c | d ... ]      a document's ids: bin[idx[i-1] : idx[i]]
    train-00000.idx   [ 4, 6, 11, ... ]                          (idx[-1] taken as 0)

Boundaries are offsets beside the ids, not a separator id among them. A separator needs an id the vocabulary has and
the text never produces; WordPiece vocabularies have no end-of-text token, and each objective puts its own tokens
between documents (`</s>` when the decoder packs, `[CLS] .. [SEP]` around an encoder's windows, nothing when packed
rows restart their positions). So the ids are the tokenizer's plain ones (no special tokens; literal special-token
text split like any text, as `tokenize_dataset` does) and a reader adds what its objective wants. Offsets hold for any
vocabulary and give document i without a scan (8 bytes per document).

A shard holds whole documents: it is closed once it holds at least --shard-tokens ids (so a document longer than that
is a shard of its own). The held-out split is the source's own validation split when it has one; otherwise a
document goes there when the hash of its text, salted with --seed, falls under --validation-fraction
(`is_held_out`): decided by the text alone, so the same on every run, for any number of processes or ranks, and
identical documents never straddle the two splits.

Writing and resuming. The main process reads the documents in order, in chunks; --num-proc workers (a process pool,
two chunks each in flight) tokenize them, and the main process appends the results in source order, so the files do
not depend on --num-proc. A shard is written under a temporary name and renamed when whole, then the manifest
(rewritten whole, by rename) records it with its checksum and the source position after its last document. A rerun
checks every recorded shard (sizes and checksum), keeps each split's shards up to the first that fails, and reads the
source again from the earliest position a split needs, skipping documents their split already holds: the files come
out byte for byte as from a run never stopped.
"""

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
from bisect import bisect_right
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np
from transformers import PreTrainedTokenizerBase

from coreformer_settings.tokenizing import (
    FORMAT_VERSION,
    MANIFEST,
    TOKENIZER_DIR,
    ShardsError,
    TokenizeSettings,
    check_output_folder,
    check_same_recipe,
)

SPLITS = ("train", "validation")
ChunkT = TypeVar("ChunkT")
CHUNK_DOCUMENTS = 512  # documents per task handed to a worker: large enough to amortise the pickling
IN_FLIGHT_PER_WORKER = 2  # chunks queued per worker: keeps them busy while the source's text stays out of memory
OFFSET_DTYPE = np.dtype("<u8")
CHECKSUM_BYTES = 16  # a shard's blake2b over its .bin then its .idx: to notice a damaged file, not to resist forgery


# ---------------------------------------------------------------------------------------------------------------------
# What the manifest records: dtype, tokenizer identity, splits
# ---------------------------------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0 .. vocab_size - 1) fits in it, else uint32; little-endian on every machine."""
    for dtype in ("<u2", "<u4"):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ShardsError(f"A vocabulary of {vocab_size} ids does not fit in uint32.")


def file_dtype(manifest: Mapping[str, Any]) -> np.dtype:
    """The manifest's dtype as the files hold it: little-endian whatever the machine reading them."""
    return np.dtype(manifest["dtype"]).newbyteorder("<")


def vocabulary_size(tokenizer: PreTrainedTokenizerBase) -> int:
    """One past the largest id the tokenizer can produce (added tokens included)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """`sha256:<hex>` of what decides the ids: the fast backend's serialisation (normalizer, pre-tokenizer, model,
    added tokens), or the vocabulary and special tokens of a tokenizer without one. The same tokenizer loaded from
    another folder hashes the same (the path is not in it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        content = json.loads(backend.to_str())
        # Call state, not content: a call with truncation=True or padding leaves them set on the backend.
        content.pop("truncation", None)
        content.pop("padding", None)
    else:
        content = {
            "class": type(tokenizer).__name__,
            "vocab": tokenizer.get_vocab(),
            "special": tokenizer.all_special_tokens,
        }
    return "sha256:" + hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def tokenizer_record(tokenizer: PreTrainedTokenizerBase, name: str) -> dict[str, Any]:
    size = vocabulary_size(tokenizer)
    return {"name": name, "hash": tokenizer_hash(tokenizer), "class": type(tokenizer).__name__, "vocab_size": size}


def check_tokenizer(
    manifest: Mapping[str, Any] | str | Path, tokenizer: PreTrainedTokenizerBase, *, name: str | None = None
) -> None:
    """Raise ShardsError naming both tokenizers when `tokenizer` is not the one the shards were made with (by
    content: the same tokenizer from another folder passes). `manifest` is a manifest or its shard folder; `name` is
    how the caller's tokenizer is named in the message (default: the folder it was loaded from)."""
    if not isinstance(manifest, Mapping):
        manifest = read_manifest(manifest)
    recorded = manifest["tokenizer"]
    given = tokenizer_hash(tokenizer)
    if given != recorded["hash"]:
        name = name or tokenizer.name_or_path or type(tokenizer).__name__
        raise ShardsError(
            f"the shards were made by tokenizer {recorded['name']!r} ({_short(recorded['hash'])}), not by {name!r} "
            f"({_short(given)}): use the tokenizer they were made with, or tokenize the text again with this one "
            f"into another folder."
        )


def _short(digest: str) -> str:
    return digest[: len("sha256:") + 12]


def is_held_out(text: str, fraction: float, seed: int) -> bool:
    """True when the document goes to the validation split: its salted hash, read as a number in [0, 1), falls under
    `fraction`. The text alone decides, never its position or the process reading it."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a shard folder; ShardsError when there is none, or of another format."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise ShardsError(f"{folder} holds no {MANIFEST}: not a shard folder (write one with `coreformer tokenize`).")
    manifest = check_output_folder(folder)
    assert manifest is not None  # the folder holds a manifest, so it is not empty
    return manifest


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Rewrite the manifest whole: a reader (or a rerun) sees the previous one or this one, never a mix."""
    for split in manifest["splits"].values():
        split["documents"] = sum(shard["documents"] for shard in split["shards"])
        split["tokens"] = sum(shard["tokens"] for shard in split["shards"])
    manifest["documents"] = sum(split["documents"] for split in manifest["splits"].values())
    manifest["tokens"] = sum(split["tokens"] for split in manifest["splits"].values())
    temporary = folder / f".{MANIFEST}.tmp"
    temporary.write_text(json.dumps(manifest, indent=2) + "\n")
    _replace(temporary, folder / MANIFEST)


def _replace(temporary: Path, final: Path) -> None:
    """Rename a written file into place, its bytes on disk first (a crash after the rename cannot leave it empty)."""
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, final)


# ---------------------------------------------------------------------------------------------------------------------
# Writing: the driver
# ---------------------------------------------------------------------------------------------------------------------


def write_shards(
    settings: TokenizeSettings, tokenizer: PreTrainedTokenizerBase, *, progress: bool = True
) -> dict[str, Any]:
    """Tokenize `settings.source` into shards in `settings.out`, continuing the shards a previous run left there.

    Returns:
        The final manifest ("complete": true).

    Raises:
        ShardsError: OUT is not a shard folder, or holds shards of another source, settings or tokenizer; the source
            cannot be loaded or holds no text.
    """
    out = Path(settings.out).expanduser()
    manifest = _continued_manifest(out, settings, tokenizer)
    if manifest is not None and manifest["complete"]:  # every shard recorded and intact: nothing to read again
        return manifest
    source = _Source.load(settings)  # before the first write: a source that does not load leaves OUT as it was
    if manifest is None:
        manifest = _new_manifest(out, settings, tokenizer, source)
    writers = {split: _SplitWriter(out, split, manifest, settings.shard_tokens) for split in SPLITS}
    resume = {split: writer.resume_position for split, writer in writers.items()}
    start = min(resume.values())  # the earliest document a split still needs
    encoder = Encoder(tokenizer, file_dtype(manifest))
    with _progress_bar(source.count, start, out, progress) as bar:
        chunks = source.chunks(start, resume, settings)
        for chunk, (ids, lengths) in encoded_chunks(encoder, chunks, settings.num_proc):
            _append(chunk, ids, lengths, writers)
            bar.update(chunk.read)
    for writer in writers.values():
        writer.finish_shard()
    _save_tokenizer(tokenizer, out)
    manifest["complete"] = True
    _write_manifest(out, manifest)
    return manifest


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """A copy of the tokenizer beside the shards (OUT/tokenizer): pretraining on them loads it from there, wherever
    the folder it came from has gone. Written under a temporary name and renamed, as the shards are."""
    temporary, final = out / f".{TOKENIZER_DIR}.tmp", out / TOKENIZER_DIR
    shutil.rmtree(temporary, ignore_errors=True)
    tokenizer.save_pretrained(temporary)
    shutil.rmtree(final, ignore_errors=True)
    temporary.rename(final)


def _continued_manifest(
    out: Path, settings: TokenizeSettings, tokenizer: PreTrainedTokenizerBase
) -> dict[str, Any] | None:
    """The manifest of the shards in `out`, checked (recipe, tokenizer, every shard's bytes) and without the shards
    to write again; None when `out` holds none yet."""
    manifest = check_output_folder(out)
    if manifest is None:
        return None
    check_same_recipe(manifest, settings)
    check_tokenizer(manifest, tokenizer, name=settings.tokenizer)
    # A shard a stopped run was writing (.NAME.tmp) is written again under the same name, so it is left to that.
    _keep_intact_shards(out, manifest)
    return manifest


def _new_manifest(
    out: Path, settings: TokenizeSettings, tokenizer: PreTrainedTokenizerBase, source: "_Source"
) -> dict[str, Any]:
    """A new folder's manifest, written before any shard, so that a folder holding anything of ours holds one."""
    out.mkdir(parents=True, exist_ok=True)
    record = tokenizer_record(tokenizer, settings.tokenizer)
    manifest = {
        "format": FORMAT_VERSION,
        "recipe": settings.recipe(),
        "tokenizer": record,
        "dtype": token_dtype(record["vocab_size"]).name,  # "uint16" / "uint32"; the files are little-endian
        "held_out": source.held_out_rule,  # "hash" or "source split"
        "documents": 0,
        "tokens": 0,
        "splits": {split: {"documents": 0, "tokens": 0, "shards": []} for split in SPLITS},
        "complete": False,
    }
    _write_manifest(out, manifest)
    return manifest


def _keep_intact_shards(out: Path, manifest: dict[str, Any]) -> None:
    """Drop, per split, the first recorded shard whose files are missing or differ from their checksum, and every
    shard after it: those are written again (the source position of the last one kept says where to read from)."""
    itemsize = file_dtype(manifest).itemsize
    for split in manifest["splits"].values():
        kept = []
        for shard in split["shards"]:
            if not _intact(out, shard, itemsize):
                break
            kept.append(shard)
        if len(kept) < len(split["shards"]):
            split["shards"] = kept
            manifest["complete"] = False
    _write_manifest(out, manifest)


def _intact(out: Path, shard: dict[str, Any], itemsize: int) -> bool:
    ids, offsets = out / shard["file"], out / shard["index"]
    if not (ids.is_file() and offsets.is_file()):
        return False
    if ids.stat().st_size != shard["tokens"] * itemsize or offsets.stat().st_size != shard["documents"] * 8:
        return False
    checksum = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    for path in (ids, offsets):
        with open(path, "rb") as handle:
            while block := handle.read(1 << 24):
                checksum.update(block)
    return "blake2b:" + checksum.hexdigest() == shard["checksum"]


@contextmanager
def _progress_bar(total: int, done: int, out: Path, enabled: bool) -> Iterator[Any]:
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=done, desc=f"tokenizing into {out}", unit="doc", disable=not enabled)
    try:  # Ctrl-C: the bar ends on its line before the command's message
        yield bar
    finally:
        bar.close()


# ---------------------------------------------------------------------------------------------------------------------
# Writing: the source, read in chunks
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    """Documents read together: where each sits in the source and its split (the text goes to the tokenizer)."""

    positions: list[int] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    read: int = 0  # documents of the source it covers, those skipped included (the progress bar's step)


@dataclass(frozen=True)
class _Source:
    """The source's documents as one sequence: its training split, then its own validation split if it has one.
    A document's position in it is what a shard records as where to read from again."""

    parts: tuple[tuple[str | None, Any], ...]  # (split every document goes to, or None: decided by hash; dataset)
    held_out_rule: str

    @classmethod
    def load(cls, settings: TokenizeSettings) -> "_Source":
        from .data import load_text_dataset

        try:
            # validation_fraction 0 and seed None: the source's splits as they are, in their order (no shuffle)
            splits = load_text_dataset(
                settings.source,
                settings.text_column,
                seed=None,
                validation_fraction=0.0,
                config_name=settings.dataset_config,
            )
        except ValueError as error:
            raise ShardsError(str(error)) from error
        except Exception as error:  # DatasetNotFoundError, ConnectionError offline, FileNotFoundError, ...
            raise ShardsError(f"Cannot load {settings.source!r}: {type(error).__name__}: {error}") from error
        if len(splits["validation"]):
            return cls((("train", splits["train"]), ("validation", splits["validation"])), "source split")
        return cls(((None, splits["train"]),), "hash")

    @property
    def count(self) -> int:
        return sum(len(dataset) for _, dataset in self.parts)

    def chunks(self, start: int, resume: dict[str, int], settings: TokenizeSettings) -> Iterator[_Chunk]:
        """The documents from position `start` on, in chunks, each with its split; a document its split already
        holds (before `resume[split]`) is counted as read and not tokenized again."""
        offset = 0
        for split, dataset in self.parts:
            for first in range(max(start - offset, 0), len(dataset), CHUNK_DOCUMENTS):
                texts = dataset[first : first + CHUNK_DOCUMENTS]["text"]
                chunk = _Chunk(read=len(texts))
                for position, text in enumerate(texts, start=offset + first):
                    goes_to = split or (
                        "validation" if is_held_out(text, settings.validation_fraction, settings.seed) else "train"
                    )
                    if position >= resume[goes_to]:
                        chunk.positions.append(position)
                        chunk.splits.append(goes_to)
                        chunk.texts.append(text)
                yield chunk
            offset += len(dataset)


# ---------------------------------------------------------------------------------------------------------------------
# Writing: tokenizing, in this process or a pool
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoder:
    """Texts -> (their ids one after another, each text's count of ids): the plain ids, as tokenize_dataset makes
    them before packing (no special tokens; literal special-token text split like any other)."""

    tokenizer: PreTrainedTokenizerBase
    dtype: np.dtype

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if not texts:
            return np.empty(0, self.dtype), np.empty(0, np.int64)
        encoded = self.tokenizer(
            texts,
            add_special_tokens=False,
            split_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,  # no "longer than the maximum sequence length": documents are read whole
        )["input_ids"]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.fromiter(chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
        if ids.size and ids.max() > np.iinfo(self.dtype).max:  # the vocabulary size said otherwise
            raise ShardsError(f"The tokenizer produced id {ids.max()}, beyond the shards' {self.dtype.name}.")
        return ids.astype(self.dtype), lengths


_WORKER_ENCODER: Encoder | None = None  # each pool worker's, set once by _start_worker


def _start_worker(encoder: Encoder) -> None:
    global _WORKER_ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle: one line, not P tracebacks
    _WORKER_ENCODER = encoder


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _WORKER_ENCODER(texts)


def encoded_chunks(
    encoder: Encoder, chunks: Iterator[ChunkT], num_proc: int
) -> Iterator[tuple[ChunkT, tuple[np.ndarray, np.ndarray]]]:
    """Each chunk (anything with a `texts` list) with its ids, in the chunks' order: tokenized here for one process,
    by a pool otherwise, with at most IN_FLIGHT_PER_WORKER chunks per worker waiting (the text is read as fast as it is
    tokenized, no faster). Also how a streamed run tokenizes (streaming.py)."""
    if num_proc <= 1:
        for chunk in chunks:
            yield chunk, encoder(chunk.texts)
        return
    with _one_thread_per_worker(), multiprocessing.Pool(num_proc, _start_worker, (encoder,)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(_encode_in_worker, (chunk.texts,))))
            chunk.texts = []  # the worker holds them now
            if len(pending) >= IN_FLIGHT_PER_WORKER * num_proc:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


@contextmanager
def _one_thread_per_worker() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM=false while the pool forks: the processes are the parallelism (P workers each running
    a thread per core would oversubscribe the machine), and `tokenizers` then forks without its warning."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _append(chunk: _Chunk, ids: np.ndarray, lengths: np.ndarray, writers: dict[str, "_SplitWriter"]) -> None:
    """The chunk's documents, in order, each to its split's open shard; empty ones (nothing to train on) dropped."""
    ends = np.cumsum(lengths)
    for position, split, end, length in zip(chunk.positions, chunk.splits, ends, lengths, strict=True):
        if length:
            writers[split].add(ids[end - length : end], position)


# ---------------------------------------------------------------------------------------------------------------------
# Writing: one split's shards
# ---------------------------------------------------------------------------------------------------------------------


class _SplitWriter:
    """One split's shards: the completed ones (the manifest's list, which this appends to) and the open one, written
    to temporary files until it is closed."""

    def __init__(self, out: Path, split: str, manifest: dict[str, Any], shard_tokens: int):
        self.out, self.split, self.manifest, self.shard_tokens = out, split, manifest, shard_tokens
        self.shards: list[dict[str, Any]] = manifest["splits"][split]["shards"]
        # documents of this split before this position are in its completed shards
        self.resume_position = self.shards[-1]["source_end"] if self.shards else 0
        self._ids: BinaryIO | None = None
        self._ends: list[int] = []
        self._checksum = hashlib.blake2b(digest_size=CHECKSUM_BYTES)

    @property
    def _name(self) -> str:
        return f"{self.split}-{len(self.shards):05d}"

    def add(self, ids: np.ndarray, position: int) -> None:
        if self._ids is None:
            self._ids = open(self.out / f".{self._name}.bin.tmp", "wb")  # noqa: SIM115  (closed by finish_shard)
            self._ends, self._checksum = [], hashlib.blake2b(digest_size=CHECKSUM_BYTES)
        data = ids.tobytes()
        self._ids.write(data)
        self._checksum.update(data)
        self._ends.append((self._ends[-1] if self._ends else 0) + len(ids))
        self.resume_position = position + 1
        if self._ends[-1] >= self.shard_tokens:
            self.finish_shard()

    def finish_shard(self) -> None:
        """Close the open shard, if any: both files renamed into place, then recorded in the manifest."""
        if self._ids is None:
            return
        self._ids.close()
        self._ids = None
        name = self._name
        offsets = np.asarray(self._ends, dtype=OFFSET_DTYPE).tobytes()
        self._checksum.update(offsets)
        (self.out / f".{name}.idx.tmp").write_bytes(offsets)
        for suffix in (".bin", ".idx"):
            _replace(self.out / f".{name}{suffix}.tmp", self.out / f"{name}{suffix}")
        self.shards.append(
            {
                "file": f"{name}.bin",
                "index": f"{name}.idx",
                "tokens": self._ends[-1],
                "documents": len(self._ends),
                "source_end": self.resume_position,  # read from here again to write the next shard
                "checksum": "blake2b:" + self._checksum.hexdigest(),
            }
        )
        _write_manifest(self.out, self.manifest)


# ---------------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------------


class ShardedTokens:
    """The documents of one split of a shard folder, read through memory maps: indexing touches only the pages it
    reads, whatever the corpus' size. Pickles without its maps (a DataLoader worker opens its own).

        tokens = ShardedTokens("data/shards")            # the train split; split="validation" for the held-out one
        len(tokens), tokens.num_tokens                   # documents, ids
        tokens[i]                                        # document i's ids, (n,) uint16/uint32, read-only
        tokens.window(j, length)                         # ids [j * length, (j + 1) * length) of the split's stream,
                                                         # documents one after another across shards, (length,)
        tokens.document_starts(start, stop)              # where documents begin in [start, stop) of that stream
    """

    def __init__(
        self, folder: str | Path, split: str = "train", *, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        if not self.manifest["complete"]:
            raise ShardsError(
                f"{self.folder} is not complete: `coreformer tokenize` stopped before its last shard; run it again."
            )
        if split not in self.manifest["splits"]:
            raise ShardsError(f"{self.folder} has no split {split!r}; it has {', '.join(self.manifest['splits'])}.")
        if tokenizer is not None:
            check_tokenizer(self.manifest, tokenizer)
        self.split = split
        self.dtype = file_dtype(self.manifest)
        self.shards = self.manifest["splits"][split]["shards"]
        # Where each shard's documents and ids start in the split: shard k holds documents
        # [first_document[k], first_document[k + 1]) and ids [first_token[k], first_token[k + 1]).
        self.first_document = np.cumsum([0] + [shard["documents"] for shard in self.shards])
        self.first_token = np.cumsum([0] + [shard["tokens"] for shard in self.shards])

    def __len__(self) -> int:
        return int(self.first_document[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.first_token[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.document(index)

    def document(self, index: int) -> np.ndarray:
        """Document `index`'s ids, a view into its shard's map."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        index %= len(self)
        shard = bisect_right(self.first_document, index) - 1
        local = index - int(self.first_document[shard])
        ends = self._offsets[shard]
        start = int(ends[local - 1]) if local else 0
        return self._ids[shard][start : int(ends[local])]

    def lengths(self) -> np.ndarray:
        """Every document's length in ids, (documents,) int64: read from the .idx files alone (8 bytes a document)."""
        lengths = [np.diff(np.asarray(ends, dtype=np.int64), prepend=0) for ends in self._offsets]
        return np.concatenate(lengths) if lengths else np.empty(0, np.int64)

    def num_windows(self, length: int) -> int:
        return self.num_tokens // length

    def window(self, index: int, length: int) -> np.ndarray:
        """Ids [index * length, (index + 1) * length) of the split's documents laid end to end (nanoGPT's stream;
        `document_starts` says where documents begin in it). A view inside one shard, a copy across two."""
        if not 0 <= index < self.num_windows(length):
            raise IndexError(f"window {index} of {self.num_windows(length)} of {length} ids")
        start, stop = index * length, (index + 1) * length
        pieces = []
        shard = bisect_right(self.first_token, start) - 1
        while start < stop:
            base = int(self.first_token[shard])
            end = min(stop, int(self.first_token[shard + 1]))
            pieces.append(self._ids[shard][start - base : end - base])
            start, shard = end, shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Positions in the split's stream, within [start, stop), where a document begins; (n,) int64."""
        found = []
        first = max(bisect_right(self.first_token, start) - 1, 0)
        last = bisect_right(self.first_token, max(stop - 1, start))
        for shard in range(first, min(last, len(self.shards))):
            ends = np.asarray(self._offsets[shard], dtype=np.int64)
            starts = int(self.first_token[shard]) + np.concatenate(([0], ends[:-1]))
            found.append(starts[(starts >= start) & (starts < stop)])
        return np.concatenate(found) if found else np.empty(0, np.int64)

    @cached_property
    def _ids(self) -> list[np.memmap]:
        return [self._map(shard["file"], self.dtype, shard["tokens"]) for shard in self.shards]

    @cached_property
    def _offsets(self) -> list[np.memmap]:
        return [self._map(shard["index"], OFFSET_DTYPE, shard["documents"]) for shard in self.shards]

    def _map(self, name: str, dtype: np.dtype, count: int) -> np.memmap:
        path = self.folder / name
        if not path.is_file() or path.stat().st_size != count * dtype.itemsize:
            raise ShardsError(
                f"{path} is missing or not the size its manifest records: run `coreformer tokenize` again."
            )
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

    def __getstate__(self) -> dict[str, Any]:
        # the maps would pickle as copies of the data; each process opens its own
        return {key: value for key, value in self.__dict__.items() if key not in ("_ids", "_offsets")}
