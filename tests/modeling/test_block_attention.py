"""Block-local attention (`block_attention.py`, the "block" layer type): the kernel and whole models against dense
attention under the explicit block mask, cached decoding."""

import pytest
import torch
from tiny import decode_incrementally, padded_batch, tiny_config, tiny_model

import coreformer as cf
from coreformer.block_attention import block_attention


def _dense_block_attention(query, key, value, block_size, causal, padding_mask):
    """Dense softmax under the block mask written out: q sees k iff q // b == k // b (and k <= q when causal)."""
    length = query.shape[2]
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = (q // block_size == k // block_size) & (k <= q if causal else True)
    allowed = allowed[None, None] & padding_mask[:, None, None, :]
    allowed = allowed | (torch.eye(length, dtype=torch.bool) & ~allowed.any(-1, keepdim=True))  # padding: itself
    scores = (query @ key.transpose(-1, -2)) * query.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ value).transpose(1, 2)  # (B, L, H, D)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_block_kernel_equals_the_dense_block_mask(causal):
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 3, 11, 8, generator=generator, requires_grad=True) for _ in range(3))
    padding_mask = torch.ones(2, 11, dtype=torch.bool)
    padding_mask[1, 8:] = False  # right padding, part of a block
    output = block_attention(query, key, value, block_size=4, causal=causal, padding_mask=padding_mask, scaling=8**-0.5)
    expected = _dense_block_attention(query, key, value, 4, causal, padding_mask)
    real = padding_mask
    torch.testing.assert_close(output[real], expected[real], atol=1e-5, rtol=0)
    weights = torch.randn_like(output) * real[..., None, None]  # the loss reads real tokens only
    grads = torch.autograd.grad((output * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=0)


def test_block_is_not_a_band():
    """Token 3 sees 0..3 and token 4 only itself: no band |q - k| <= w gives both."""
    query, key, value = (torch.randn(1, 1, 8, 4) for _ in range(3))
    output = block_attention(query, key, value, block_size=4, causal=True, padding_mask=None, scaling=0.5)
    torch.testing.assert_close(output[0, 4, 0], value[0, 0, 4])
    assert not torch.allclose(output[0, 3, 0], value[0, 0, 3])


def _explicit_block_mask(mask: torch.Tensor, block_size: int, causal: bool) -> torch.Tensor:
    """The (B, 1, T, T) additive mask of the block type, position by position."""
    length = mask.shape[1]
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = (q // block_size == k // block_size) & ((k <= q) if causal else True)
    allowed = allowed[None, None] & mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("family", ["encoder", "decoder"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_block_layers_equal_an_explicit_dense_mask(family, backend):
    model_class = cf.CoreformerEncoderModel if family == "encoder" else cf.CoreformerDecoderModel
    model = tiny_model(model_class, family, layer_types=["block", "block"], block_size=4)
    reference = tiny_model(model_class, family)  # all "full": the explicit mask does the work
    reference.load_state_dict(model.state_dict())
    model.set_attn_implementation(backend)  # sdpa: the block kernel; eager: the overlay mask
    reference.set_attn_implementation("eager")
    ids, mask = padded_batch(length=13)
    with torch.no_grad():
        output = model(ids, attention_mask=mask).last_hidden_state
        explicit = _explicit_block_mask(mask, 4, family == "decoder")
        expected = reference(ids, attention_mask=explicit).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(output[real], expected[real], atol=1e-5, rtol=0)


def test_block_decoding_through_the_cache_equals_the_full_forward():
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", layer_types=["block", "full"], block_size=3)
    ids, mask = padded_batch(length=12)
    incremental, full, _ = decode_incrementally(model, ids, mask, prefix=4)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], atol=1e-5, rtol=0)


def test_block_layers_need_a_block_size():
    with pytest.raises(ValueError, match="need `block_size`, a positive integer"):
        tiny_config("decoder", layer_types=["block", "full"])
