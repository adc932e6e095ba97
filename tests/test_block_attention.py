"""Block-local attention (`block_attention.py`): the kernel against dense attention under the explicit block mask."""

import pytest
import torch

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
