"""BART denoising (Lewis et al. 2020): sentence permutation, then text infilling (Poisson(3) spans -> one <mask>).

    sentence_end_token_ids(tokenizer)        tokens after which a sentence may be cut
    permute_sentences / infill_spans         BART's two noises on one 1-D example
    DenoisingCollator                        corrupted source (input_ids) + the original document (labels)
    DENOISING                                the objective (registered in coreformer_settings.objectives)

The seq2seq model builds decoder_input_ids by shifting labels right (decoder_start_token_id = eos), so the padded
collator returns none. The packed one (--packing packed) corrupts each document on its own and packs both sides
alike, decoder document i answering encoder document i; it shifts each document's labels itself, since a shift of the
whole row would hand a document the last token of the one before:

    encoder  input_ids           [<s> a <mask> </s> <s> b b <mask> </s> <pad>]   corrupted documents, then a tail
             position_ids        [0   1 2      3    0   1 2 3      4    0    ]
    decoder  labels              [<s> a a a </s> <s> b b b b </s> -100 -100]     the original documents
             decoder_input_ids   [</s> <s> a a a </s> <s> b b b b <pad> <pad>]   each shifted behind the start token
             decoder_position_ids [0 1 2 3 4 0 1 2 3 4 5 0 1]

Every row of both sides ends in a padded tail document (at least one token), so both sides count their documents
alike and each tail reads only the other side's tail.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ..data import SeededCollator, as_ids, packed_rows, pad_sequences, row_documents
from ..families import families_with_language_model
from .base import Objective, load_for_sample, sampled_text


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
class DenoisingCollator(SeededCollator):
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
        packed: The examples are `pack_windows` rows: both sides packed, see the module docstring.
        decoder_start_token_id: What each packed document's decoder input starts with (default: eos, as BART).
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
    packed: bool = False
    decoder_start_token_id: int | None = None

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
        if self.packed:
            return self._packed(examples)
        originals = [as_ids(example) for example in examples]
        sources = [self.corrupt(ids) for ids in originals]
        input_ids = pad_sequences(sources, self.pad_token_id, self.pad_to_multiple_of)  # (B, S)
        attention_mask = pad_sequences([torch.ones_like(s) for s in sources], 0, self.pad_to_multiple_of)
        labels = pad_sequences(originals, -100, self.pad_to_multiple_of)  # (B, L)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def _packed(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Both sides packed, document by document (the module docstring draws a row)."""
        start = self.eos_token_id if self.decoder_start_token_id is None else self.decoder_start_token_id
        originals = [row_documents(example) for example in examples]
        sources = [[self.corrupt(document) for document in row] for row in originals]
        shifted = [[torch.cat([torch.tensor([start]), document[:-1]]) for document in row] for row in originals]
        input_ids, position_ids = packed_rows(sources, self.pad_token_id, tail=1)  # (B, S)
        labels, decoder_position_ids = packed_rows(originals, -100, tail=1)  # (B, T)
        decoder_input_ids, _ = packed_rows(shifted, self.pad_token_id, length=labels.shape[1])
        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "decoder_input_ids": decoder_input_ids,
            "decoder_position_ids": decoder_position_ids,
            "labels": labels,
        }


@dataclass(frozen=True)
class Denoising(Objective):
    def collator(self, tokenizer: PreTrainedTokenizerBase, args: Any) -> DenoisingCollator:
        settings = args.objective_settings  # DenoisingSettings
        return DenoisingCollator.from_tokenizer(
            tokenizer,
            mask_ratio=settings.mask_ratio,
            poisson_lambda=settings.poisson_lambda,
            seed=args.seed,
            packed=self.packs_documents(args),
            decoder_start_token_id=getattr(args, "model", {}).get("decoder_start_token_id"),
        )

    def sample(self, folder: str | Path, prompt: str, *, seed: int = 0) -> str:
        """ "prompt -> the prompt denoised" (top-k 40, temperature 0.8)."""
        model, tokenizer = load_for_sample(folder, self.auto_class)
        return f"{prompt} -> {sampled_text(model, tokenizer, prompt, seed=seed, prompt_in_decoder=False)}"


DENOISING = Denoising(
    name="denoising",
    families=families_with_language_model("AutoModelForSeq2SeqLM"),
    description="BART denoising (text infilling with Poisson(3) spans, 30% of tokens; sentence permutation)",
    auto_class="AutoModelForSeq2SeqLM",
    pipeline_tag="text2text-generation",
    finetune_task="seq2seq",
    usage='inputs = tokenizer("def <mask>(self):", return_tensors="pt")\n'
    "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0]))",
    required_tokens=("pad_token", "mask_token", "bos_token", "eos_token"),
    packings=("padded", "packed"),
)
