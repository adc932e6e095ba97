"""What the rotary decoders share: the Llama family (llama.py, mistral.py, qwen2.py: the same weight names, RMSNorm
pre-norm blocks, gated MLP, grouped-query attention) and, for the config fields, GPT-NeoX (gpt_neox.py).

    rope_theta(name, config)                  the rotary base; scaled rotary variants are refused
    rotary_decoder_fields(config, name)       config fields every rotary decoder reads alike
    read_llama_config(model, name, **fields)  a Llama-family native config -> coreformer
    sliding_fields(config, layer_types)       native sliding layers -> coreformer layer_types / sliding_window
    written_llama_fields(config)              coreformer config -> the fields every Llama-family config has
    llama_block(native)                       what a coreformer config needs to be a Llama-family block
    llama_architecture(...)                   one Llama-family architecture: these rules and heads, its own config
"""

from collections.abc import Callable

from transformers import PreTrainedConfig, PreTrainedModel

from ..configuration_coreformer import CoreformerConfig, CoreformerDecoderConfig
from ..layer_types import LAYER_TYPES
from .base import (
    WB,
    NativeArchitecture,
    Rule,
    StateDict,
    check_activation,
    decoder_heads,
    read_common_fields,
    unsupported,
    write_common_fields,
)
from .requirements import Requirement, equals, every_block_normed, plain_heads, pooled_classifier

# Llama, Mistral and Qwen2 share their names: pre-norm blocks, RMSNorm, gated MLP, a final norm.
LLAMA_BASE_RULES: tuple[Rule, ...] = (
    (r"embed_tokens\.weight", "decoder.embed_tokens.weight"),
    (rf"layers\.(\d+)\.self_attn\.([qkvo])_proj\.{WB}", r"decoder.layers.\1.self_attn.\2_proj.\3"),
    (r"layers\.(\d+)\.input_layernorm\.weight", r"decoder.layers.\1.self_attn_norm.weight"),
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", r"decoder.layers.\1.mlp_norm.weight"),
    (rf"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.{WB}", r"decoder.layers.\1.mlp.\2_proj.\3"),
    (r"norm\.weight", "decoder.norm.weight"),
)


def rope_theta(model_name: str, config: PreTrainedConfig) -> float:
    """The base of plain rotary positions; scaled variants (linear, dynamic, YaRN, Llama 3) have no coreformer field."""
    rope = dict(config.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise unsupported(model_name, f"rope_parameters.rope_type={rope_type!r}", "(scaled rotary frequencies)")
    return float(rope.get("rope_theta", getattr(config, "default_theta", 10000.0)))


def rotary_decoder_fields(config: PreTrainedConfig, name: str) -> dict:
    """What the Llama-family and GPT-NeoX readers share: rotary pre-norm blocks with a final norm, no embedding norm,
    no token types, an LM projection without transform or bias, a bias-free `score` classifier; sizes, tokens,
    labels."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": check_activation(name, config.hidden_act),
        "max_position_embeddings": config.max_position_embeddings,
        "position_embedding_type": "rotary",
        "rope_theta": rope_theta(name, config),
        "type_vocab_size": 0,
        "norm_position": "pre",
        "embedding_layernorm": False,
        "final_norm": True,
        "attention_dropout": config.attention_dropout,
        "lm_head_transform": False,
        "lm_head_bias": False,
        "classifier_dense": False,
        "classifier_bias": False,
        "initializer_range": config.initializer_range,
        **read_common_fields(config),
    }


def read_llama_config(model: PreTrainedModel, name: str, **fields) -> CoreformerDecoderConfig:
    """Llama: rotary, RMSNorm pre-norm blocks with a final norm, gated MLP, grouped-query attention, no embedding norm.
    `fields` are what the Mistral / Qwen2 readers set on top (sliding layers, biases)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    translated = {
        **rotary_decoder_fields(config, name),
        "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
        "head_dim": head_dim,
        "gated_mlp": True,
        "norm_type": "rmsnorm",
        "layer_norm_eps": config.rms_norm_eps,
        "attention_bias": getattr(config, "attention_bias", False),
        "mlp_bias": getattr(config, "mlp_bias", False),
        "hidden_dropout": 0.0,  # Llama has no dropout on embeddings or residual branches
        "classifier_dropout": 0.1,  # GenericForTokenClassification's fallback (these configs have no dropout field)
    }
    return CoreformerDecoderConfig(**{**translated, **fields})


def sliding_fields(config: PreTrainedConfig, layer_types: list[str]) -> dict:
    """Sliding layers: transformers' window counts the query itself, coreformer's counts the keys before it."""
    if "sliding_attention" not in layer_types or config.sliding_window is None:
        return {"layer_types": ["full"] * len(layer_types)}
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise unsupported(type(config).__name__, f"layer_types with {unknown}", "(attention types)")
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    return {"layer_types": [names[kind] for kind in layer_types], "sliding_window": config.sliding_window - 1}


def transformers_window(config: CoreformerConfig) -> int:
    """transformers' window counts the query itself; coreformer's counts the keys on one side of it."""
    return LAYER_TYPES["sliding"].transformers_window(config.sliding_window)


def written_llama_fields(config: CoreformerConfig) -> dict:
    """The fields every Llama-family native config takes from a coreformer config."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layer_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.initializer_range,
        "use_cache": config.use_cache,
        **write_common_fields(config),
    }


def llama_block(native: str) -> list[Requirement]:
    """Llama-family blocks: rotary positions, RMSNorm pre-norm with a final norm, gated MLP, no embedding norm."""
    return [
        *every_block_normed(native),
        Requirement(
            "local_rope_theta",
            lambda value, config: value in (None, config.rope_theta),
            f"{native} has one rope_theta for every layer",
        ),
        equals("position_embedding_type", "rotary", f"{native} uses rotary positions"),
        equals("norm_type", "rmsnorm", f"{native} uses RMSNorm"),
        equals("norm_position", "pre", f"{native} is pre-norm"),
        equals("final_norm", True, f"{native} has a final norm"),
        equals("embedding_layernorm", False, f"{native} has no embedding norm"),
        equals("scale_embedding", False, f"{native} does not scale embeddings"),
        equals("gated_mlp", True, f"{native}'s MLP is gated"),
        equals("type_vocab_size", 0, f"{native} has no token types"),
    ]


def llama_architecture(
    name: str,
    prefix: str,
    native: str,
    *,
    read_config: Callable[[PreTrainedModel, bool], CoreformerConfig],
    write_config: Callable[[CoreformerConfig], PreTrainedConfig],
    requirements: tuple[Requirement, ...],
    prepare_weights: Callable[[PreTrainedModel, StateDict], StateDict] | None = None,
    restore_weights: Callable[[PreTrainedModel, StateDict], StateDict] | None = None,
    zero_filled: tuple[str, ...] = (),
    extra_rules: tuple[Rule, ...] = (),
    attention_options: tuple[str, ...] = (),
) -> NativeArchitecture:
    """A Llama-family architecture: Llama's weight names and heads (transformers' generic sequence and token
    classifiers, `score`), `llama_block` and the plain heads, then `requirements` of its own; `extra_rules`: the
    weights its layers hold beyond Llama's (DiffLlama's λ vectors)."""
    return NativeArchitecture(
        name=name,
        family="decoder",
        heads=decoder_heads(prefix, ((rf"score\.{WB}", r"classifier.\1"),)),
        base_rules=(*LLAMA_BASE_RULES, *extra_rules),
        read_config=read_config,
        write_config=write_config,
        requirements=(
            *llama_block(native),
            *requirements,
            *plain_heads(native, lm_transform=False, lm_bias=False),
            *pooled_classifier(native, dense=False),
        ),
        prepare_weights=prepare_weights,
        restore_weights=restore_weights,
        zero_filled=zero_filled,
        attention_options=attention_options,
    )
