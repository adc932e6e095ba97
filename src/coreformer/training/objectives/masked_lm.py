"""Masked language modelling (BERT, Devlin et al. 2019): 15% of tokens selected, 80% [MASK] / 10% random / 10% kept.

mask_tokens(input_ids, maskable, ...)    BERT's masking of a (B, T) batch
MaskedLMCollator                          pads (or packs) encoder examples and masks them; labels only where selected
MASKED_LM                                 the objective (registered in coreformer_settings.objectives)
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ..data import SeededCollator, as_ids, packed_rows, pad_sequences, row_documents
from ..families import families_with_language_model
from .base import Objective, load_for_sample


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
class MaskedLMCollator(SeededCollator):
    """Pads encoder examples and masks them for MLM; returns input_ids, attention_mask, labels (+ token_type_ids).

    Args:
        mask_token_id / pad_token_id / vocab_size: From the tokenizer (`from_tokenizer` reads them).
        special_token_ids: Never selected ([CLS], [SEP], ...); padding is excluded too, wherever it sits.
        mlm_probability, mask_replace_prob, random_replace_prob: BERT's 0.15 / 0.8 / 0.1.
        return_token_type_ids: Add zeros (or the examples' own) for models with `type_vocab_size > 0`.
        pad_to_multiple_of: Round the padded length up (tensor-core friendly shapes).
        packed: The examples are `pack_windows` rows: returns position_ids restarting at each document and no
            attention_mask (data.py draws the row); a row's padded tail is never selected.
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
    packed: bool = False

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
        if self.packed:
            input_ids, position_ids = packed_rows([row_documents(e) for e in examples], self.pad_token_id)  # (B, T)
            return self._masked(input_ids, None, examples) | {"position_ids": position_ids}
        ids = [as_ids(example) for example in examples]
        input_ids = pad_sequences(ids, self.pad_token_id, self.pad_to_multiple_of)  # (B, T)
        if all("attention_mask" in example for example in examples):
            attention_mask = pad_sequences(
                [as_ids(example, "attention_mask") for example in examples], 0, self.pad_to_multiple_of
            )
        else:
            attention_mask = pad_sequences([torch.ones_like(i) for i in ids], 0, self.pad_to_multiple_of)
        return self._masked(input_ids, attention_mask, examples)

    def _masked(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, examples: list[dict[str, Any]]
    ) -> dict[str, torch.Tensor]:
        """The batch of masked (B, T) `input_ids`: inputs, labels, the attention_mask when given, token types."""
        maskable = ~torch.isin(input_ids, self._never_selected)  # padding is never selected, wherever it sits
        if attention_mask is not None:
            maskable &= attention_mask.bool()
        inputs, labels = mask_tokens(
            input_ids,
            maskable=maskable,
            mask_token_id=self.mask_token_id,
            replacement_ids=self._replacement_ids,
            generator=self.generator,
            mlm_probability=self.mlm_probability,
            mask_replace_prob=self.mask_replace_prob,
            random_replace_prob=self.random_replace_prob,
        )
        batch = {"input_ids": inputs} | ({} if attention_mask is None else {"attention_mask": attention_mask})
        batch["labels"] = labels
        if self.return_token_type_ids:
            if attention_mask is not None and all("token_type_ids" in example for example in examples):
                batch["token_type_ids"] = pad_sequences(
                    [as_ids(e, "token_type_ids") for e in examples], 0, self.pad_to_multiple_of
                )
            else:
                batch["token_type_ids"] = torch.zeros_like(input_ids)
        return batch


@dataclass(frozen=True)
class MaskedLM(Objective):
    def collator(self, tokenizer: PreTrainedTokenizerBase, args: Any) -> MaskedLMCollator:
        return MaskedLMCollator.from_tokenizer(
            tokenizer,
            mlm_probability=args.objective_settings.mlm_probability,
            seed=args.seed,
            packed=self.packs_documents(args),
        )

    def label_share(self, args: Any) -> float:
        """At most the masking probability: special tokens are never selected."""
        return args.objective_settings.mlm_probability

    @torch.no_grad()
    def sample(self, folder: str | Path, prompt: str, *, seed: int = 0) -> str:
        """ "prompt -> the five likeliest tokens at [MASK]" (a [MASK] is appended when the prompt has none)."""
        model, tokenizer = load_for_sample(folder, self.auto_class)
        text = prompt if tokenizer.mask_token in prompt else f"{prompt}{tokenizer.mask_token}"
        inputs = tokenizer(text, return_tensors="pt")
        position = (inputs["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0, 0]
        top = model(**inputs).logits[0, position].topk(5).indices
        return f"{text} -> {tokenizer.convert_ids_to_tokens(top.tolist())}"


MASKED_LM = MaskedLM(
    name="masked-lm",
    families=families_with_language_model("AutoModelForMaskedLM"),
    description="masked language modelling (BERT: 15% of tokens selected, 80% [MASK] / 10% random / 10% kept)",
    auto_class="AutoModelForMaskedLM",
    pipeline_tag="fill-mask",
    usage='inputs = tokenizer("import [MASK]", return_tensors="pt")\nlogits = model(**inputs).logits',
    required_tokens=("pad_token", "mask_token", "cls_token", "sep_token"),
    packings=("padded", "packed"),
)
