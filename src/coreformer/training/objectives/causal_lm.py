"""Next-token prediction. By --packing:

    concatenated (default)  documents joined by </s>, cut into full blocks; a document sees the end of the one before
                            (GPT-2 style)
    padded                  each document + </s> cut into windows of at most block_size, one per row, padded
    packed                  those windows packed into rows (data.pack_windows), position_ids restarting at each: no
                            padding between documents, no attention across them

pack_into_blocks(dataset, block_size, eos_token_id)   documents + </s> cut into full blocks
document_windows(dataset, block_size, eos_token_id)   each document + </s> cut into windows of at most block_size
packed_position_ids(input_ids, eos_token_id)          positions that restart after every </s>
PackedCausalLMCollator                                 stacks blocks; labels = input_ids (the model shifts)
DocumentCausalLMCollator                               padded or packed windows; labels -100 at each document's start
CAUSAL_LM                                              the objective (registered in coreformer_settings.objectives)
"""

from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from ..data import as_ids, pack_windows, packed_rows, pad_sequences, row_documents, tokenize_dataset
from ..families import families_with_language_model
from ..shard_examples import Documents, PackedRows, ShardBlocks, ShardWindows
from .base import Objective, load_for_sample, sampled_text


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
        pack,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        desc=f"packing into blocks of {block_size}",
    )


def document_windows(
    dataset: datasets.Dataset,
    block_size: int,
    *,
    eos_token_id: int,
    column: str = "input_ids",
    batch_size: int = 1000,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Each tokenized document followed by `eos_token_id`, cut into windows of at most `block_size` (the last one of
    a document shorter): one window per row, no window holding two documents.

        doc0 </s>  ->  [block_size] [block_size] [rest]        doc1 </s>  ->  [rest]
    """
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1, got {block_size}.")

    def cut(batch: dict[str, list]) -> dict[str, list]:
        windows = []
        for document in batch[column]:
            ids = [*document, eos_token_id]
            windows += [ids[start : start + block_size] for start in range(0, len(ids), block_size)]
        return {"input_ids": windows}

    return dataset.map(
        cut,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        desc=f"cutting documents into windows of {block_size}",
    )


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
        input_ids = torch.stack([as_ids(example) for example in examples])  # (B, block_size); rows must be equal
        batch = {"input_ids": input_ids, "labels": input_ids.clone()}
        if self.return_position_ids:
            batch["position_ids"] = packed_position_ids(input_ids, self.eos_token_id)
        return batch


@dataclass(kw_only=True)
class DocumentCausalLMCollator:
    """`document_windows` rows (padded: input_ids, attention_mask, labels -100 on padding) or `pack_windows` rows
    (packed: input_ids, position_ids restarting at each document, no attention_mask). Packed labels are -100 at each
    document's first token, as transformers' DataCollatorWithFlattening writes them: the model shifts labels inside
    its loss, and the last token of one document must not be taught the first of the next. A padded row's first
    label never counts either (the shift drops it), so both give a document the same label tokens."""

    pad_token_id: int
    packed: bool = False

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not self.packed:
            ids = [as_ids(example) for example in examples]
            input_ids = pad_sequences(ids, self.pad_token_id)  # (B, T)
            attention_mask = pad_sequences([torch.ones_like(row) for row in ids], 0)
            return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": pad_sequences(ids, -100)}
        rows = [row_documents(example) for example in examples]
        input_ids, position_ids = packed_rows(rows, self.pad_token_id)  # (B, T)
        starts = [[torch.cat([torch.tensor([-100]), document[1:]]) for document in row] for row in rows]
        labels, _ = packed_rows(starts, -100, length=input_ids.shape[1])
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


@dataclass(frozen=True)
class CausalLM(Objective):
    # A subclass (a user's own causal objective) keeps today's blocks unless it says otherwise.
    packings: tuple[str, ...] = ("concatenated", "padded", "packed")

    def examples(self, split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, args: Any) -> datasets.Dataset:
        tokenized = tokenize_dataset(split, tokenizer, add_special_tokens=False)
        if self.packing(args) == "concatenated":
            return pack_into_blocks(tokenized, args.block_size, eos_token_id=tokenizer.eos_token_id)
        windows = document_windows(tokenized, args.block_size, eos_token_id=tokenizer.eos_token_id)
        return pack_windows(windows, args.block_size) if self.packs_documents(args) else windows

    def sharded_examples(self, tokens: Documents, tokenizer: PreTrainedTokenizerBase, args: Any) -> Any:
        eos = tokenizer.eos_token_id
        if self.packing(args) == "concatenated":
            return ShardBlocks(tokens, args.block_size, separator=eos)
        windows = ShardWindows(tokens, args.block_size, end=(eos,))
        return PackedRows(windows, args.block_size) if self.packs_documents(args) else windows

    def collator(
        self, tokenizer: PreTrainedTokenizerBase, args: Any
    ) -> PackedCausalLMCollator | DocumentCausalLMCollator:
        if self.packing(args) == "concatenated":
            return PackedCausalLMCollator(eos_token_id=tokenizer.eos_token_id)
        return DocumentCausalLMCollator(pad_token_id=tokenizer.pad_token_id, packed=self.packs_documents(args))

    def label_count(self, batch: dict[str, torch.Tensor]) -> int:
        """The causal LM shifts labels inside its loss, so the first label of a row never counts."""
        return int((batch["labels"][:, 1:] != -100).sum())

    def sample(self, folder: str | Path, prompt: str, *, seed: int = 0) -> str:
        """The prompt continued (top-k 40, temperature 0.8)."""
        model, tokenizer = load_for_sample(folder, self.auto_class)
        return sampled_text(model, tokenizer, prompt, seed=seed, prompt_in_decoder=True)


CAUSAL_LM = CausalLM(
    name="causal-lm",
    families=families_with_language_model("AutoModelForCausalLM"),
    description="next-token prediction on packed blocks (documents joined by </s>, no padding)",
    auto_class="AutoModelForCausalLM",
    pipeline_tag="text-generation",
    finetune_task="causal-lm",
    usage='inputs = tokenizer("def ", return_tensors="pt")\n'
    "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0]))",
    required_tokens=("eos_token",),
)
