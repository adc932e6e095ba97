"""ELECTRA (Clark et al. 2020): a small masked-LM generator fills the masks, the discriminator tells every token
whether it was replaced; both train together, loss = L_MLM(generator) + 50 * L_RTD(discriminator).

    masked ids ──> generator (width x fraction, embedding tables shared) ──> MLM loss at the selected positions
                        │ sample one token per selected position (no gradient through the sample)
                        v
    corrupted ids ──> discriminator (the encoder being pretrained) ──> one logit per token ──> RTD loss, all tokens

Masking. Of the tokens selected (mlm_probability), GENERATOR_MASK_SHARE (85%) become [MASK] and the rest stay as they
are, none random: the paper's code does so (google-research/electra, pretrain_helpers.mask). The generator is then
trained where a selected token is visible too, so the saved generator is a masked LM that also scores held-out text
masked as BERT masks (80% [MASK], 10% random, 10% kept; the evaluation's): one trained on [MASK] alone is untrained
where a selected token is visible, and its held-out loss sits above the unigram entropy of the text.

    replaced_token_labels(original, corrupted, attention_mask)   1 where the token differs from the original, 0 where
                                                                 it is the original (a sampled original counts as 0)
    ElectraPretraining                                           generator + discriminator as one module
    ELECTRA                                                      the objective (coreformer_settings.objectives)

Embeddings. The paper shares the token and position embeddings of generator and discriminator, a smaller generator
reading them through a projection (as transformers' ELECTRA does with `embedding_size`). Here the discriminator owns
every embedding table (tokens E (V, H), learned positions, token types: `SHARED_TABLES`); the generator reads each
through one learned projection P (H, H_g): its token matrix is E P, used for its input lookup and (tied) for its
output logits, its position table E_pos P, so a saved generator is an ordinary masked LM whose tables are the
projected ones. Its embedding norm and everything above it are its own.

Losses. Both are token means over the optimizer step: the MLM loss over the masked tokens (`label_tokens`), the RTD
loss over every real token (`input_tokens`), a binary cross-entropy on the discriminator's logit D(x, t) =
w^T h(x)_t (paper eq. 2; the sigmoid is in the loss). Reported beside them (held-out evaluation, not trained on):
the generator's accuracy at the masks, the share of masked tokens its sample replaced, and the RTD base rate (the
accuracy of always answering "original"): an RTD accuracy at the base rate means the discriminator learned nothing.

FLOPs (`Electra.training_flops`): generator and discriminator each 6 N_matmul + 12 L d T per token (flops.py), the
discriminator's N_matmul including its one-logit head; the generator's head (its tied output layer, V x H_g) runs on
the masked tokens only, so it counts at the masking probability's share; plus, once per step, the projection of the
shared tables (6 x rows x H x H_g).

What is saved: the discriminator's encoder (CoreformerEncoderModel, loads with AutoModel and fine-tunes with any
encoder head), `generator/`, the generator as a CoreformerEncoderForMaskedLM folder, and `discriminator/`, the
discriminator with its one-logit head (AutoModelForTokenClassification), so that its replaced-token detection can be
scored on held-out text after the run (benchmarks/electra_vs_mlm.py's ROC AUC).
"""

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ...compat import enable_activation_checkpointing
from ...losses import token_loss
from ..families import head_class
from ..flops import flops_per_token, head_parameters, matmul_parameters
from .base import Objective
from .masked_lm import MASKED_LM, MaskedLMCollator

GENERATOR_DIR = "generator"
DISCRIMINATOR_DIR = "discriminator"
SHARED_TABLES = ("embed_tokens", "embed_positions", "token_type_embeddings")  # nn.Embedding tables of the stack
GENERATOR_MASK_SHARE = 0.85  # selected tokens that become [MASK]; the rest stay (pretrain_helpers.mask)


def embedding_tables(model: nn.Module) -> dict[str, nn.Embedding]:
    """The learned embedding tables of an encoder head's stack, by name (absent or sinusoidal ones left out)."""
    stack = model.model.encoder
    tables = {name: getattr(stack, name, None) for name in SHARED_TABLES}
    return {name: table for name, table in tables.items() if isinstance(table, nn.Embedding)}


def generator_config(config: Any, fraction: float) -> Any:
    """The discriminator's config at `fraction` of its width: heads scaled (head size kept), MLP scaled alike."""
    heads = max(1, round(config.num_attention_heads * fraction))
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    small = copy.deepcopy(config)
    small.num_attention_heads = heads
    small.num_key_value_heads = heads
    small.hidden_size = heads * head_dim
    small.intermediate_size = max(1, round(config.intermediate_size * small.hidden_size / config.hidden_size))
    small.num_labels = 2  # a masked LM has no labels; undo the discriminator's single logit
    return small


def replaced_token_labels(
    original: torch.Tensor, corrupted: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """(B, T) float: 1 where `corrupted` differs from `original`, 0 where it equals it (also where the generator
    sampled the original token back: that token is not replaced), -100 on padding (no loss)."""
    labels = (corrupted != original).float()
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask == 0, -100.0)
    return labels


class ElectraPretraining(nn.Module):
    """The generator and the discriminator trained jointly. Not saved as one folder: see `Electra.save`."""

    def __init__(self, discriminator: nn.Module, generator: nn.Module, *, rtd_weight: float):
        super().__init__()
        self.discriminator, self.generator, self.rtd_weight = discriminator, generator, rtd_weight
        hidden, small = discriminator.config.hidden_size, generator.config.hidden_size
        self.embedding_projection = nn.Linear(hidden, small, bias=False)  # P: (H) -> (H_g)
        nn.init.normal_(self.embedding_projection.weight, std=hidden**-0.5)
        # The generator's own tables (its token matrix tied to its lm_head) are replaced by the projected ones at
        # every forward: removed here, so that they are neither trained, nor saved, nor left without a gradient
        # under DDP.
        for table in embedding_tables(self.generator).values():
            del table.weight
        del self.generator.lm_head.weight

    def generator_embeddings(self) -> dict[str, torch.Tensor]:
        """The generator's tables, each the discriminator's projected: {"embed_tokens": E P (V, H_g), ...}."""
        tables = embedding_tables(self.discriminator)
        return {name: self.embedding_projection(table.weight) for name, table in tables.items()}

    def forward(
        self, input_ids, attention_mask=None, token_type_ids=None, labels=None, position_ids=None, **kwargs
    ) -> dict:
        """Masked batch (B, T) -> the generator's logits at the M selected positions (M, V), in row-major order of
        `labels != -100`; corrupted ids; the discriminator's logits (B, T). Packed rows (position_ids restarting, no
        attention_mask) reach both networks alike."""
        shared = self.generator_embeddings()
        for name, table in embedding_tables(self.generator).items():
            table.weight = shared[name]
        self.generator.lm_head.weight = shared["embed_tokens"]
        hidden = self.generator.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids
        ).last_hidden_state  # (B, T, H_g)
        masked = labels != -100
        # Only the selected tokens are predicted and sampled (~15%): the vocabulary head runs on those rows.
        rows = hidden[masked]  # (M, H_g)
        if self.generator.lm_head_transform is not None:
            rows = self.generator.lm_head_transform(rows)
        generator_logits = self.generator.lm_head(rows)  # (M, V)
        original = torch.where(masked, labels, input_ids)
        with torch.no_grad():  # the generator is trained by its MLM loss only (paper section 2)
            probabilities = torch.softmax(generator_logits.float(), dim=-1)  # (M, V)
            sampled = self.sample_replacements(probabilities) if len(probabilities) else original[masked]
        corrupted = original.masked_scatter(masked, sampled)
        discriminator_logits = self.discriminator(
            input_ids=corrupted, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids
        ).logits.squeeze(-1)  # (B, T)
        return {
            "generator_logits": generator_logits,
            "original": original,
            "corrupted": corrupted,
            "discriminator_logits": discriminator_logits,
        }

    def sample_replacements(self, probabilities: torch.Tensor) -> torch.Tensor:
        """(M, V) the generator's distributions at the masks -> (M,) one token drawn from each (temperature 1, as
        in the paper). A subclass may draw otherwise (benchmarks/electra_rtd_probe.py's controls)."""
        return torch.multinomial(probabilities, 1).squeeze(-1)

    def set_attn_implementation(self, implementation: str) -> None:
        self.generator.set_attn_implementation(implementation)
        self.discriminator.set_attn_implementation(implementation)

    def gradient_checkpointing_enable(self) -> None:
        enable_activation_checkpointing(self.generator)
        enable_activation_checkpointing(self.discriminator)


def electra_loss_terms(
    outputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    label_tokens: torch.Tensor | int,
    input_tokens: torch.Tensor | int,
    rtd_weight: float,
) -> dict[str, torch.Tensor]:
    """{"loss": L_MLM + rtd_weight * L_RTD (paper eq. 3), "mlm_loss": L_MLM summed over the masked tokens /
    label_tokens, "rtd_loss": L_RTD summed over real tokens / input_tokens} and, not differentiated, what tells a
    learning discriminator from one at its base rate: "rtd_accuracy" (real tokens labelled right), "rtd_base_rate"
    (real tokens that are original: the accuracy of always answering "original"), both over input_tokens;
    "generator_accuracy" (masks whose original is the generator's likeliest token) and "replaced_share" (masks whose
    sample differs from the original), both over label_tokens. All are token means over the step."""
    generator_logits = outputs["generator_logits"]  # (M, V): at the masked positions
    masked = labels != -100
    mlm = token_loss(generator_logits, labels[masked], generator_logits.shape[-1], num_items_in_batch=label_tokens)
    targets = replaced_token_labels(outputs["original"], outputs["corrupted"], attention_mask)
    real = targets != -100
    logits = outputs["discriminator_logits"][real].float()
    rtd = nn.functional.binary_cross_entropy_with_logits(logits, targets[real], reduction="sum")
    if torch.is_tensor(input_tokens):
        input_tokens = input_tokens.to(rtd.device)
    if torch.is_tensor(label_tokens):
        label_tokens = label_tokens.to(rtd.device)
    with torch.no_grad():
        right = ((logits > 0).float() == targets[real]).sum()
        original = (targets[real] == 0).sum()
        predicted = (generator_logits.argmax(-1) == labels[masked]).sum()
        replaced = targets[masked].sum()
    rtd = rtd / input_tokens
    return {
        "loss": mlm + rtd_weight * rtd,
        "mlm_loss": mlm,
        "rtd_loss": rtd,
        "rtd_accuracy": right / input_tokens,
        "rtd_base_rate": original / input_tokens,
        "generator_accuracy": predicted / label_tokens,
        "replaced_share": replaced / label_tokens,
    }


def electra_loss(outputs: dict[str, torch.Tensor], labels: torch.Tensor, attention_mask, **counts) -> torch.Tensor:
    """L_MLM + rtd_weight * L_RTD as token means over the step (see `electra_loss_terms`)."""
    return electra_loss_terms(outputs, labels, attention_mask, **counts)["loss"]


@dataclass(frozen=True)
class Electra(Objective):
    def collator(self, tokenizer: PreTrainedTokenizerBase, args: Any) -> MaskedLMCollator:
        """85% of the selected tokens become [MASK], the rest stay (see the module docstring), none random: the
        generator, not the collator, chooses the replacements, at every selected position."""
        return MaskedLMCollator.from_tokenizer(
            tokenizer,
            mlm_probability=args.objective_settings.mlm_probability,
            mask_replace_prob=GENERATOR_MASK_SHARE,
            random_replace_prob=0.0,
            seed=args.seed,
            packed=self.packs_documents(args),
        )

    def build_model(self, config: Any, args: Any) -> ElectraPretraining:
        discriminator_config = copy.deepcopy(config)
        discriminator_config.num_labels = 1  # one logit per token: replaced or not
        discriminator = head_class(args.family, "AutoModelForTokenClassification")(discriminator_config)
        settings = args.objective_settings  # ElectraSettings
        generator = head_class(args.family, "AutoModelForMaskedLM")(
            generator_config(config, settings.generator_fraction)
        )
        return ElectraPretraining(discriminator, generator, rtd_weight=settings.rtd_weight)

    def loss_terms(self, model, batch: dict[str, torch.Tensor], label_tokens, input_tokens) -> dict:
        outputs = model(**batch)
        real = batch.get("attention_mask")
        if real is None and "position_ids" in batch:  # a packed batch: a row's padded tail is no real token
            real = batch["input_ids"] != getattr(model, "module", model).discriminator.config.pad_token_id
        return electra_loss_terms(
            outputs,
            batch["labels"],
            real,
            label_tokens=label_tokens,
            input_tokens=input_tokens,
            rtd_weight=getattr(model, "module", model).rtd_weight,  # DDP wraps the module
        )

    def loss(self, model, batch: dict[str, torch.Tensor], label_tokens, input_tokens) -> torch.Tensor:
        return self.loss_terms(model, batch, label_tokens, input_tokens)["loss"]

    def save(
        self,
        model: ElectraPretraining,
        state_dict: dict[str, torch.Tensor],
        tokenizer: PreTrainedTokenizerBase,
        folder: Path,
    ) -> None:
        """The discriminator's encoder as the folder itself; the generator, with E P as its embeddings, in
        `generator/`; the discriminator with its RTD head in `discriminator/`; the tokenizer in all three."""

        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {key.removeprefix(prefix): value for key, value in state_dict.items() if key.startswith(prefix)}

        model.discriminator.model.save_pretrained(folder, state_dict=part("discriminator.model."))
        projection = state_dict["embedding_projection.weight"]  # (H_g, H)
        shared = {
            f"model.encoder.{name}.weight": state_dict[f"discriminator.model.encoder.{name}.weight"] @ projection.T
            for name in embedding_tables(model.discriminator)
        }  # each (rows, H_g)
        shared["lm_head.weight"] = shared["model.encoder.embed_tokens.weight"]
        generator = type(model.generator)(model.generator.config)
        generator.load_state_dict({**part("generator."), **shared})
        generator.save_pretrained(folder / GENERATOR_DIR)
        model.discriminator.save_pretrained(folder / DISCRIMINATOR_DIR, state_dict=part("discriminator."))
        for destination in (folder, folder / GENERATOR_DIR, folder / DISCRIMINATOR_DIR):
            tokenizer.save_pretrained(destination)

    def label_share(self, args: Any) -> float:
        """The generator's share (its masked-LM loss); the discriminator's loss is on every token."""
        return args.objective_settings.mlm_probability

    def training_flops(
        self, model: ElectraPretraining, block_size: int, *, label_share: float = 1.0
    ) -> tuple[float, float]:
        """(per token, per step): both networks' forward and backward (see the module docstring); the generator's
        head (transform and output layer) runs on the masked tokens only, `label_share` of them."""
        generator_head = head_parameters(model.generator)
        per_token = flops_per_token(model.discriminator.config, matmul_parameters(model.discriminator), block_size)
        per_token += flops_per_token(
            model.generator.config, matmul_parameters(model.generator) - generator_head, block_size
        )
        per_token += label_share * 6 * generator_head
        rows = sum(table.num_embeddings for table in embedding_tables(model.discriminator).values())
        projection = model.embedding_projection
        return per_token, 6.0 * rows * projection.in_features * projection.out_features

    def saved_parameters(self, model: ElectraPretraining) -> int:
        """The discriminator's encoder: the final folder's model (the generator is a side product)."""
        return sum(parameter.numel() for parameter in model.discriminator.model.parameters())

    def sample(self, folder: str | Path, prompt: str, *, seed: int = 0) -> str:
        """The generator's five likeliest tokens at [MASK] (the discriminator alone has no vocabulary head)."""
        return MASKED_LM.sample(Path(folder) / GENERATOR_DIR, prompt, seed=seed)


ELECTRA = Electra(
    name="electra",
    families=MASKED_LM.families,  # its generator is the family's masked LM
    description="replaced-token detection (ELECTRA: a masked-LM generator at a fraction of the width fills 15% "
    "masked tokens, the discriminator labels every token original or replaced; loss MLM + 50 x RTD)",
    auto_class="AutoModel",
    pipeline_tag="feature-extraction",
    usage='inputs = tokenizer("def read(path):", return_tensors="pt")\nhidden = model(**inputs).last_hidden_state',
    required_tokens=MASKED_LM.required_tokens,
    card_metrics=("loss", "mlm_loss", "rtd_loss", "rtd_accuracy", "rtd_base_rate"),
    packings=MASKED_LM.packings,
)
