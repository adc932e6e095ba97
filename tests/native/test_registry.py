"""The registry of native architectures (coreformer.native): adding one is one file plus one registry line.

A toy OPT architecture is written as its own module in a temporary folder, registered with one line, and a tiny
OPTForCausalLM is converted to coreformer and exported back to a native folder through `convert_from_hf`,
`export_to` and `choose_target`, none of which name it.
"""

import importlib.util
import sys
import textwrap

import pytest
import torch
import transformers

import coreformer as cf
from coreformer.export import choose_target, export_to, to_native
from coreformer.native import NATIVE_ARCHITECTURES, architecture_of_class, register, supported_classes
from coreformer.native.conversion import convert_from_hf
from coreformer.native.parity import compare_models, tolerance

# The whole of a native architecture, as a contributor would write it in src/coreformer/native/opt.py (imports made
# absolute: it lives outside the package here). OPT's positions are stored from row 2, like BART's.
TOY_OPT = '''
"""OPT <-> coreformer decoder: LayerNorm pre-norm, learned positions stored from row 2, biases, a final norm."""

from transformers import OPTConfig

from coreformer.configuration_coreformer import CoreformerDecoderConfig
from coreformer.native.base import (
    WB, HeadConversion, NativeArchitecture, read_common_fields, unsupported, write_common_fields,
)
from coreformer.modeling_decoder import CoreformerDecoderForCausalLM, CoreformerDecoderModel
from coreformer.native.requirements import DECODER_COMMON, equals, plain_block, plain_heads

LAYERS = r"decoder\\.layers\\.(\\d+)"
BASE_RULES = (
    (r"decoder\\.embed_tokens\\.weight", "decoder.embed_tokens.weight"),
    (r"decoder\\.embed_positions\\.weight", "decoder.embed_positions.weight"),
    (rf"{LAYERS}\\.self_attn\\.([qkv])_proj\\.{WB}", r"decoder.layers.\\1.self_attn.\\2_proj.\\3"),
    (rf"{LAYERS}\\.self_attn\\.out_proj\\.{WB}", r"decoder.layers.\\1.self_attn.o_proj.\\2"),
    (rf"{LAYERS}\\.self_attn_layer_norm\\.{WB}", r"decoder.layers.\\1.self_attn_norm.\\2"),
    (rf"{LAYERS}\\.fc1\\.{WB}", r"decoder.layers.\\1.mlp.up_proj.\\2"),
    (rf"{LAYERS}\\.fc2\\.{WB}", r"decoder.layers.\\1.mlp.down_proj.\\2"),
    (rf"{LAYERS}\\.final_layer_norm\\.{WB}", r"decoder.layers.\\1.mlp_norm.\\2"),
    (rf"decoder\\.final_layer_norm\\.{WB}", r"decoder.norm.\\1"),
)
HEADS = {
    "OPTModel": HeadConversion(CoreformerDecoderModel),
    "OPTForCausalLM": HeadConversion(CoreformerDecoderForCausalLM, ((r"lm_head\\.weight", "lm_head.weight"),)),
}


def read_config(model, is_mlm):
    config = model.config
    if not config.do_layer_norm_before or config.word_embed_proj_dim != config.hidden_size:
        raise unsupported("OPT", "do_layer_norm_before=False or word_embed_proj_dim", "(post-norm, projections)")
    return CoreformerDecoderConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_dim,
        hidden_act=config.activation_function, max_position_embeddings=config.max_position_embeddings,
        position_embedding_type="learned", position_offset=2, type_vocab_size=0, norm_position="pre",
        layer_norm_eps=1e-5, embedding_layernorm=False, final_norm=True, hidden_dropout=config.dropout,
        attention_dropout=config.attention_dropout, lm_head_transform=False, lm_head_bias=False,
        initializer_range=config.init_std, **read_common_fields(config),
    )


def write_config(config):
    return OPTConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, ffn_dim=config.intermediate_size,
        activation_function=config.hidden_act, max_position_embeddings=config.max_position_embeddings,
        dropout=config.hidden_dropout, attention_dropout=config.attention_dropout, init_std=config.initializer_range,
        word_embed_proj_dim=config.hidden_size, **write_common_fields(config),
    )


OPT = NativeArchitecture(
    name="opt",
    family="decoder",
    heads=HEADS,
    base_rules=BASE_RULES,
    read_config=read_config,
    write_config=write_config,
    requirements=(
        *plain_block("OPT", "pre"),
        equals("position_offset", 2, "OPT stores positions from row 2"),
        equals("final_norm", True, "OPT has a final norm"),
        equals("embedding_layernorm", False, "OPT has no embedding norm"),
        equals("scale_embedding", False, "OPT does not scale embeddings"),
        equals("layer_norm_eps", 1e-5, "OPT's LayerNorms use torch's default eps"),
        *DECODER_COMMON,
        *plain_heads("OPT", lm_transform=False, lm_bias=False),
    ),
)
'''


@pytest.fixture
def toy_opt(tmp_path, monkeypatch):
    """The toy module, imported from a temporary folder and registered with one line."""
    path = tmp_path / "toy_opt.py"
    path.write_text(textwrap.dedent(TOY_OPT))
    spec = importlib.util.spec_from_file_location("toy_opt", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "toy_opt", module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(NATIVE_ARCHITECTURES, "opt", module.OPT)  # the one registry line
    return module


def tiny_opt() -> transformers.OPTForCausalLM:
    config = transformers.OPTConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=48,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        init_std=0.2,
    )
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(config).eval()


def right_padded_batch() -> dict[str, torch.Tensor]:
    input_ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}


def test_a_toy_architecture_converts_and_exports_through_the_registry(toy_opt, tmp_path):
    source = tiny_opt()
    assert architecture_of_class("OPTForCausalLM") is toy_opt.OPT and "OPTForCausalLM" in supported_classes()

    converted = convert_from_hf(source)
    assert isinstance(converted, cf.CoreformerDecoderForCausalLM) and converted.config.position_offset == 2
    inputs = right_padded_batch()
    assert max(compare_models(source, converted, inputs).differences.values()) <= tolerance("f32")

    assert choose_target(converted.config, type(converted).__name__) == (toy_opt.OPT, "OPTForCausalLM")
    native = to_native(converted)
    assert type(native) is transformers.OPTForCausalLM
    for name, tensor in source.state_dict().items():
        assert torch.equal(native.state_dict()[name], tensor), name  # the round trip is the identity

    converted.save_pretrained(tmp_path / "coreformer")
    summary = export_to(tmp_path / "coreformer", tmp_path / "native")
    assert summary["native_class"] == "OPTForCausalLM" and summary["target"] == "opt"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(reloaded) is transformers.OPTForCausalLM
    assert max(compare_models(source, reloaded, inputs).differences.values()) <= tolerance("f32")


def test_without_the_registry_line_the_toy_is_refused():
    with pytest.raises(ValueError, match="does not support OPTForCausalLM"):
        convert_from_hf(tiny_opt())


def test_register_refuses_a_model_type_or_class_claimed_twice():
    from coreformer.native import bert, roberta

    assert list(register(bert.BERT, roberta.ROBERTA)) == ["bert", "roberta"]
    with pytest.raises(ValueError, match="registered twice"):
        register(bert.BERT, bert.BERT)


def test_every_coreformer_head_is_written_by_one_native_class_per_architecture():
    for architecture in NATIVE_ARCHITECTURES.values():
        targets = [head.target for head in architecture.heads.values()]
        assert len(set(targets)) == len(targets), architecture.name
        assert all(cf.families.head_of_class(target.__name__)[0].name == architecture.family for target in targets)


def test_the_front_pages_and_the_help_texts_name_exactly_the_registered_architectures():
    import re
    from pathlib import Path

    import coreformer_cli
    from coreformer.native.names import NATIVE_NAMES

    root = Path(__file__).resolve().parents[2]
    assert list(NATIVE_ARCHITECTURES) == list(NATIVE_NAMES)
    for page in ("README.md", "docs/index.md"):
        text = " ".join((root / page).read_text().split())
        listed = re.search(r"native transformers architecture(?: they compute)? \(([^)]*)\)", text)
        assert listed and set(listed.group(1).split(", ")) == set(NATIVE_NAMES.values()), page
    for name in ("convert", "export"):
        help_text = " ".join(coreformer_cli.COMMANDS[name].build_parser().format_help().split())
        assert ", ".join(NATIVE_NAMES.values()) in help_text, name
