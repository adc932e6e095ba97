"""The "differential" layer type (`differential_attention.py`): exact against transformers' DiffLlamaAttention on
copied weights under eager, sdpa and flex, at every layer index (λ_init); in whole models with padding, packed rows,
caches, probabilities, gradient checkpointing; refused where it cannot run, by name."""

import re

import pytest
import torch
from tiny import (
    VOCAB,
    decode_incrementally,
    gradients_with_and_without_checkpointing,
    padded_batch,
    tiny_config,
    tiny_model,
)
from transformers import DiffLlamaConfig
from transformers.cache_utils import StaticCache
from transformers.masking_utils import create_causal_mask
from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention

import coreformer as cf
from coreformer.attention import Attention
from coreformer.forward_plan import LayerPlan
from coreformer.layer_types import check_served
from coreformer.layers import RotaryEmbedding

HEADS = dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=4, head_dim=4)  # grouped-query, 2 pairs
LENGTH = 12
EPS = 1e-6


def coreformer_attention(layer_idx: int) -> Attention:
    config = cf.CoreformerDecoderConfig(
        vocab_size=VOCAB, num_hidden_layers=layer_idx + 1, intermediate_size=48, position_embedding_type="rotary",
        layer_norm_eps=EPS, layer_types=["differential"] * (layer_idx + 1), attention_bias=False, **HEADS,
    )  # fmt: skip
    return Attention(config, layer_idx, is_causal=True, layer_type="differential").eval()


def inputs(padded: bool):
    """(B, T, hidden) states, their (B, T) padding mask (left-padded second row) or None, and rotary (cos, sin)."""
    states = torch.randn(2, LENGTH, HEADS["hidden_size"], generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, :3] = 0
    positions = torch.arange(LENGTH).unsqueeze(0)
    return states, mask if padded else None, RotaryEmbedding(coreformer_attention(0).config)(states, positions)


def causal_mask(config, backend: str, states, padding_mask):
    config._attn_implementation = backend
    return create_causal_mask(config, states, padding_mask, None, position_ids=torch.arange(LENGTH).unsqueeze(0))


FLEX = pytest.param("flex_attention", marks=pytest.mark.xdist_group("flex_attention"))


@pytest.fixture(params=["eager", "sdpa", FLEX])
def backend(request) -> str:
    if request.param == "flex_attention":
        request.getfixturevalue("flex_attention")  # skips where flex cannot build its kernel
    return request.param


@pytest.mark.parametrize("layer_idx", [0, 3])
def test_differential_layer_matches_diffllama_attention(backend, layer_idx):
    torch.manual_seed(0)
    reference_config = DiffLlamaConfig(rms_norm_eps=EPS, attention_bias=False, **HEADS)
    reference = DiffLlamaAttention(reference_config, layer_idx).eval()
    ours = coreformer_attention(layer_idx)
    ours.load_state_dict(reference.state_dict())  # q/k/v/o and the four λ vectors, by DiffLlama's names
    assert ours.lambda_init == reference.lambda_init
    largest = 0.0
    for padded in (True,) if backend == "flex_attention" else (True, False):
        states, padding_mask, rotary = inputs(padded)
        with torch.no_grad():
            expected, _ = reference(states, rotary, causal_mask(reference_config, "eager", states, padding_mask))
            ours.config._attn_implementation = backend
            mask = causal_mask(ours.config, backend, states, padding_mask)
            actual, _ = ours(states, plan=LayerPlan(mask=mask, position_embeddings=rotary, kernel=True))
        real = padding_mask.bool() if padding_mask is not None else torch.ones(2, LENGTH, dtype=torch.bool)
        largest = max(largest, (actual - expected)[real].abs().max().item())
    assert largest < 1e-5


def differential_model(family: str = "decoder", **overrides):
    fields = dict(num_key_value_heads=2, layer_types=["differential", "full"])
    if family == "decoder":
        fields["position_embedding_type"] = "rotary"
    model_class = cf.CoreformerDecoderForCausalLM if family == "decoder" else cf.CoreformerEncoderForMaskedLM
    return tiny_model(model_class, family, **(fields | overrides))


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_sdpa_and_its_probabilities_match_eager_on_padded_batches(family):
    model = differential_model(family)
    ids, mask = padded_batch(left=family == "decoder")
    with torch.no_grad():
        model.set_attn_implementation("eager")  # models are built under sdpa
        eager = model(ids, attention_mask=mask, output_attentions=True)
        model.set_attn_implementation("sdpa")
        sdpa = model(ids, attention_mask=mask, output_attentions=True)
    real = mask.bool()
    torch.testing.assert_close(sdpa.logits[real], eager.logits[real], rtol=0, atol=1e-5)
    # DiffLlama's attentions: each query head's softmax map (the first of its two calls)
    assert sdpa.attentions[0].shape == (3, 4, 10, 10)
    torch.testing.assert_close(sdpa.attentions[0], eager.attentions[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_decoding_equals_the_full_forward(cache):
    model = differential_model()
    model.set_attn_implementation("sdpa")
    ids, mask = padded_batch(left=True)
    static = StaticCache(config=model.config, max_cache_len=16) if cache == "static" else None
    incremental, full, _ = decode_incrementally(model, ids, mask, cache=static)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], rtol=0, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_loss_and_lambda_gradients():
    plain, checkpointed = gradients_with_and_without_checkpointing(differential_model, lambda name: "lambda" in name)
    assert len(plain) == 4 and all(grad is not None and grad.abs().sum() > 0 for grad in plain.values())
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


def test_lambdas_are_drawn_with_lambda_std_dev_and_saved_under_diffllamas_names():
    model = differential_model(lambda_std_dev=0.3)
    keys = [key for key in model.state_dict() if "lambda" in key]
    assert keys == [
        f"model.decoder.layers.0.self_attn.{name}" for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
    ]
    drawn = torch.cat([model.state_dict()[key] for key in keys])
    assert 0.15 < drawn.std() < 0.45


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_key_value_heads=1), "`num_key_value_heads` must be even, got 1"),
        (
            dict(attention_sinks=True),
            "['differential'] layers compute their own scores in a kernel or combine several maps",
        ),
    ],
)
def test_config_refuses_what_differential_layers_cannot_do(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config("decoder", layer_types=["differential", "full"], **fields)


def test_flash_attention_and_serving_engines_are_refused_by_name():
    attention = coreformer_attention(0)
    attention.config._attn_implementation = "flash_attention_2"  # no flash here: only the refusal is exercised
    states, _, rotary = inputs(padded=False)
    with pytest.raises(ValueError, match="values twice as wide as their keys.*flash_attention_2"):
        attention(states, plan=LayerPlan(position_embeddings=rotary, kernel=True))
    with pytest.raises(ValueError, match=r"'differential' \(layer 0\)"):
        check_served(["differential", "full"], "vLLM", "use generate().")
    # tensor parallelism: a rank holding half of the heads could not pair head i with head i + H/2
    with pytest.raises(ValueError, match="tensor parallelism splits across ranks.*without tp_plan"):
        attention.kernel.combine(attention, torch.zeros(1, 3, HEADS["num_attention_heads"] // 2, 8))
