"""coreformer.losses: the loss and gradient of transformers' up-casting loss, without fp32 (tokens, vocab) tensors."""

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

import coreformer as cf
from coreformer import losses
from coreformer.losses import causal_lm_loss, token_loss

VOCAB = 96


def logits_and_labels(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 10, VOCAB, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (3, 10), generator=generator)
    labels[0, :4] = -100  # padding / prompt positions take no loss
    labels[2, 7] = -100
    return logits, labels


def loss_and_grad(loss_fn, logits, labels, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    logits.grad = None
    loss = loss_fn(logits, labels, vocab_size=VOCAB, **kwargs)
    loss.backward()
    return loss.detach(), logits.grad.clone()


@pytest.mark.parametrize("ours, reference", [(causal_lm_loss, ForCausalLMLoss), (token_loss, ForMaskedLMLoss)])
@pytest.mark.parametrize("num_items_in_batch", [None, torch.tensor(17)])
def test_loss_and_gradient_equal_transformers_in_fp32(ours, reference, num_items_in_batch):
    logits, labels = logits_and_labels(torch.float32)
    expected_loss, expected_grad = loss_and_grad(reference, logits, labels, num_items_in_batch=num_items_in_batch)
    loss, grad = loss_and_grad(ours, logits, labels, num_items_in_batch=num_items_in_batch)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-7)


def test_shift_labels_are_used_as_given():
    logits, labels = logits_and_labels(torch.float32)
    shift_labels = torch.roll(labels, 3, dims=1)
    expected, _ = loss_and_grad(ForCausalLMLoss, logits, labels, shift_labels=shift_labels)
    loss, _ = loss_and_grad(causal_lm_loss, logits, labels, shift_labels=shift_labels)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)


def test_bf16_logits_give_the_fp32_loss_and_the_same_bf16_gradient():
    # transformers up-casts the bf16 logits; our loss computes the same fp32 log-sum-exp block by block.
    logits, labels = logits_and_labels(torch.bfloat16)
    expected_loss, expected_grad = loss_and_grad(ForCausalLMLoss, logits, labels)
    loss, grad = loss_and_grad(causal_lm_loss, logits, labels)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad.float(), expected_grad.float(), rtol=1e-2, atol=1e-6)


def test_blocks_of_rows_give_the_same_result_as_one_block(monkeypatch):
    logits, labels = logits_and_labels(torch.float32)
    whole_loss, whole_grad = loss_and_grad(causal_lm_loss, logits, labels)
    # 7 rows per block: 30 rows in 5 blocks, the last one partial.
    monkeypatch.setitem(losses._BLOCK_BYTES, "cpu", 7 * 4 * VOCAB)
    loss, grad = loss_and_grad(causal_lm_loss, logits, labels)
    torch.testing.assert_close(loss, whole_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, whole_grad, rtol=0, atol=1e-7)


def saved_float32_tensors(loss_fn, logits, labels) -> list[tuple[int, ...]]:
    """Shapes of the fp32 tensors autograd keeps for backward while computing the loss."""
    shapes = []

    def keep(tensor):
        if tensor.dtype == torch.float32:
            shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss_fn(logits, labels, vocab_size=VOCAB)
    return shapes


def test_bf16_loss_keeps_no_fp32_copy_of_the_logits():
    logits, labels = logits_and_labels(torch.bfloat16)
    full_size = logits.numel()
    # The check can fail: transformers' loss keeps fp32 log-probabilities of every token.
    reference_saved = saved_float32_tensors(ForCausalLMLoss, logits, labels)
    assert any(torch.Size(shape).numel() == full_size for shape in reference_saved)
    assert all(torch.Size(shape).numel() < full_size for shape in saved_float32_tensors(causal_lm_loss, logits, labels))


@pytest.mark.parametrize(
    "family, head, reference_loss",
    [
        ("decoder", cf.CoreformerDecoderForCausalLM, ForCausalLMLoss),
        ("encoder", cf.CoreformerEncoderForMaskedLM, ForMaskedLMLoss),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, ForMaskedLMLoss),
    ],
)
def test_language_model_heads_report_transformers_loss(family, head, reference_loss):
    config_class = {
        "decoder": cf.CoreformerDecoderConfig,
        "encoder": cf.CoreformerEncoderConfig,
        "seq2seq": cf.CoreformerSeq2SeqConfig,
    }[family]
    torch.manual_seed(0)
    config = config_class(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    model = head(config).eval()
    ids = torch.randint(3, VOCAB, (2, 9))
    labels = ids.clone()
    labels[1, :3] = -100
    output = model(input_ids=ids, labels=labels)
    expected = reference_loss(output.logits, labels, vocab_size=VOCAB)
    torch.testing.assert_close(output.loss, expected, rtol=0, atol=1e-5)
