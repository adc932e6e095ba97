r"""The native architectures: transformers' own models that coreformer models read from and write to, ONE file each.

    NATIVE_ARCHITECTURES            model_type -> NativeArchitecture, in the order of names.py (NATIVE_NAMES);
                                    `export.choose_target` tries a family's in this order and writes the first whose
                                    requirements hold
    architecture_of_class(name)     the architecture whose heads include the native class `name`, or None
    supported_classes()             every native class `convert_from_hf` reads

Each file (bert.py, gpt2.py, ...) holds BOTH directions of one architecture: its weight-name rules, the config reader
(native -> coreformer, refusing what coreformer cannot reproduce), the config writer (coreformer -> native), the fuse
and unfuse of fused weights, and the `Requirement`s a coreformer config must meet to be written as it. conversion.py
(here) and coreformer.export only dispatch over this registry; parity.py holds the one output comparison and its
tolerances.

Adding an architecture is one file and one line in names.py (the torch-free list the help texts read too). For example
OPT, a LayerNorm pre-norm decoder whose positions are stored from row 2 (tests/native/test_registry.py runs this very
file from a temporary folder):

    # src/coreformer/native/opt.py
    from transformers import OPTConfig
    from ..configuration_coreformer import CoreformerDecoderConfig
    from ..modeling_decoder import CoreformerDecoderForCausalLM, CoreformerDecoderModel
    from .base import WB, HeadConversion, NativeArchitecture, read_common_fields, unsupported, write_common_fields
    from .requirements import DECODER_COMMON, equals, plain_block, plain_heads

    BASE_RULES = (  # native name (re.fullmatch, relative to the base model) -> coreformer name
        (r"decoder\.embed_tokens\.weight", "decoder.embed_tokens.weight"),
        (rf"decoder\.layers\.(\d+)\.fc1\.{WB}", r"decoder.layers.\1.mlp.up_proj.\2"),
        ...  # every other weight: a weight no rule claims is an error
    )
    HEADS = {"OPTModel": HeadConversion(CoreformerDecoderModel),
             "OPTForCausalLM": HeadConversion(CoreformerDecoderForCausalLM, ((r"lm_head\.weight", "lm_head.weight"),))}

    def read_config(model, is_mlm):   # refuse with `unsupported(...)` what coreformer cannot compute
        return CoreformerDecoderConfig(hidden_size=model.config.hidden_size, ..., **read_common_fields(model.config))

    def write_config(config):
        return OPTConfig(hidden_size=config.hidden_size, ..., **write_common_fields(config))

    OPT = NativeArchitecture("opt", "decoder", HEADS, BASE_RULES, read_config, write_config, requirements=(
        *plain_block("OPT", "pre"), equals("position_offset", 2, "OPT stores positions from row 2"), ...,
        *DECODER_COMMON, *plain_heads("OPT", lm_transform=False, lm_bias=False)))

    # src/coreformer/native/names.py, in NATIVE_NAMES:
    "opt": "OPT",

Never imported by the modeling files: those are copied next to checkpoints, this package is not.
"""

import importlib

from .base import HeadConversion, NativeArchitecture
from .names import NATIVE_NAMES


def register(*architectures: NativeArchitecture) -> dict[str, NativeArchitecture]:
    """The registry: model_type -> architecture, in export's order of preference within a family; ValueError when
    two claim one model_type or one native class."""
    registry: dict[str, NativeArchitecture] = {}
    classes: set[str] = set()
    for architecture in architectures:
        if architecture.name in registry or classes & set(architecture.heads):
            raise ValueError(f"{architecture.name}: its model_type or a native class is registered twice.")
        registry[architecture.name] = architecture
        classes |= set(architecture.heads)
    return registry


def architecture_in_module(model_type: str) -> NativeArchitecture:
    """The architecture named `model_type` in its own module (`coreformer.native.<model_type>`)."""
    module = importlib.import_module(f".{model_type}", __name__)
    found = [value for value in vars(module).values() if isinstance(value, NativeArchitecture)]
    return next(architecture for architecture in found if architecture.name == model_type)


NATIVE_ARCHITECTURES: dict[str, NativeArchitecture] = register(*map(architecture_in_module, NATIVE_NAMES))


def architecture_of_class(native_class: str) -> NativeArchitecture | None:
    """The registered architecture reading the native class `native_class` ("LlamaForCausalLM"), or None."""
    for architecture in NATIVE_ARCHITECTURES.values():
        if native_class in architecture.heads:
            return architecture
    return None


def supported_classes() -> tuple[str, ...]:
    """Every native class name the registry reads, architecture by architecture."""
    return tuple(name for architecture in NATIVE_ARCHITECTURES.values() for name in architecture.heads)


__all__ = ["NATIVE_ARCHITECTURES", "HeadConversion", "NativeArchitecture", "architecture_of_class", "supported_classes"]
