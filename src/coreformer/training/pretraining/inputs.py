"""A pretraining run's inputs, checked before its first write (the driver's `prepare` and `build` call these).

    load_tokenizer / load_dataset_splits     a tokenizer or the text splits, their errors as one PretrainingError
    open_corpus(args) -> TextCorpus | ShardCorpus   where the run's documents come from (--dataset or --data-dir),
                                             each giving the objective's examples of a split, the held-out text and
                                             the tokenizer the documents need
    shared_tokenizer                         a tokenizer trained once on the main process and handed to the others
    build_collator / build_model_config      the objective's collator; the family config, checked against
                                             --block-size and --packing (check_packing)
    input_token_count(batch, pad_token_id)   the real input tokens of a batch (throughput, MFU, token means)

Each raises one PretrainingError naming the problem and the fix; nothing here writes to the output folder.
"""

from __future__ import annotations

import math
import tempfile
import typing
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from coreformer_settings.tokenizing import check_shard_folder, shard_tokenizer

from ...hub.folders import MissingTokenizerError, folder_tokenizer
from ...layer_types import LAYER_TYPES
from ..arguments import PretrainingError
from ..data import iter_texts, load_text_dataset
from ..families import TRAINING_FACTS, longest_input
from ..objectives import Objective
from ..shards import ShardedTokens, check_tokenizer
from ..tokenizer_training import token_config_kwargs
from ..zero_shot import MAX_DOCUMENTS
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


class TextCorpus:
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
        return self.splits["validation"][:MAX_DOCUMENTS]["text"]


class ShardCorpus:
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
        return [tokenizer.decode(validation[index]) for index in range(min(MAX_DOCUMENTS, len(validation)))]


Corpus = TextCorpus | ShardCorpus


def open_corpus(args: PretrainingArguments) -> Corpus:
    return ShardCorpus(args) if args.data_dir is not None else TextCorpus(args)


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
