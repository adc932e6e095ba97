"""What every native architecture is made of, and the two directions that run over it.

    NativeArchitecture       one transformers architecture (a `model_type`): its heads, weight-name rules, config
                             reader and writer, fuse/unfuse of fused weights, and what it can represent
    HeadConversion           one native head class <-> one coreformer head class
    Rule, WB                 a weight-name rule: (pattern, target[, reshape]); WB matches "weight" or "bias"
    rename(...)              apply rules to a state dict (every weight claimed, no silent drop)
    unsupported(...)         the one ValueError for a native option coreformer cannot reproduce
    read_common_fields / check_activation              what every config reader copies
    write_common_fields / classifier_dropout           what every config writer copies

Reading (native -> coreformer, `NativeArchitecture.to_coreformer`): the native config is read into a coreformer
config, the state dict is unfused (`prepare_weights`) and renamed through the head's rules, then the base model's,
and loaded with `strict=True`. Writing (coreformer -> native, `NativeArchitecture.to_native`) runs the same rules
backwards: the native model is built from the written config, each of its weight names is renamed as reading would,
and takes the coreformer weight of that name; `restore_weights` fuses the result back. So a round trip is the
identity by construction.

Never imported by the modeling files: those are copied next to checkpoints, this package is not.
"""

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN

from ..configuration_coreformer import CoreformerConfig
from ..modeling_base import CoreformerPreTrainedModel
from ..modeling_decoder import (
    CoreformerDecoderForCausalLM,
    CoreformerDecoderForSequenceClassification,
    CoreformerDecoderForTokenClassification,
    CoreformerDecoderModel,
)
from ..modeling_encoder import CoreformerEncoderForMaskedLM, CoreformerEncoderForQuestionAnswering
from .requirements import Requirement, plain_attention

# A rule renames the source weights whose name matches `pattern` (re.fullmatch) to `match.expand(target)`, optionally
# reshaping the tensor; target None drops the weight on purpose.
Rule = tuple[str, str | None] | tuple[str, str, Callable[[torch.Tensor], torch.Tensor]]
WB = r"(weight|bias)"
StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class HeadConversion:
    """How one native head class becomes one coreformer class, and back."""

    target: type[CoreformerPreTrainedModel]
    rules: tuple[Rule, ...] = ()  # full names on both sides (base-model prefix included)
    # Config fields this head sets over the architecture's translation (what the native head does differently).
    config: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class NativeArchitecture:
    """One transformers architecture, both directions.

    Attributes:
        name: the transformers `model_type` ("llama").
        family: the coreformer family it represents ("encoder" | "decoder" | "seq2seq").
        heads: native class name -> HeadConversion; each coreformer class appears once, so it also says which native
            class a coreformer head exports to.
        base_rules: the base model's weight names, relative to the base model on both sides.
        read_config: (native model, is the head masked LM?) -> coreformer config; raises `unsupported` for options
            coreformer cannot reproduce.
        write_config: coreformer config -> native config.
        requirements: what a coreformer config must hold to be written as this architecture.
        prepare_weights: rewrites the native state dict before renaming (GPT-2: transpose Conv1D, split c_attn).
        restore_weights: the inverse of prepare_weights, for writing. None where writing needs no layout change
            (Qwen2's prepare_weights only adds or drops zero biases).
        zero_filled: native weights coreformer has no counterpart for, written as zeros (regular expressions).
        adapt_weights: rewrites the coreformer state dict into the layout the native weights take, before writing.
        attention_options: the attention options of `requirements.plain_attention` this architecture has (Qwen3-Next:
            qk_norm, attention_gate); its own requirements say which values.
    """

    name: str
    family: str
    heads: dict[str, HeadConversion]
    base_rules: tuple[Rule, ...]
    read_config: Callable[[PreTrainedModel, bool], CoreformerConfig]
    write_config: Callable[[CoreformerConfig], PreTrainedConfig]
    requirements: tuple[Requirement, ...]
    prepare_weights: Callable[[PreTrainedModel, StateDict], StateDict] | None = None
    restore_weights: Callable[[PreTrainedModel, StateDict], StateDict] | None = None
    zero_filled: tuple[str, ...] = ()
    adapt_weights: Callable[[CoreformerConfig, StateDict], StateDict] | None = None
    attention_options: tuple[str, ...] = ()

    @property
    def export_heads(self) -> dict[str, str]:
        """coreformer class name -> the native class it is written as."""
        return {conversion.target.__name__: native for native, conversion in self.heads.items()}

    def differences(self, config: CoreformerConfig, class_name: str) -> list[str]:
        """Every requirement `config` breaks for `class_name`, in words ("field=value (what the native has)")."""
        requirements = (*self.requirements, *plain_attention(self.name, self.attention_options))
        found = [requirement.difference(config, class_name) for requirement in requirements]
        return list(filter(None, found))

    def rename_rules(self, model: PreTrainedModel, converted: CoreformerPreTrainedModel) -> list[Rule]:
        """Every rule renaming `model`'s weights (native names, after `prepare_weights`) to those of `converted`,
        full names on both sides: the head's rules, then the base model's."""
        # Base-model keys carry the prefix ("bert.", "model.") only inside a head model, on both sides.
        source_prefix = "" if model.base_model is model else f"{model.base_model_prefix}."
        target_prefix = "" if converted.base_model is converted else f"{converted.base_model_prefix}."
        base_rules = [
            (re.escape(source_prefix) + pattern, None if target is None else target_prefix + target, *transform)
            for pattern, target, *transform in self.base_rules
        ]
        # Head rules first: BertForSequenceClassification's pooler lives under the base prefix but belongs to the head.
        return [*self.heads[type(model).__name__].rules, *base_rules]

    def to_coreformer(self, model: PreTrainedModel) -> CoreformerPreTrainedModel:
        """The coreformer model computing what the native `model` computes (see conversion.convert_from_hf)."""
        source_name = type(model).__name__
        head = self.heads[source_name]
        config = self.read_config(model, head.target is CoreformerEncoderForMaskedLM)
        for name, value in head.config:
            setattr(config, name, value)
        config.validate_fields()
        if head.target is CoreformerEncoderForQuestionAnswering and model.config.num_labels != 2:
            raise unsupported(source_name, f"num_labels={model.config.num_labels}", "(QA predicts a start and an end)")
        state_dict = dict(model.state_dict())
        if self.prepare_weights is not None:
            state_dict = self.prepare_weights(model, state_dict)
        converted = head.target(config)
        state_dict = rename(state_dict, self.rename_rules(model, converted), source_name)
        fill_ties(converted, state_dict, source_name)
        converted.load_state_dict(state_dict, strict=True)
        return converted

    def to_native(self, model: CoreformerPreTrainedModel) -> PreTrainedModel:
        """The native model computing what `model` computes; the caller has checked `differences` is empty."""
        native_config = self.write_config(model.config)
        if isinstance(model, CoreformerEncoderForQuestionAnswering):
            native_config.num_labels = 2  # a start and an end logit, whatever the config's labels say
        native_config._attn_implementation = model.config._attn_implementation
        native = getattr(transformers, self.export_heads[type(model).__name__])(native_config)
        native.load_state_dict(self._written_weights(native, model), strict=True)
        return native

    def _native_name_map(
        self, native: PreTrainedModel, model: CoreformerPreTrainedModel, names: list[str]
    ) -> dict[str, str | None]:
        """Every native weight name (after `prepare_weights` where it has an inverse) -> the coreformer name reading
        renames it to (None: a weight reading drops on purpose)."""
        rules = self.rename_rules(native, model)
        mapped: dict[str, str | None] = {}
        for name in names:
            for pattern, target, *transform in rules:
                match = re.fullmatch(pattern, name)
                if match is None:
                    continue
                if transform:
                    raise ValueError(f"the conversion rule for {name} reshapes it; export has no inverse for it.")
                mapped[name] = None if target is None else match.expand(target)
                break
            else:
                raise ValueError(
                    f"no conversion rule names the native weight {name}; the {self.name} rules are incomplete."
                )
        return mapped

    def _written_weights(self, native: PreTrainedModel, model: CoreformerPreTrainedModel) -> StateDict:
        """The native state dict holding `model`'s weights; every coreformer weight must be used."""
        ours = model.state_dict()
        if self.adapt_weights is not None:
            ours = self.adapt_weights(model.config, ours)
        native_weights = dict(native.state_dict())
        if self.restore_weights is not None:
            native_weights = self.prepare_weights(native, native_weights)
        shapes = {name: tensor.shape for name, tensor in native_weights.items()}
        written: StateDict = {}
        used: set[str] = set()
        for name, ours_name in self._native_name_map(native, model, list(shapes)).items():
            if ours_name in ours:
                value = ours[ours_name]
                used.add(ours_name)
            elif ours_name is None or any(re.fullmatch(pattern, name) for pattern in self.zero_filled):
                value = torch.zeros(shapes[name], dtype=next(iter(ours.values())).dtype)
            else:
                raise ValueError(f"{type(model).__name__} has no {ours_name} for the native weight {name}.")
            if value.shape != shapes[name]:
                raise ValueError(f"{ours_name} is {tuple(value.shape)}, the native {name} {tuple(shapes[name])}.")
            written[name] = value
        used_storage = {ours[name].data_ptr() for name in used}
        unused = [name for name, tensor in ours.items() if name not in used and tensor.data_ptr() not in used_storage]
        if unused:
            raise ValueError(f"the native {type(native).__name__} has no place for {unused}; the export is incomplete.")
        if self.restore_weights is not None:
            written = self.restore_weights(native, written)
        return written


SAME_NAME_CLASSIFIER: tuple[Rule, ...] = ((rf"classifier\.{WB}", r"classifier.\1"),)


def decoder_heads(prefix: str, token_rules: tuple[Rule, ...], causal_lm: str | None = None) -> dict:
    """The four decoder heads of GPT-2, the Llama family and GPT-NeoX: an LM head `lm_head`, a bias-free `score`
    sequence classifier with no dropout in front of it, and a token classifier named by `token_rules`."""
    return {
        f"{prefix}Model": HeadConversion(CoreformerDecoderModel),
        causal_lm or f"{prefix}ForCausalLM": HeadConversion(
            CoreformerDecoderForCausalLM, ((r"lm_head\.weight", "lm_head.weight"),)
        ),
        f"{prefix}ForSequenceClassification": HeadConversion(
            CoreformerDecoderForSequenceClassification,
            ((r"score\.weight", "classifier.out_proj.weight"),),
            (("classifier_dropout", 0.0),),  # no dropout before `score`
        ),
        f"{prefix}ForTokenClassification": HeadConversion(CoreformerDecoderForTokenClassification, token_rules),
    }


def rename(state_dict: StateDict, rules: list[Rule], source_name: str) -> StateDict:
    """Apply the first matching rule to every weight; a weight no rule claims is an error, never a silent drop."""
    renamed: StateDict = {}
    unclaimed = []
    for name, tensor in state_dict.items():
        for pattern, target, *transform in rules:
            match = re.fullmatch(pattern, name)
            if match is None:
                continue
            if target is not None:
                target_name = match.expand(target)
                value = transform[0](tensor) if transform else tensor
                if target_name in renamed and not torch.equal(renamed[target_name], value):
                    raise ValueError(
                        f"{source_name}: two different weights map to {target_name} (a tie transformers broke?)."
                    )
                renamed[target_name] = value
            break
        else:
            unclaimed.append(name)
    if unclaimed:
        raise ValueError(
            f"{source_name}: no coreformer parameter for weights {unclaimed}; the conversion is incomplete."
        )
    return renamed


def fill_ties(model: CoreformerPreTrainedModel, state_dict: StateDict, source_name: str) -> None:
    """Every name of a tied coreformer parameter must receive one value: copy it to names the source did not have,
    and refuse sources whose values differ (coreformer would share one tensor between them)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    for names in groups.values():
        given = [name for name in names if name in state_dict]
        if len(names) == 1 or not given:
            continue
        reference = state_dict[given[0]]
        for name in given[1:]:
            if not torch.equal(state_dict[name], reference):
                raise ValueError(
                    f"{source_name}: coreformer shares one tensor between {names}, but the source weights "
                    f"{given[0]} and {name} differ."
                )
        for name in names:
            state_dict.setdefault(name, reference)


def match_device_and_mode(converted: torch.nn.Module, source: torch.nn.Module) -> None:
    """Put `converted` on `source`'s device and dtype, with its generation config when both generate."""
    parameter = next(source.parameters())
    converted.to(device=parameter.device, dtype=parameter.dtype)
    if source.can_generate() and converted.can_generate():
        converted.generation_config = copy.deepcopy(source.generation_config)


# ---------------------------------------------------------------------------------------------------------------
# What every config reader and writer copies
# ---------------------------------------------------------------------------------------------------------------


def unsupported(model_name: str, option: str, why: str) -> ValueError:
    """The one error for a native option coreformer cannot reproduce."""
    return ValueError(f"cannot convert this {model_name} checkpoint: {option} {why}; coreformer has no equivalent.")


def label_fields(config: PreTrainedConfig) -> dict:
    """Head labels: id2label / label2id (which fix num_labels) and problem_type."""
    id2label = dict(config.id2label)
    label2id = dict(config.label2id) if config.label2id else {label: i for i, label in id2label.items()}
    return {"id2label": id2label, "label2id": label2id, "problem_type": config.problem_type}


def token_fields(config: PreTrainedConfig, *names: str) -> dict:
    """Special token ids by name (None where the native config has no such field)."""
    return {name: getattr(config, name, None) for name in names}


def check_activation(model_name: str, act) -> str:
    """`act` when it is a transformers ACT2FN name (coreformer looks activations up there too)."""
    if not isinstance(act, str) or act not in ACT2FN:
        raise unsupported(model_name, f"hidden_act={act!r}", "is not a transformers ACT2FN name")
    return act


def read_common_fields(config: PreTrainedConfig, *more_tokens: str) -> dict:
    """Labels, special tokens (pad, bos, eos and `more_tokens`) and the LM tie, read from any native config."""
    return {
        "tie_word_embeddings": config.tie_word_embeddings,
        **token_fields(config, "pad_token_id", "bos_token_id", "eos_token_id", *more_tokens),
        **label_fields(config),
    }


def write_common_fields(config: CoreformerConfig) -> dict:
    """Labels, special tokens and the LM tie, as every native config names them."""
    return {
        "id2label": dict(config.id2label),
        "label2id": dict(config.label2id),
        "problem_type": config.problem_type,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
    }


def classifier_dropout(config: CoreformerConfig) -> float:
    """The dropout in front of the classifier: coreformer falls back to hidden_dropout, as the native heads do."""
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
