"""The "mla" layer type (`latent_attention.py`): exact against transformers' DeepseekV3Attention on copied weights
under eager, sdpa and flex, with and without a query latent; the cache holds the latents (bytes per token against a
full layer); static caches, gradient checkpointing; refused where it cannot run, by name."""

import re

import pytest
import torch
from tiny import decode_incrementally, gradients_with_and_without_checkpointing, padded_batch, tiny_config, tiny_model
from transformers import DeepseekV3Config
from transformers.cache_utils import StaticCache
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

import coreformer as cf
from coreformer.attention import Attention
from coreformer.forward_plan import LayerPlan
from coreformer.layer_types import check_served
from coreformer.layers import RotaryEmbedding

# DeepSeek-V3's shape in miniature: 4 heads, rotary part 4 (its qk_rope_head_dim, coreformer's head_dim), a key
# part without angles of 8, values of 6, a key/value latent of 12, a query latent of 16.
LATENT = dict(kv_lora_rank=12, qk_nope_head_dim=8, v_head_dim=6)
LENGTH = 10


def coreformer_attention(q_lora_rank: int | None) -> Attention:
    config = cf.CoreformerDecoderConfig(
        vocab_size=99, hidden_size=32, num_attention_heads=4, head_dim=4, intermediate_size=48, num_hidden_layers=1,
        position_embedding_type="rotary", layer_types=["mla"], attention_bias=False, q_lora_rank=q_lora_rank,
        **LATENT,
    )  # fmt: skip
    return Attention(config, 0, is_causal=True, layer_type="mla").eval()


def causal_mask(config, backend: str, states, padding_mask):
    config._attn_implementation = backend
    return create_causal_mask(config, states, padding_mask, None, position_ids=torch.arange(LENGTH).unsqueeze(0))


FLEX = pytest.param("flex_attention", marks=pytest.mark.xdist_group("flex_attention"))


@pytest.fixture(params=["eager", "sdpa", FLEX])
def backend(request) -> str:
    if request.param == "flex_attention":
        request.getfixturevalue("flex_attention")  # skips where flex cannot build its kernel
    return request.param


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_mla_layer_matches_deepseek_v3_attention(backend, q_lora_rank):
    torch.manual_seed(0)
    reference_config = DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, qk_rope_head_dim=4,
        rope_interleave=False, attention_bias=False, **LATENT,
    )  # fmt: skip
    reference = DeepseekV3Attention(reference_config, 0).eval()
    for name, parameter in reference.named_parameters():
        if "layernorm" in name:
            parameter.data.normal_(1.0, 0.5)  # ones at init: make the latent norms' weights visible
    ours = coreformer_attention(q_lora_rank)
    ours.load_state_dict(reference.state_dict())  # DeepSeek-V3's names throughout
    states = torch.randn(2, LENGTH, 32, generator=torch.Generator().manual_seed(0))
    padding_mask = torch.ones(2, LENGTH, dtype=torch.long)
    padding_mask[1, :3] = 0
    rotary = RotaryEmbedding(ours.config)(states, torch.arange(LENGTH).unsqueeze(0))  # (B, T, 4)
    with torch.no_grad():
        expected, _ = reference(states, rotary, causal_mask(reference_config, "eager", states, padding_mask))
        ours.config._attn_implementation = backend
        mask = causal_mask(ours.config, backend, states, padding_mask)
        actual, _ = ours(states, plan=LayerPlan(mask=mask, position_embeddings=rotary, kernel=True))
    real = padding_mask.bool()
    assert (actual - expected)[real].abs().max() < 1e-5


def mla_model(**overrides):
    fields = dict(layer_types=["mla", "full"], position_embedding_type="rotary", q_lora_rank=16, **LATENT)
    return tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", **(fields | overrides))


def test_the_cache_holds_the_latents_fewer_bytes_per_token_than_a_full_layer():
    model = mla_model()
    ids, mask = padded_batch(left=True)
    incremental, full, cache = decode_incrementally(model, ids, mask)
    torch.testing.assert_close(incremental[mask.bool()], full[mask.bool()], rtol=0, atol=1e-5)
    latent, full_layer = cache.layers[0], cache.layers[1]
    assert latent.keys.shape == (3, 1, 10, 12) and latent.values.shape == (3, 1, 10, 8)  # latent, rotary key
    per_token = {
        name: (layer.keys[0, :, 0].numel() + layer.values[0, :, 0].numel()) * layer.keys.element_size()
        for name, layer in (("mla", latent), ("full", full_layer))
    }
    assert per_token == {"mla": (12 + 8) * 4, "full": 2 * 4 * 8 * 4}  # 80 bytes against 256 (fp32)


def test_static_cache_decoding_equals_the_full_forward():
    model = mla_model()
    model.set_attn_implementation("sdpa")
    ids, mask = padded_batch(left=True)
    static = StaticCache(config=model.config, max_cache_len=16)
    incremental, full, _ = decode_incrementally(model, ids, mask, cache=static)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], rtol=0, atol=1e-5)
    assert static.layers[0].keys.shape == (3, 1, 16, 12)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    plain, checkpointed = gradients_with_and_without_checkpointing(mla_model, lambda name: "layers.0.self_attn" in name)
    assert {name.rsplit(".", 2)[-2] for name in plain} >= {"q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(kv_lora_rank=None), "'mla' layers need `kv_lora_rank`, a positive integer"),
        (dict(kv_lora_rank=8, v_head_dim=0), "`v_head_dim` of 'mla' layers must be a positive integer or None"),
        (dict(kv_lora_rank=8, qk_norm=True), "set qk_norm=False"),
        (dict(kv_lora_rank=8, head_dim=5, hidden_size=20), "`head_dim` (5) channels"),
        (dict(kv_lora_rank=8, attention_sinks=True), "['mla'] layers compute their own scores in a kernel or combine"),
    ],
)
def test_config_refuses_what_mla_layers_cannot_do(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config("decoder", layer_types=["mla", "full"], **fields)


def test_flash_attention_and_serving_engines_are_refused_by_name():
    attention = coreformer_attention(None)
    attention.config._attn_implementation = "flash_attention_2"  # no flash here: only the refusal is exercised
    states = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="values of another width than their keys.*flash_attention_2"):
        attention(states, plan=LayerPlan(kernel=True))
    with pytest.raises(ValueError, match=r"'mla' \(layer 0\)"):
        check_served(["mla", "full"], "vLLM", "use generate().")


def test_a_config_without_mla_layers_keeps_no_kv_lora_rank_which_vllm_reads_as_an_mla_cache():
    """vLLM's Transformers backend sizes its cache as MLA's latent whenever `kv_lora_rank` is set; a setting of it
    beside layers that are not "mla" (a config shared between runs) must not make a full-attention model read as one."""
    fields = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=8)
    assert cf.CoreformerDecoderConfig(**fields).kv_lora_rank is None
    mixed = cf.CoreformerDecoderConfig(**fields, layer_types=["mla", "full"], position_embedding_type="rotary")
    assert mixed.kv_lora_rank == 8
    assert cf.CoreformerDecoderConfig.from_dict(mixed.to_dict()).kv_lora_rank == 8


def test_sdpa_gets_values_as_wide_as_the_keys_so_that_its_fused_kernels_run(monkeypatch):
    # Narrower values send torch's sdpa to its math kernel, which holds every score (benchmarks/results/
    # long_context_decoder_variants_inference.json); zero columns keep the output the same.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    widths = []

    def recording_sdpa(module, query, key, value, *args, **kwargs):
        widths.append((key.shape[-1], value.shape[-1]))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recording_sdpa)
    model = mla_model()  # keys of 8 + 8 channels (qk_nope_head_dim, head_dim), values of 6
    ids, mask = padded_batch(left=True)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        actual = model(ids, attention_mask=mask).logits
    assert widths == [(16, 16), (8, 8)]  # the mla layer's values padded to 16; then the full layer's heads
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], rtol=0, atol=1e-5)
