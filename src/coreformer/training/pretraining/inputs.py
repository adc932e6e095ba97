"""A pretraining run's inputs, checked before its first write (the driver's `prepare` and `build` call these).

    load_tokenizer / load_dataset_splits     a tokenizer or the text splits, their errors as one PretrainingError
    open_corpus(args, accelerator) -> Corpus    where the run's documents come from: TextCorpus (--dataset, or the
                                             embedded corpus), ShardCorpus (--data-dir) or StreamCorpus (--streaming);
                                             each gives the objective's examples, this process's training batches,
                                             the held-out text and the tokenizer the documents need
    shared_tokenizer                         a tokenizer trained once on the main process and handed to the others
    build_collator / build_model_config      the objective's collator; the family config, checked against
                                             --block-size and --packing (check_packing)
    input_token_count(batch, pad_token_id)   the real input tokens of a batch (throughput, MFU, token means)

Each raises one PretrainingError naming the problem and the fix; nothing here writes to the output folder.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from coreformer_settings.evaluation import HELD_OUT_DOCUMENTS
from coreformer_settings.tokenizing import check_shard_folder, shard_tokenizer

from ...hub.folders import MissingTokenizerError, folder_tokenizer
from ...layer_types import LAYER_TYPES
from ..arguments import PretrainingError
from ..batches import GlobalBatches, strided_loader
from ..data import iter_texts, load_text_dataset
from ..families import TRAINING_FACTS, longest_input
from ..objectives import Objective
from ..reports import data_line
from ..shards import ShardedTokens, check_tokenizer
from ..streaming import CHUNK_DOCUMENTS, StreamedBatches, StreamedText, StreamPosition
from ..tokenizer_training import token_config_kwargs
from .run import PretrainingArguments


def load_tokenizer(name_or_path: str, objective: Objective) -> PreTrainedTokenizerBase:
    """A tokenizer folder or Hub name, checked for the special tokens the objective needs."""
    try:
        tokenizer = folder_tokenizer(name_or_path)
    except MissingTokenizerError as error:
        raise PretrainingError(f"--tokenizer: {error} Or omit --tokenizer to train one.") from None
    except Exception as error:  # OSError for an unknown Hub name, ValueError for broken files
        raise PretrainingError(f"Cannot load tokenizer {name_or_path!r}: {error}") from error
    missing = [name for name in objective.required_tokens if getattr(tokenizer, name) is None]
    if missing:
        raise PretrainingError(
            f"Tokenizer {name_or_path!r} has no {', '.join(missing)}, which the {objective.name} objective needs; "
            f"omit --tokenizer to train one."
        )
    return tokenizer


def load_dataset_splits(args: PretrainingArguments) -> datasets.DatasetDict:
    """`load_text_dataset` with its errors (and the Hub's) turned into one PretrainingError."""
    try:
        return load_text_dataset(
            args.dataset,
            args.text_column,
            seed=args.seed,
            validation_fraction=args.validation_fraction,
            max_documents=args.max_documents,
            config_name=args.dataset_config,
        )
    except ValueError as error:
        raise PretrainingError(str(error)) from error
    except Exception as error:  # DatasetNotFoundError, ConnectionError offline, FileNotFoundError, ...
        raise PretrainingError(
            f"Cannot load dataset {args.dataset!r}: {type(error).__name__}: {error}. Pass a local file "
            f"(.txt/.json/.jsonl/.csv/.parquet), a datasets Hub name, or omit --dataset for the embedded corpus."
        ) from error


@dataclass(frozen=True)
class BatchShare:
    """What a process's training batches are made with: global batches start, start + step, ... (start = the
    batches consumed + this process's rank, step = the number of processes), and the resumed checkpoint's state."""

    args: PretrainingArguments
    tokenizer: PreTrainedTokenizerBase
    collator: Any
    start: int
    step: int
    rank: int
    state: dict[str, Any] | None
    pin_memory: bool


class _IndexedCorpus(ABC):
    """A corpus whose training examples are rows by index: batch g is rows [g * B, (g + 1) * B) of the run's
    shuffled order (batches.py), whichever process builds it."""

    @abstractmethod
    def documents(self) -> dict[str, int]:
        """Documents per split ("train", "validation"), for the data line."""

    def data_line(self, train_examples: Any, block_size: int) -> str:
        return data_line(self.documents(), len(train_examples), block_size)

    def training_batches(self, train_examples: Any, share: BatchShare) -> typing.Iterator[tuple[int, dict]]:
        """Global batches start, start + step, ... (this process's share when step is the world size)."""
        args = share.args
        batches = GlobalBatches(
            train_examples, share.collator, args.batch_size, seed=args.seed, stream="train", shuffle=True
        )
        return iter(
            strided_loader(batches, share.start, share.step, num_workers=args.num_workers, pin_memory=share.pin_memory)
        )

    def position(self, data: Any) -> None:
        """Nothing to record: the global batch number is the position."""
        return None


class TextCorpus(_IndexedCorpus):
    """Documents as text (--dataset, or the embedded corpus), loaded whole; the objective tokenizes each split."""

    def __init__(self, args: PretrainingArguments):
        self.splits = load_dataset_splits(args)
        self.saved_tokenizer: str | None = None  # text has none: one is trained on the training split

    def tokenizer_texts(self) -> typing.Iterable[str]:
        return iter_texts(self.splits["train"])

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Any tokenizer reads text."""

    def documents(self) -> dict[str, int]:
        return {name: len(split) for name, split in self.splits.items()}

    def examples(self, split: str, tokenizer: PreTrainedTokenizerBase, args: PretrainingArguments) -> Any:
        return args.spec.examples(self.splits[split], tokenizer, args)

    def held_out_texts(self, tokenizer: PreTrainedTokenizerBase) -> list[str]:
        return self.splits["validation"][:HELD_OUT_DOCUMENTS]["text"]


class ShardCorpus(_IndexedCorpus):
    """Documents as token ids (--data-dir, `coreformer tokenize`'s folder), read by memory map: the objective's
    examples are tables over them (shard_examples.py), and only the tokenizer they were made with may read them."""

    def __init__(self, args: PretrainingArguments):
        self.manifest = check_shard_folder(args.data_dir)
        self.tokens = {split: ShardedTokens(args.data_dir, split) for split in ("train", "validation")}
        self.saved_tokenizer = shard_tokenizer(args.data_dir, self.manifest)

    def tokenizer_texts(self) -> typing.Iterable[str]:
        raise AssertionError("shards are read with the tokenizer they were made with; none is trained")

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        check_tokenizer(self.manifest, tokenizer)  # ShardsError (a PretrainingError) naming both

    def documents(self) -> dict[str, int]:
        return {name: len(tokens) for name, tokens in self.tokens.items()}

    def examples(self, split: str, tokenizer: PreTrainedTokenizerBase, args: PretrainingArguments) -> Any:
        return args.spec.sharded_examples(self.tokens[split], tokenizer, args)

    def held_out_texts(self, tokenizer: PreTrainedTokenizerBase) -> list[str]:
        """The held-out documents decoded (the zero-shot report reads text: minimal pairs are made of lines)."""
        validation = self.tokens["validation"]
        return [tokenizer.decode(validation[index]) for index in range(min(HELD_OUT_DOCUMENTS, len(validation)))]


class StreamCorpus:
    """Documents streamed from --dataset (--streaming, streaming.py): each process reads its share and tokenizes it as
    training goes; the held-out documents are read once and laid out as text's are."""

    saved_tokenizer = None  # --streaming needs --tokenizer (checked with the settings)

    def __init__(self, args: PretrainingArguments, accelerator: Any):
        self.text = StreamedText(args, accelerator.process_index, accelerator.num_processes)
        self.held_out = self.text.held_out()
        self.source = args.dataset

    def tokenizer_texts(self) -> typing.Iterable[str]:
        raise AssertionError("--streaming needs --tokenizer; none is trained")

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Any tokenizer reads text."""

    def examples(self, split: str, tokenizer: PreTrainedTokenizerBase, args: PretrainingArguments) -> Any:
        """The held-out examples, from the held-out text as a text run makes them; None for training (its rows are
        made as the stream is read)."""
        if split == "train":
            return None
        return args.spec.examples(datasets.Dataset.from_dict({"text": self.held_out}), tokenizer, args)

    def data_line(self, train_examples: Any, block_size: int) -> str:
        return (
            f"data: streaming {self.source}: each process tokenizes its share of the training documents as it trains, "
            f"{CHUNK_DOCUMENTS:,} at a time, into examples of up to {block_size} tokens; {len(self.held_out):,} "
            f"documents held out"
        )

    def training_batches(self, train_examples: Any, share: BatchShare) -> StreamedBatches:
        """This process's micro-batches from the stream, from where the resumed checkpoint says it stopped."""
        position, state = StreamPosition(), share.state
        if state is not None:
            if "stream_positions" not in state:
                raise PretrainingError(
                    "The checkpoint was written by a run that did not stream its data, so it records no position in a "
                    "stream: resume it without --streaming (with the data it trained on)."
                )
            if state["world_size"] != share.step:
                raise PretrainingError(
                    f"A streamed run resumes on the number of processes it ran on ({state['world_size']}; this run has "
                    f"{share.step}): each process reads its own share of the stream. Launch {state['world_size']} "
                    f"processes."
                )
            position = StreamPosition(**state["stream_positions"][share.rank])
        return StreamedBatches(
            self.text, share.args.spec, share.tokenizer, share.collator, share.args, start=share.start,
            step=share.step, position=position, num_workers=share.args.num_workers,
        )  # fmt: skip

    def position(self, data: StreamedBatches) -> dict[str, int]:
        """Where this process's next micro-batch starts (a checkpoint records every process's)."""
        return dataclasses.asdict(data.next_position)

    def held_out_texts(self, tokenizer: PreTrainedTokenizerBase) -> list[str]:
        return self.held_out


Corpus = TextCorpus | ShardCorpus | StreamCorpus


def open_corpus(args: PretrainingArguments, accelerator: Any) -> Corpus:
    if args.data_dir is not None:
        return ShardCorpus(args)
    return StreamCorpus(args, accelerator) if args.streaming else TextCorpus(args)


def build_collator(tokenizer: PreTrainedTokenizerBase, args: PretrainingArguments) -> Any:
    return args.spec.collator(tokenizer, args)


def build_model_config(args: PretrainingArguments, tokenizer: PreTrainedTokenizerBase):
    """The family config: token ids from the tokenizer, vocab padded to `pad_vocab_to_multiple_of`, then `model`."""
    fields = token_config_kwargs(tokenizer, args.family)
    multiple = args.pad_vocab_to_multiple_of
    fields["vocab_size"] = math.ceil(len(tokenizer) / multiple) * multiple
    fields.update(args.model)
    try:
        config = TRAINING_FACTS[args.family].config_class(**fields)
    except ValueError as error:
        raise PretrainingError(f"Bad model config: {error}") from error
    longest = longest_input(config)
    if longest is not None and args.block_size > longest:
        needed = args.block_size + config.position_offset
        raise PretrainingError(
            f"--block-size {args.block_size} needs max_position_embeddings >= {needed} with "
            f"{config.position_embedding_type} positions; the model has {config.max_position_embeddings}. "
            f"Lower --block-size or raise model.max_position_embeddings."
        )
    check_packing(args, tokenizer, config)
    return config


def check_packing(args: PretrainingArguments, tokenizer: PreTrainedTokenizerBase, config: Any) -> None:
    """--packing padded and packed fill rows with the pad token; packed rows also count their real tokens by it (so it
    must not be a token documents hold) and need layer types that keep the documents of a row apart."""
    if args.packing not in ("padded", "packed"):
        return
    held = {getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "cls", "sep", "unk", "mask")}
    pad = tokenizer.pad_token_id
    if pad is None or (args.packing == "packed" and pad in held):
        raise PretrainingError(
            f"--packing {args.packing} fills rows with the pad token, and this tokenizer has "
            f"{'none' if pad is None else f'one that documents also hold ({tokenizer.pad_token!r})'}; give it a "
            f"pad token of its own, or omit --tokenizer to train one."
        )
    if args.packing != "packed":
        return
    types = {kind for field in config.stack_layer_types() for kind in getattr(config, field)}
    unable = sorted(kind for kind in types if not LAYER_TYPES[kind].packed_rows)
    if unable:
        raise PretrainingError(
            f"--packing packed keeps the documents of a row apart, which {', '.join(map(repr, unable))} layers cannot "
            f"(they lay out the whole row at once); pass --packing padded, or other model.layer_types."
        )


def input_token_count(batch: dict[str, torch.Tensor], pad_token_id: int | None = None) -> int:
    """The real input tokens of a batch: its attention_mask's; in a packed batch (position_ids, no mask) those that
    are not the pad token of a row's tail (`check_packing` keeps the pad token out of documents); else every one."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    if "position_ids" in batch and pad_token_id is not None:
        return int((batch["input_ids"] != pad_token_id).sum())
    return batch["input_ids"].numel()


def shared_tokenizer(accelerator, train: typing.Callable[[], PreTrainedTokenizerBase]) -> PreTrainedTokenizerBase:
    """Train on the main process and hand the files to the others: training gives every process the same tokenizer
    (tokenizer_training makes WordPiece's numbering deterministic), but once is enough, and the other ranks are spared
    the time."""
    payload: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            tokenizer = train()
            with tempfile.TemporaryDirectory() as folder:
                tokenizer.save_pretrained(folder)
                payload = [{path.name: path.read_bytes() for path in Path(folder).iterdir()}]
        except Exception as error:  # let every process raise it, instead of waiting forever on the main one
            payload = [PretrainingError(f"Tokenizer training failed: {type(error).__name__}: {error}")]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(payload)
    if isinstance(payload[0], Exception):
        raise payload[0]
    if accelerator.is_main_process:
        return tokenizer
    with tempfile.TemporaryDirectory() as folder:
        for name, content in payload[0].items():
            Path(folder, name).write_bytes(content)
        return AutoTokenizer.from_pretrained(folder)
