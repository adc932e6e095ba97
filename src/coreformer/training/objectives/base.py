"""The protocol every pretraining objective follows: what the run asks of it, with the defaults most share.

    Objective.examples(split, tokenizer, args)     text -> the examples its collator takes
    Objective.sharded_examples(tokens, tokenizer, args)   the same examples from token ids (shards, a streamed chunk)
    Objective.packing(args) / packs_documents(args)   the run's --packing, checked against the objective's `packings`
    Objective.collator(tokenizer, args)            a seeded collator: examples -> a batch of tensors
    Objective.required_tokens                      special tokens the tokenizer must have
    Objective.label_count(batch)                   the tokens that carry a loss (the step's token-mean divisor)
    Objective.build_model(config, args)            the module trained (a family head; ELECTRA: two models in one)
    Objective.loss(model, batch, label_tokens, input_tokens)   a micro-batch's share of the step's token-mean loss
    Objective.loss_terms(...)                      the loss and its reported parts (held-out evaluation)
    Objective.save(model, state_dict, tokenizer, folder)   what the final folder holds (a loadable folder)
    Objective.training_flops(model, block_size, label_share)   training FLOPs (per token, per step) of the module
    Objective.sample(folder, prompt, seed)         what the saved folder makes of a prompt (--sample-prompt)
    description / auto_class / pipeline_tag / usage / card_metrics   what the model card says

An objective trains one family's model (`families`: those whose config it can build); it is chosen by
`--objective`, the family's default when not given. The registry is coreformer_settings.objectives (torch-free: the
objective's module, its own settings), which reach the objective as `args.objective_settings`.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..arguments import PretrainingError
from ..data import pack_windows, special_tokens_around, tokenize_dataset
from ..families import head_class
from ..flops import flops_per_token, head_parameters, matmul_parameters
from ..shard_examples import Documents, PackedRows, ShardWindows


@dataclass(frozen=True)
class Objective(ABC):
    name: str
    families: tuple[str, ...]
    description: str  # "masked language modelling (BERT: ...)": the card's objective line
    auto_class: str  # the Auto class that loads the final folder
    pipeline_tag: str
    usage: str  # the card's code example after `model = ...` and `tokenizer = ...`
    required_tokens: tuple[str, ...]
    card_metrics: tuple[str, ...] = ("loss", "perplexity")  # held-out numbers the card's model-index reports
    finetune_task: str = "sequence-classification"  # what to fine-tune the saved folder for next (finetune.py --task)
    # The --packing modes its examples and collator build (coreformer_settings.pretraining.PACKINGS), the first the
    # default; none: the objective lays out its own rows and --packing is refused.
    packings: tuple[str, ...] = ()

    # ---- data ----
    def packing(self, args: Any) -> str | None:
        """The run's --packing, the objective's default when not given (or when `args` has none: the zero-shot
        evaluation's fixed settings); one the objective does not build is refused in one line."""
        chosen = getattr(args, "packing", None)
        if chosen is None:
            return self.packings[0] if self.packings else None
        if chosen not in self.packings:
            built = ", ".join(self.packings) or "none (it lays out its own rows)"
            raise PretrainingError(
                f"--packing {chosen}: the {self.name} objective builds {built}; pass one of them or omit --packing."
            )
        return chosen

    def packs_documents(self, args: Any) -> bool:
        """Rows of several whole documents, kept apart by restarting position_ids (--packing packed)."""
        return self.packing(args) == "packed"

    def examples(self, split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, args: Any) -> datasets.Dataset:
        """Windows of at most `block_size` ids, special tokens added to each; under --packing packed, whole windows
        packed into rows of at most `block_size` (`pack_windows`)."""
        windows = tokenize_dataset(split, tokenizer, max_length=args.block_size)
        return pack_windows(windows, args.block_size) if self.packs_documents(args) else windows

    def sharded_examples(self, tokens: Documents, tokenizer: PreTrainedTokenizerBase, args: Any) -> Any:
        """`examples` read from a shard split by index (shard_examples.py): the same windows and packed rows."""
        prefix, suffix = special_tokens_around(tokenizer)
        width = args.block_size - len(prefix) - len(suffix)
        windows = ShardWindows(tokens, width, prefix=prefix, suffix=suffix)
        return PackedRows(windows, args.block_size) if self.packs_documents(args) else windows

    @abstractmethod
    def collator(self, tokenizer: PreTrainedTokenizerBase, args: Any) -> Any:
        """The collator that turns `examples` rows into this objective's batches (inputs and labels)."""

    def label_count(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens that carry a loss."""
        return int((batch["labels"] != -100).sum())

    @property
    def metrics_beside_loss(self) -> tuple[str, ...]:
        """The held-out numbers the log prints after the loss (the card's, less the loss itself)."""
        return tuple(name for name in self.card_metrics if name != "loss")

    def label_share(self, args: Any) -> float:
        """The expected share of tokens that carry a loss (what `training_flops` takes as `label_share`)."""
        return 1.0

    # ---- model ----
    def build_model(self, config: Any, args: Any) -> torch.nn.Module:
        return head_class(args.family, self.auto_class)(config)

    def loss(
        self,
        model: torch.nn.Module,
        batch: dict[str, torch.Tensor],
        label_tokens: torch.Tensor | int,
        input_tokens: torch.Tensor | int,
    ) -> torch.Tensor:
        """This micro-batch's share of the step's token-mean loss: its loss summed over tokens and divided by the
        step's token counts (all micro-batches, all processes), `label_tokens` (`label_count`) and `input_tokens`
        (real input tokens). One count suits most objectives: transformers' `num_items_in_batch`. The language-model
        heads compute it with `skip_logits=True`: the vocabulary projection fused with the loss, no logits formed."""
        return model(**batch, num_items_in_batch=label_tokens, skip_logits=True).loss

    def loss_terms(
        self,
        model: torch.nn.Module,
        batch: dict[str, torch.Tensor],
        label_tokens: torch.Tensor | int,
        input_tokens: torch.Tensor | int,
    ) -> dict[str, torch.Tensor]:
        """The loss ("loss") and any parts of it worth reporting, each a share of a token mean like `loss`; the
        held-out evaluation sums each over the batches."""
        return {"loss": self.loss(model, batch, label_tokens, input_tokens)}

    def save(
        self,
        model: torch.nn.Module,
        state_dict: dict[str, torch.Tensor],
        tokenizer: PreTrainedTokenizerBase,
        folder: Path,
    ) -> None:
        """config (auto_map), weights, modeling code, generation config, and the tokenizer."""
        model.save_pretrained(folder, state_dict=state_dict)
        tokenizer.save_pretrained(folder)

    def training_flops(
        self, model: torch.nn.Module, block_size: int, *, label_share: float = 1.0
    ) -> tuple[float, float]:
        """(FLOPs per token, FLOPs per step beyond those) of one forward and backward of `model` (flops.py:
        6 N_matmul + 12 L d T; a tied output layer counts as the matmul it is, embedding lookups do not). `loss`
        takes the fused loss, which runs the head (`head_parameters`) on the labelled tokens only, `label_share` of
        them (masked LM: about its masking probability), with the same three products as an unfused head."""
        head = head_parameters(model)
        body = flops_per_token(model.config, matmul_parameters(model) - head, block_size)
        return body + label_share * 6 * head, 0.0

    def saved_parameters(self, model: torch.nn.Module) -> int:
        """Parameters of the model `save` writes (what the card counts)."""
        return sum(parameter.numel() for parameter in model.parameters())

    # ---- after the run ----
    @abstractmethod
    def sample(self, folder: str | Path, prompt: str, *, seed: int = 0) -> str:
        """Text the saved folder produces from `prompt` (printed and stored in metrics.json)."""


def load_for_sample(folder: str | Path, auto_class: str) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The saved folder as a user loads it: the Auto class and AutoTokenizer."""
    import transformers

    return getattr(transformers, auto_class).from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@torch.no_grad()
def sampled_text(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    *,
    seed: int,
    prompt_in_decoder: bool,
    max_new_tokens: int = 64,
) -> str:
    """`generate` with top-k 40 and temperature 0.8 under `seed`, the global RNG left as it was. The positions left
    for new tokens are those the prompt does not take (`prompt_in_decoder`) or all but the decoder's start token."""
    inputs = tokenizer(prompt, return_tensors="pt")
    used = inputs["input_ids"].shape[1] if prompt_in_decoder else 1  # positions taken before the first new token
    max_new_tokens = max(1, min(max_new_tokens, model.config.max_position_embeddings - used))
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8)
    torch.random.set_rng_state(generator_state)
    return tokenizer.decode(generated[0], skip_special_tokens=True)
