"""The attention options of `attention.py` (QK-norm, gated attention, attention sinks): exact against transformers'
Qwen3NextAttention and GptOssAttention on copied weights under every backend, and everywhere the other options work
(padding, packed rows, caches, probabilities, gradient checkpointing); serving engines without sinks refuse them."""

import copy
import re

import pytest
import torch
from tiny import VOCAB, decode_incrementally, padded_batch, tiny_config, tiny_model
from transformers import GptOssConfig, Qwen3NextConfig
from transformers.cache_utils import StaticCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention

import coreformer as cf
from coreformer.attention import Attention, sink_column
from coreformer.compat import enable_activation_checkpointing
from coreformer.forward_plan import LayerPlan
from coreformer.layers import RotaryEmbedding
from coreformer.vllm_serving import refuse_unserved

HEADS = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # grouped-query
LENGTH = 12
WINDOW = 4  # transformers' sliding window (the query counted in); coreformer's `sliding_window` is WINDOW - 1
HEAD = {
    "encoder": cf.CoreformerEncoderForMaskedLM,
    "decoder": cf.CoreformerDecoderForCausalLM,
    "seq2seq": cf.CoreformerSeq2SeqForConditionalGeneration,
}
ALL_OPTIONS = dict(qk_norm=True, attention_gate="elementwise", attention_sinks=True)


def coreformer_attention(layer_type: str = "full", **options) -> Attention:
    config = cf.CoreformerDecoderConfig(
        vocab_size=VOCAB, num_hidden_layers=1, intermediate_size=48, position_embedding_type="rotary",
        layer_norm_eps=1e-6, layer_types=[layer_type], sliding_window=WINDOW - 1, **HEADS, **options,
    )  # fmt: skip
    return Attention(config, 0, is_causal=True, layer_type=layer_type).eval()


def inputs(padded: bool, seed: int = 0):
    """(B, T, hidden) states, their (B, T) padding mask (left-padded second row) or None, and rotary (cos, sin)."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(2, LENGTH, HEADS["hidden_size"], generator=generator)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, :3] = 0
    config = coreformer_attention().config
    positions = torch.arange(LENGTH).unsqueeze(0)
    return states, mask if padded else None, RotaryEmbedding(config)(states, positions)


def reference_mask(reference_config, backend: str, states, padding_mask, sliding: bool):
    """transformers' own mask for the reference layer's type, in `backend`'s form."""
    config = copy.copy(reference_config)
    config._attn_implementation = backend
    build = create_sliding_window_causal_mask if sliding else create_causal_mask
    positions = torch.arange(LENGTH).unsqueeze(0)
    return build(config, states, padding_mask, None, position_ids=positions)  # the cache passed by position (compat)


def compare(reference, ours, reference_config, backend: str, sliding: bool = False) -> float:
    """The largest difference between the reference (eager, its written-out definition) and ours under `backend`,
    over the real tokens of a padded batch and over an unpadded one (whose sdpa mask is None: is_causal); under flex
    the padded one only (each compiles its kernels: seconds on CPU)."""
    largest = 0.0
    for padded in (True,) if backend == "flex_attention" else (True, False):
        states, padding_mask, rotary = inputs(padded)
        if isinstance(reference, GptOssAttention):  # its rotary takes each angle once: (B, T, D / 2)
            rotary_reference = tuple(table[..., : HEADS["head_dim"] // 2] for table in rotary)
        else:
            rotary_reference = rotary
        with torch.no_grad():
            expected, _ = reference(
                states, rotary_reference, reference_mask(reference_config, "eager", states, padding_mask, sliding)
            )
            mask = reference_mask(reference_config, backend, states, padding_mask, sliding)
            ours.config._attn_implementation = backend
            actual, _ = ours(states, plan=LayerPlan(mask=mask, position_embeddings=rotary))
        real = padding_mask.bool() if padding_mask is not None else torch.ones(states.shape[:2], dtype=torch.bool)
        largest = max(largest, (actual - expected)[real].abs().max().item())
    return largest


# flex runs with the other flex tests (conftest's group: they share one worker's compiled kernels).
FLEX = pytest.param("flex_attention", marks=pytest.mark.xdist_group("flex_attention"))


@pytest.fixture(params=["eager", "sdpa", FLEX])
def backend(request) -> str:
    if request.param == "flex_attention":
        request.getfixturevalue("flex_attention")  # skips where flex cannot build its kernel
    return request.param


def test_elementwise_gate_and_qk_norm_match_qwen3_next_attention(backend):
    torch.manual_seed(0)
    reference_config = Qwen3NextConfig(
        num_hidden_layers=1, layer_types=["full_attention"], rms_norm_eps=1e-6, attention_bias=False, **HEADS
    )
    reference = Qwen3NextAttention(reference_config, 0).eval()
    for norm in (reference.q_norm, reference.k_norm):
        norm.weight.data.normal_(0.0, 0.5)  # zero-centred: scaled by 1 + weight
    ours = coreformer_attention(qk_norm=True, attention_gate="elementwise", attention_bias=False)
    weights = {k: v for k, v in reference.state_dict().items() if "norm" not in k}
    weights |= {f"{name}.weight": 1.0 + getattr(reference, name).weight for name in ("q_norm", "k_norm")}
    ours.load_state_dict(weights)
    assert compare(reference, ours, reference_config, backend) < 1e-5


@pytest.mark.parametrize("layer_type", ["full", "sliding"])
def test_sinks_match_gpt_oss_attention(backend, layer_type):
    torch.manual_seed(0)
    reference_config = GptOssConfig(
        num_hidden_layers=1, layer_types=[f"{layer_type}_attention"], sliding_window=WINDOW, **HEADS
    )
    reference = GptOssAttention(reference_config, 0).eval()
    reference.sinks.data.normal_(0.0, 1.0)  # large enough that the sink takes a real share
    ours = coreformer_attention(layer_type, attention_sinks=True)
    ours.load_state_dict(reference.state_dict())
    assert compare(reference, ours, reference_config, backend, sliding=layer_type == "sliding") < 1e-5


def test_headwise_gate_is_an_elementwise_gate_equal_across_each_head():
    headwise = coreformer_attention(attention_gate="headwise")
    elementwise = coreformer_attention(attention_gate="elementwise")
    assert headwise.q_proj.out_features == 4 * (8 + 1) and elementwise.q_proj.out_features == 4 * (8 + 8)
    rows = headwise.q_proj.weight.view(4, 9, -1)  # per head: 8 query rows, then its gate row
    biases = headwise.q_proj.bias.view(4, 9)
    weights = {k: v for k, v in headwise.state_dict().items() if not k.startswith("q_proj")}
    weights["q_proj.weight"] = torch.cat([rows[:, :8], rows[:, 8:].expand(4, 8, -1)], 1).flatten(0, 1)
    weights["q_proj.bias"] = torch.cat([biases[:, :8], biases[:, 8:].expand(4, 8)], 1).flatten()
    elementwise.load_state_dict(weights)
    states, _, rotary = inputs(padded=False)
    plan = LayerPlan(position_embeddings=rotary)
    with torch.no_grad():
        torch.testing.assert_close(headwise(states, plan)[0], elementwise(states, plan)[0], rtol=0, atol=1e-6)


def options_model(family: str = "decoder", seed: int = 0, **overrides):
    """A tiny model of `family` with every option on, full and sliding layers and grouped-query heads; its sinks
    drawn large, so that they matter."""
    fields = dict(ALL_OPTIONS, num_key_value_heads=2, layer_types=["full", "sliding"], sliding_window=3)
    if family == "decoder":
        fields["position_embedding_type"] = "rotary"
    if family == "seq2seq":
        fields["decoder_layer_types"] = ["sliding", "full"]
    model = tiny_model(HEAD[family], family, seed, **(fields | overrides))
    for module in model.modules():
        if isinstance(module, Attention) and module.has_sinks:
            module.sinks.data.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    return model


def logits(model, ids, mask, **kwargs):
    if model.config.is_encoder_decoder:
        kwargs |= dict(decoder_input_ids=ids, decoder_attention_mask=mask)
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("family", ["encoder", "decoder", "seq2seq"])
def test_sdpa_and_its_probabilities_match_eager_on_padded_batches(family, left):
    model = options_model(family)
    model.set_attn_implementation("eager")  # models are built under sdpa
    ids, mask = padded_batch(left=left)
    eager = logits(model, ids, mask, output_attentions=True)
    model.set_attn_implementation("sdpa")
    sdpa = logits(model, ids, mask, output_attentions=True)
    real = mask.bool()
    torch.testing.assert_close(sdpa.logits[real], eager.logits[real], rtol=0, atol=1e-5)
    attentions = eager.attentions if family != "seq2seq" else eager.decoder_attentions
    for ours, reference in zip(sdpa.attentions if family != "seq2seq" else sdpa.decoder_attentions, attentions):
        assert ours.shape == (3, 4, 10, 10)  # the sink's column dropped, as GPT-OSS returns them
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
        rows = reference.sum(-1)[real[:, None].expand(-1, 4, -1)]
        assert (rows < 1 - 1e-3).all()  # each real query gives the sink a share


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_packed_row_gives_each_document_what_it_gets_alone(backend):
    model = options_model()
    model.set_attn_implementation(backend)
    lengths = (5, 7)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0)
    packed = logits(model, ids, None, position_ids=positions, use_cache=False).logits
    alone = [logits(model, document, None).logits for document in ids.split(lengths, dim=1)]
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_cached_decoding_equals_the_full_forward(backend, cache):
    model = options_model()
    model.set_attn_implementation(backend)
    ids, mask = padded_batch(left=True)
    static = StaticCache(config=model.config, max_cache_len=16) if cache == "static" else None
    incremental, full, _ = decode_incrementally(model, ids, mask, cache=static)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], rtol=0, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    ids, mask = padded_batch()
    runs = []
    for checkpointing in (False, True):
        model = options_model().train()
        if checkpointing:
            enable_activation_checkpointing(model)
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if "sinks" in name or "norm.weight" in name}
        runs.append((loss.detach(), grads))
    (loss, grads), (checkpointed_loss, checkpointed_grads) = runs
    torch.testing.assert_close(checkpointed_loss, loss)
    assert any("sinks" in name for name in grads) and all(grad is not None for grad in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, msg=name)


def test_options_are_off_by_default_and_add_their_keys_only_when_on():
    plain = set(cf.CoreformerDecoderForCausalLM(tiny_config("decoder")).state_dict())
    assert not any(key.endswith(("sinks", "q_norm.weight", "k_norm.weight")) for key in plain)
    model = options_model()
    added = set(model.state_dict()) - plain
    assert added == {
        f"model.decoder.layers.{i}.self_attn.{name}"
        for i in (0, 1)
        for name in ("sinks", "q_norm.weight", "k_norm.weight")
    }
    fresh = cf.CoreformerDecoderForCausalLM(model.config)  # _init_weights draws the sinks as GPT-OSS does
    sinks = torch.stack([layer.self_attn.sinks for layer in fresh.model.decoder.layers])
    assert sinks.isfinite().all() and 0 < sinks.std() < 0.1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(attention_gate="channelwise"), "`attention_gate` must be one of (None, 'elementwise', 'headwise')"),
        (dict(attention_sinks=True, layer_types=["full", "linear"]), "['linear'] layers compute their own scores"),
        (dict(qk_norm=True, layer_types=["lsh", "lsh"], lsh_bucket_size=4), "set qk_norm=False"),
    ],
)
def test_config_refuses_options_naming_the_fix(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config("decoder", **fields)


def test_serving_engines_without_sinks_refuse_them_by_name():
    sinks = options_model()
    with pytest.raises(ValueError, match="continuous batching.*attention_sinks=True"):
        sinks.model.decoder.planner.check_continuous_batching()
    with pytest.raises(ValueError, match="attention_sinks=True, but vLLM"):
        refuse_unserved(sinks.config, ["full", "sliding"], is_causal=True, cross_attention=False)
    gated = options_model(attention_sinks=False)  # the gate and QK-norm sit outside the attention call: served
    gated.model.decoder.planner.check_continuous_batching()
    refuse_unserved(gated.config, ["full", "sliding"], is_causal=True, cross_attention=False)


def test_backends_without_a_sink_are_refused_by_name():
    attention = coreformer_attention(attention_sinks=True)
    attention.config._attn_implementation = "flash_attention_2"  # no flash here: only the dispatch is exercised
    query = key = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="'flash_attention_2'.*use attn_implementation='sdpa'"):
        sink_column(attention, query, key, key, None, {})
