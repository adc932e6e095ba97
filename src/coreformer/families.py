"""The coreformer families: ONE registry of the facts every other module reads about them.

    FAMILIES                       name -> Family ("encoder", "decoder", "seq2seq")
    MODEL_TYPES                    config.json `model_type` -> Family
    Family                         model type, config class, modeling module, heads, tokens, card description
    Head                           one Auto class of a family: its coreformer class and its Hub pipeline tag
    family_of_model_type(type)     the Family of a config's `model_type`; ValueError naming the known ones
    head_of_class(class_name)      the (Family, Head) of a coreformer model class name
    register_with_peft()           PEFT's default adapter targets for every family (LoRA: q_proj, v_proj)

Who reads it: `__init__.py` (AutoConfig / AutoModel* registration), `configuration_coreformer.py` (the `auto_map`
written into config.json, the tensor/pipeline-parallel plans over each family's stacks), `commands/convert.py` and
`hub/model_card.py` (families, heads, pipeline tags, card text), PEFT through `register_with_peft`, and the training
code (which family a checkpoint is, its language-model head, its special tokens). Nothing else compares a family or head
name as a string.

Classes are named here, not imported: `configuration_coreformer.py` imports this module, so it is copied next to
every checkpoint and loaded with `trust_remote_code=True`; it must stay flat and import neither torch nor the
modeling files. `__init__.py` resolves the names to classes.

To add a head to a family: write the class in the family's modeling module, then add one `Head(...)` line to the
family's `heads` below (and export the class from `__init__.py`). To add a family: write its config class in
`configuration_coreformer.py` and its `modeling_<name>.py`, then add one `Family(...)` entry to `FAMILIES`.
"""

import importlib.abc
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import ModuleType


@dataclass(frozen=True)
class Head:
    """One Auto class of a family and the coreformer class registered for it."""

    auto_class: str  # transformers Auto class name, e.g. "AutoModelForMaskedLM"
    class_name: str  # the coreformer class, defined in the family's modeling module
    pipeline_tag: str | None  # the Hub's pipeline tag for cards; None where the Hub has none (multiple choice)


@dataclass(frozen=True)
class Family:
    """Everything coreformer knows about one family, in one place."""

    name: str  # the short name users type: `--family encoder`, card tags
    model_type: str  # config.json's `model_type`
    config_class: str  # in configuration_coreformer.py
    module: str  # the modeling module (flat, copied next to checkpoints) holding every head of `heads`
    description: str  # one line for model cards
    heads: tuple[Head, ...]  # every Auto class the family registers; the first is the base model (AutoModel)
    language_model_auto_class: str  # the head that predicts tokens (what pretraining trains and saves)
    special_tokens: tuple[tuple[str, str], ...]  # (role, token) in id order, for tokenizers trained for the family
    stacks: tuple[str, ...]  # the base model's CoreformerStack attributes, in order (parallelism plans name them)
    cross_attention_stack: str | None  # the stack whose blocks also cross-attend (seq2seq decoder)
    model_input_names: tuple[str, ...]  # what the family's tokenizers return

    @property
    def auto_map(self) -> dict[str, str]:
        """The `auto_map` written into config.json: every Auto class of the family, for `trust_remote_code`."""
        auto_map = {"AutoConfig": f"configuration_coreformer.{self.config_class}"}
        auto_map.update({head.auto_class: f"{self.module}.{head.class_name}" for head in self.heads})
        return auto_map

    @property
    def base_model(self) -> Head:
        return self.heads[0]

    @property
    def language_model(self) -> Head:
        return self.head(self.language_model_auto_class)

    def head(self, auto_class: str) -> Head:
        """The head registered for `auto_class`; ValueError naming the family's Auto classes otherwise."""
        for head in self.heads:
            if head.auto_class == auto_class:
                return head
        known = ", ".join(head.auto_class for head in self.heads)
        raise ValueError(f"The {self.name} family has no {auto_class} head; it has {known}.")


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            name="encoder",
            model_type="coreformer_encoder",
            config_class="CoreformerEncoderConfig",
            module="modeling_encoder",
            description="BERT-style encoder (bidirectional self-attention)",
            heads=(
                Head("AutoModel", "CoreformerEncoderModel", "feature-extraction"),
                Head("AutoModelForMaskedLM", "CoreformerEncoderForMaskedLM", "fill-mask"),
                Head(
                    "AutoModelForSequenceClassification",
                    "CoreformerEncoderForSequenceClassification",
                    "text-classification",
                ),
                Head(
                    "AutoModelForTokenClassification", "CoreformerEncoderForTokenClassification", "token-classification"
                ),
                Head("AutoModelForQuestionAnswering", "CoreformerEncoderForQuestionAnswering", "question-answering"),
                Head("AutoModelForMultipleChoice", "CoreformerEncoderForMultipleChoice", None),
            ),
            language_model_auto_class="AutoModelForMaskedLM",
            special_tokens=(
                ("pad_token", "[PAD]"),
                ("unk_token", "[UNK]"),
                ("cls_token", "[CLS]"),
                ("sep_token", "[SEP]"),
                ("mask_token", "[MASK]"),
            ),
            model_input_names=("input_ids", "token_type_ids", "attention_mask"),
            stacks=("encoder",),
            cross_attention_stack=None,
        ),
        Family(
            name="decoder",
            model_type="coreformer_decoder",
            config_class="CoreformerDecoderConfig",
            module="modeling_decoder",
            description="GPT-style decoder (causal self-attention)",
            heads=(
                Head("AutoModel", "CoreformerDecoderModel", "feature-extraction"),
                Head("AutoModelForCausalLM", "CoreformerDecoderForCausalLM", "text-generation"),
                Head(
                    "AutoModelForSequenceClassification",
                    "CoreformerDecoderForSequenceClassification",
                    "text-classification",
                ),
                Head(
                    "AutoModelForTokenClassification", "CoreformerDecoderForTokenClassification", "token-classification"
                ),
            ),
            language_model_auto_class="AutoModelForCausalLM",
            special_tokens=(
                ("pad_token", "<pad>"),
                ("bos_token", "<s>"),
                ("eos_token", "</s>"),
                ("unk_token", "<unk>"),
            ),
            model_input_names=("input_ids", "attention_mask"),
            stacks=("decoder",),
            cross_attention_stack=None,
        ),
        Family(
            name="seq2seq",
            model_type="coreformer_seq2seq",
            config_class="CoreformerSeq2SeqConfig",
            module="modeling_seq2seq",
            description="BART-style encoder-decoder (bidirectional encoder, causal decoder with cross-attention)",
            heads=(
                Head("AutoModel", "CoreformerSeq2SeqModel", "feature-extraction"),
                Head("AutoModelForSeq2SeqLM", "CoreformerSeq2SeqForConditionalGeneration", "text2text-generation"),
                Head(
                    "AutoModelForSequenceClassification",
                    "CoreformerSeq2SeqForSequenceClassification",
                    "text-classification",
                ),
            ),
            language_model_auto_class="AutoModelForSeq2SeqLM",
            special_tokens=(
                ("bos_token", "<s>"),
                ("pad_token", "<pad>"),
                ("eos_token", "</s>"),
                ("unk_token", "<unk>"),
                ("mask_token", "<mask>"),
            ),
            model_input_names=("input_ids", "attention_mask"),
            stacks=("encoder", "decoder"),
            cross_attention_stack="decoder",
        ),
    )
}


MODEL_TYPES: dict[str, Family] = {family.model_type: family for family in FAMILIES.values()}


def family_of_model_type(model_type: str | None) -> Family:
    """The family whose config.json says `model_type`; ValueError naming the coreformer model types otherwise."""
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    known = ", ".join(MODEL_TYPES)
    raise ValueError(
        f"model_type {model_type!r} is not a coreformer family ({known}); convert a transformers BERT / RoBERTa / "
        f"GPT-2 / BART checkpoint first with `coreformer convert SRC DST`."
    )


def head_of_class(class_name: str) -> tuple[Family, Head]:
    """The family and head of a coreformer model class name; ValueError when no family registers it."""
    for family in FAMILIES.values():
        for head in family.heads:
            if head.class_name == class_name:
                return family, head
    raise ValueError(f"{class_name} is not a registered coreformer model class (see coreformer.families.FAMILIES).")


# Module names every coreformer block has, whatever its options. They are Llama's names (a gated MLP adds Llama's
# gate_proj), so PEFT's Llama defaults fit every family wherever they name only these.
BLOCK_MODULE_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"})
PEFT_REFERENCE_MODEL_TYPE = "llama"


PEFT_TABLES = "peft.utils.constants"  # the module holding PEFT's default target modules per model type


def register_with_peft() -> None:
    """Give PEFT default target modules for every coreformer model type, so `get_peft_model(model, LoraConfig())`
    works without `target_modules` (LoRA then adapts every attention's q_proj and v_proj, as PEFT does for Llama).

    PEFT picks defaults by `config.model_type` from its own tables (peft.utils.constants) and offers no way for a model
    to declare them, so each table that has a Llama entry naming only `BLOCK_MODULE_NAMES` gets the same entry for
    every family. Nothing is imported: the tables are filled now if peft is loaded, else the moment it is
    (`_FillPeftTablesOnImport`), so `import coreformer` does not pay for peft's import when no adapter is used.
    `configuration_coreformer.py` calls this on import, which also covers a checkpoint loaded with
    `trust_remote_code=True`, whether peft is imported before or after.
    """
    if PEFT_TABLES in sys.modules:
        _fill_peft_tables(sys.modules[PEFT_TABLES])
    elif not any(isinstance(finder, _FillPeftTablesOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FillPeftTablesOnImport())


def _fill_peft_tables(constants: ModuleType) -> None:
    for name, table in vars(constants).items():
        if not (name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_MAPPING") and isinstance(table, dict)):
            continue
        reference = table.get(PEFT_REFERENCE_MODEL_TYPE)
        if isinstance(reference, list | tuple) and set(reference) <= BLOCK_MODULE_NAMES:
            for family in FAMILIES.values():
                table.setdefault(family.model_type, list(reference))


class _FillPeftTablesOnImport(importlib.abc.MetaPathFinder):
    """An import hook, once: when `peft.utils.constants` is imported, it leaves sys.meta_path, lets the other finders
    find the module, and fills the tables as soon as the module has run (PEFT reads them only later, when a model is
    adapted)."""

    def find_spec(self, fullname: str, path, target=None) -> ModuleSpec | None:
        if fullname != PEFT_TABLES:
            return None
        if self in sys.meta_path:  # once, whoever asks
            sys.meta_path.remove(self)
        for finder in list(sys.meta_path):  # a copy: another copy of this hook removes itself too
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def run_then_fill(module: ModuleType) -> None:
                run(module)
                _fill_peft_tables(module)

            spec.loader.exec_module = run_then_fill
        return spec
