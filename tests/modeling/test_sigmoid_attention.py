"""The "sigmoid" layer type (`sigmoid_attention.py`): its dense formula written out here, under every backend, in
encoders and decoders; padding, packed rows, caches, probabilities and gradient checkpointing; serving engines refuse
it by name."""

import math

import pytest
import torch
from tiny import FLEX_HEADS, FLEX_LENGTH, VOCAB, decode_incrementally, padded_batch, tiny_model
from transformers.cache_utils import StaticCache

import coreformer as cf
from coreformer.attention import Attention, apply_rotary, repeat_kv
from coreformer.compat import enable_activation_checkpointing
from coreformer.forward_plan import LayerPlan
from coreformer.layer_types import check_served
from coreformer.layers import RotaryEmbedding

N = 20  # sigmoid_length: the bias is -log 20


def sigmoid_model(family: str = "decoder", **overrides):
    fields = dict(num_key_value_heads=2, layer_types=["sigmoid", "full"], sigmoid_length=N)
    if family == "decoder":
        fields["position_embedding_type"] = "rotary"
    model_class = cf.CoreformerDecoderForCausalLM if family == "decoder" else cf.CoreformerEncoderForMaskedLM
    return tiny_model(model_class, family, **(fields | overrides))


def written_out(attention: Attention, states: torch.Tensor, visible: torch.Tensor, rotary=None) -> torch.Tensor:
    """Sigmoid attention as the paper writes it: o_proj(sigmoid(q kᵀ / sqrt(d) - log n) v over the visible keys).
    states (B, T, hidden); visible (B, T, S) booleans."""
    batch, length, _ = states.shape
    heads, dim = attention.num_heads, attention.head_dim
    query = attention.q_proj(states).view(batch, length, heads, dim).transpose(1, 2)  # (B, H, T, D)
    key = attention.k_proj(states).view(batch, length, -1, dim).transpose(1, 2)  # (B, H_kv, T, D)
    value = attention.v_proj(states).view(batch, length, -1, dim).transpose(1, 2)
    if rotary is not None:
        query, key = apply_rotary(query, key, *rotary)
    key, value = repeat_kv(key, attention.num_key_value_groups), repeat_kv(value, attention.num_key_value_groups)
    weights = torch.sigmoid(query @ key.transpose(-1, -2) / math.sqrt(dim) - math.log(N)) * visible[:, None]
    return attention.o_proj((weights @ value).transpose(1, 2).reshape(batch, length, heads * dim))


def sigmoid_attention(is_causal: bool) -> Attention:
    config = cf.CoreformerDecoderConfig(
        vocab_size=VOCAB, num_hidden_layers=1, intermediate_size=48, position_embedding_type="rotary",
        layer_types=["sigmoid"], sigmoid_length=N, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return Attention(config, 0, is_causal=is_causal, layer_type="sigmoid").eval()


@pytest.mark.parametrize("is_causal", [True, False])
def test_sigmoid_layer_is_its_written_out_formula(is_causal):
    attention = sigmoid_attention(is_causal)
    states = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    real = torch.ones(2, 9, dtype=torch.bool)
    real[1, :3] = False  # left padding in the second row
    visible = real[:, None, :].expand(-1, 9, -1)  # (B, T, S)
    if is_causal:
        visible = visible & torch.ones(9, 9, dtype=torch.bool).tril()
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[:, None]
    rotary = RotaryEmbedding(attention.config)(states, torch.arange(9).unsqueeze(0))
    with torch.no_grad():
        ours, weights = attention(states, LayerPlan(mask=additive, kernel=True, position_embeddings=rotary,
                                                    output_attentions=True))  # fmt: skip
        expected = written_out(attention, states, visible, rotary)
    torch.testing.assert_close(ours[real], expected[real], rtol=0, atol=1e-6)
    assert weights.shape == (2, 4, 9, 9) and (weights[~visible[:, None].expand(-1, 4, -1, -1)] == 0).all()


@pytest.mark.xdist_group("flex_attention")  # with the other flex tests: they share one worker's compiled kernels
@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_sdpa_and_flex_compute_what_eager_computes(family, flex_attention):
    model = sigmoid_model(family, **FLEX_HEADS)
    ids, mask = padded_batch(length=FLEX_LENGTH, left=family == "decoder")
    outputs = {}
    for backend in ("eager", "sdpa", "flex_attention"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            outputs[backend] = model(ids, attention_mask=mask, output_attentions=True)
    real = mask.bool()
    for backend in ("sdpa", "flex_attention"):
        torch.testing.assert_close(outputs[backend].logits[real], outputs["eager"].logits[real], rtol=0, atol=1e-5)
        torch.testing.assert_close(outputs[backend].attentions[0], outputs["eager"].attentions[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_packed_row_gives_each_document_what_it_gets_alone(family):
    model = sigmoid_model(family)
    model.set_attn_implementation("sdpa")
    lengths = (5, 7)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = model(ids, position_ids=positions, use_cache=False).logits
        alone = [model(document).logits for document in ids.split(lengths, dim=1)]
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_decoding_equals_the_full_forward(cache):
    model = sigmoid_model()
    model.set_attn_implementation("sdpa")
    ids, mask = padded_batch(left=True)
    static = StaticCache(config=model.config, max_cache_len=16) if cache == "static" else None
    incremental, full, _ = decode_incrementally(model, ids, mask, cache=static)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], rtol=0, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    ids, mask = padded_batch()
    runs = []
    for checkpointing in (False, True):
        model = sigmoid_model().train()
        if checkpointing:
            enable_activation_checkpointing(model)
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), model.model.decoder.layers[0].self_attn.q_proj.weight.grad))
    torch.testing.assert_close(runs[1][0], runs[0][0])
    torch.testing.assert_close(runs[1][1], runs[0][1])


def test_bias_is_minus_log_sigmoid_length_or_max_positions():
    from coreformer.sigmoid_attention import sigmoid_bias

    assert sigmoid_bias(sigmoid_model().config) == -math.log(N)
    assert sigmoid_bias(sigmoid_model(sigmoid_length=None).config) == -math.log(64)  # tiny max_position_embeddings
    with pytest.raises(ValueError, match="`sigmoid_length`.*must be a positive integer or None"):
        sigmoid_model(sigmoid_length=0)


def test_serving_engines_refuse_it_by_name():
    with pytest.raises(ValueError, match=r"'sigmoid' \(layer 0\)"):
        check_served(["sigmoid", "full"], "vLLM", "use generate().")
