"""coreformer.losses: the loss and gradient of transformers' up-casting loss, without fp32 (tokens, vocab) tensors."""

import os
from pathlib import Path

import pytest
import torch
from ranks import fork_python
from tiny import padded_batch, tiny_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

import coreformer as cf
from coreformer import losses
from coreformer.losses import causal_lm_loss, fused_causal_lm_loss, fused_token_loss, token_loss

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


# ---- the projection fused with the loss (skip_logits=True) ----

HIDDEN = 16


def projection_inputs(dtype: torch.dtype, *, bias: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 10, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) / 2).requires_grad_()
    bias_ = (torch.randn(VOCAB, generator=generator) / 2).requires_grad_() if bias else None
    labels = logits_and_labels(torch.float32, seed)[1]
    return hidden, weight, bias_, labels


def loss_and_grads(compute, hidden, weight, bias, labels, **kwargs) -> tuple[torch.Tensor, ...]:
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    loss = compute(hidden, weight, bias, labels, **kwargs)
    return (loss.detach(), *torch.autograd.grad(loss, leaves))


def through_logits(reference):
    """transformers' loss on the logits nn.Linear produces: what the fused loss must equal."""

    def compute(hidden, weight, bias, labels, **kwargs):
        return reference(nn.functional.linear(hidden, weight, bias), labels, vocab_size=VOCAB, **kwargs)

    return compute


def small_chunks(monkeypatch, rows: int = 7) -> None:
    """7 rows per chunk: 30 rows in 5 chunks, the last one partial."""
    monkeypatch.setitem(losses._CHUNK_BYTES, "cpu", rows * 4 * VOCAB)


@pytest.mark.parametrize(
    "fused, reference", [(fused_causal_lm_loss, ForCausalLMLoss), (fused_token_loss, ForMaskedLMLoss)]
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_items_in_batch", [None, torch.tensor(17)])
def test_fused_loss_and_gradients_equal_transformers_loss_on_the_logits_in_fp32(
    monkeypatch, fused, reference, bias, num_items_in_batch
):
    small_chunks(monkeypatch)
    inputs = projection_inputs(torch.float32, bias=bias)
    expected = loss_and_grads(through_logits(reference), *inputs, num_items_in_batch=num_items_in_batch)
    result = loss_and_grads(fused, *inputs, num_items_in_batch=num_items_in_batch)
    assert len(result) == len(expected) == (4 if bias else 3)  # loss, d hidden, d weight [, d bias]
    # The loss sums the labelled rows only, in another order than the reference's sum over all rows: a few ulp.
    torch.testing.assert_close(result[0], expected[0], rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(result[1:], expected[1:]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_fused_loss_chunking_does_not_change_the_result(monkeypatch):
    inputs = projection_inputs(torch.float32, bias=True)
    one_chunk = loss_and_grads(fused_causal_lm_loss, *inputs)
    small_chunks(monkeypatch, rows=4)
    for ours, whole in zip(loss_and_grads(fused_causal_lm_loss, *inputs), one_chunk):
        torch.testing.assert_close(ours, whole, rtol=0, atol=1e-6)


def test_fused_loss_under_bf16_autocast_matches_the_autocast_logits_loss(monkeypatch):
    # Both run the products in bf16 (autocast's dtype) and the log-sum-exp in fp32. The weight gradient differs by
    # bf16 rounding: ours sums the chunks' bf16 products in fp32, autocast's one bf16 product rounds the whole sum.
    small_chunks(monkeypatch)
    inputs = projection_inputs(torch.float32, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_and_grads(through_logits(ForCausalLMLoss), *inputs)
        result = loss_and_grads(fused_causal_lm_loss, *inputs)
    assert [t.dtype for t in result] == [torch.float32] * 4  # gradients in the leaves' dtype
    torch.testing.assert_close(result[0], expected[0], rtol=0, atol=1e-5)
    for ours, theirs in zip(result[1:], expected[1:]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-2 * theirs.abs().max().item())


class LargestTensor(TorchDispatchMode):
    """The most elements any op produced while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_fused_loss_never_forms_a_tensor_of_the_logits_size(monkeypatch):
    small_chunks(monkeypatch)
    hidden, weight, bias, labels = projection_inputs(torch.float32, bias=True)
    logits_size = labels.numel() * VOCAB
    # The check can fail: the loss on the logits forms (30, VOCAB) tensors forward and backward.
    with LargestTensor() as unfused:
        loss_and_grads(through_logits(ForCausalLMLoss), hidden, weight, bias, labels)
    assert unfused.largest >= logits_size
    with LargestTensor() as fused:
        loss_and_grads(fused_causal_lm_loss, hidden, weight, bias, labels)
    # The largest is the weight's gradient (VOCAB x 16) or one 7-row chunk of logits, both well under (30, VOCAB).
    assert fused.largest <= max(weight.numel(), 7 * VOCAB) < logits_size


def test_fused_loss_runs_the_products_of_the_unfused_loss_and_no_more():
    # Its gradients are formed in the forward pass: logits, d hidden, d weight, one product each, as the loss on the
    # logits runs them. The check can fail: a backward that recomputes each chunk's logits runs a fourth.
    from torch.utils.flop_counter import FlopCounterMode

    inputs = projection_inputs(torch.float32, bias=True)
    counts = []
    for compute in (through_logits(ForMaskedLMLoss), fused_token_loss):
        with FlopCounterMode(display=False) as counter:
            loss_and_grads(compute, *inputs)
        counts.append(counter.get_total_flops())
    labelled = int((inputs[3] != -100).sum())
    assert counts[1] == 3 * 2 * labelled * HIDDEN * VOCAB  # the labelled rows only (see labelled_rows)
    assert counts[1] < counts[0] == 3 * 2 * inputs[3].numel() * HIDDEN * VOCAB


def test_fused_loss_without_gradients_gives_the_same_loss():
    # Under no_grad (held-out evaluation) only the loss is computed; with gradients it is handed out once.
    inputs = projection_inputs(torch.float32, bias=True)
    expected = fused_causal_lm_loss(*inputs)
    with torch.no_grad():
        loss = fused_causal_lm_loss(*inputs)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0)
    expected.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second backward through it"):
        expected.backward()


LM_HEADS = {
    "decoder": cf.CoreformerDecoderForCausalLM,
    "encoder": cf.CoreformerEncoderForMaskedLM,
    "seq2seq": cf.CoreformerSeq2SeqForConditionalGeneration,
}


def lm_head_model(family: str) -> torch.nn.Module:
    # Every head piece the fused path must carry: BERT's transform and bias, BART's final_logits_bias.
    overrides = dict(lm_head_transform=True, lm_head_bias=True)
    if family == "seq2seq":
        overrides["final_logits_bias"] = True
    model = tiny_model(LM_HEADS[family], family, **overrides)
    with torch.no_grad():
        model.lm_head.bias.normal_()
        if family == "seq2seq":
            model.final_logits_bias.normal_()
    return model


def head_loss_and_grads(model, ids, labels, **kwargs) -> tuple[torch.Tensor | None, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    output = model(input_ids=ids, labels=labels, **kwargs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.logits, output.loss.detach(), grads


@pytest.mark.parametrize("family", list(LM_HEADS))
def test_heads_skip_logits_give_the_same_loss_and_gradients_without_logits(family, monkeypatch):
    small_chunks(monkeypatch, rows=5)
    model = lm_head_model(family)
    ids, _ = padded_batch()
    labels = ids.clone()
    labels[1, :3] = -100
    logits, expected_loss, expected_grads = head_loss_and_grads(model, ids, labels)
    assert logits is not None  # the default keeps transformers' contract
    no_logits, loss, grads = head_loss_and_grads(model, ids, labels, skip_logits=True)
    assert no_logits is None
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    assert grads.keys() == expected_grads.keys() and "lm_head.bias" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-6, msg=name)


class VocabularyProducts(TorchDispatchMode):
    """Rows of every matrix product whose output has `columns` columns (the vocabulary projection's)."""

    def __init__(self, columns: int):
        super().__init__()
        self.columns, self.rows = columns, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == self.columns:
            self.rows.append(out.shape[0])
        return out


@pytest.mark.parametrize("family", list(LM_HEADS))
def test_skip_logits_sends_only_the_labelled_rows_through_the_transform_and_the_projection(family):
    model = lm_head_model(family)
    ids, mask = padded_batch()
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 5], labels[2, 1] = 7, 8, 9  # three labelled rows of 30, as a masked-LM batch has
    labelled = 3  # (the decoder shifts them to positions 1, 4 and 0)
    transform_rows = []
    model.lm_head_transform.register_forward_hook(lambda _, inputs, __: transform_rows.append(inputs[0].shape[0]))
    # The check can fail: the default forward projects every one of the 30 rows.
    with VocabularyProducts(model.config.vocab_size) as full:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert full.rows and max(full.rows) == ids.numel()
    transform_rows.clear()
    with VocabularyProducts(model.config.vocab_size) as fused:
        model(input_ids=ids, attention_mask=mask, labels=labels, skip_logits=True).loss.backward()
    assert transform_rows == [labelled]
    assert fused.rows and all(rows == labelled for rows in fused.rows)


def test_skip_logits_without_labels_says_what_to_pass():
    model = lm_head_model("decoder")
    with pytest.raises(ValueError, match="skip_logits=True returns only the loss: pass labels"):
        model(input_ids=padded_batch()[0], skip_logits=True)


def test_skip_logits_with_a_lora_adapted_head_keeps_the_adapter_in_the_loss():
    # A LoRA head adds B·A·x to weight·x: the fused product of weight and bias alone would drop the adapter.
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        lm_head_model("decoder"), LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False)
    )
    ids, _ = padded_batch()
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss
        output = model(input_ids=ids, labels=ids, skip_logits=True)
        with model.disable_adapter():
            without_adapter = model(input_ids=ids, labels=ids, skip_logits=True).loss
    assert output.logits is None
    torch.testing.assert_close(output.loss, expected, rtol=0, atol=1e-6)
    assert (without_adapter - expected).abs() > 1e-3  # the adapter changes the loss, so the check above can fail


# In a process of its own (forked from ranks.py's server, which never compiled anything): Dynamo's state is per
# process, and earlier tests' compiled entries share these frames (a frame that once hit the recompile limit is never
# compiled again), so the count would depend on the tests before it; the fork starts clean and leaves the worker's
# state as it is.
COMPILED_HEAD_CHILD = """
import sys
import torch
from torch._dynamo.testing import CompileCounterWithBackend
sys.path[:0] = [sys.argv[1], sys.argv[2]]  # tests/modeling (this file) and tests/ (tiny.py)
from test_losses import head_loss_and_grads, lm_head_model
from tiny import padded_batch

model = lm_head_model("decoder").train()
ids, _ = padded_batch()
_, expected_loss, expected_grads = head_loss_and_grads(model, ids, ids, skip_logits=True)
counter = CompileCounterWithBackend("aot_eager")  # graph capture is what is counted; no C++ build
_, loss, grads = head_loss_and_grads(torch.compile(model, backend=counter), ids, ids, skip_logits=True)
difference = max([(loss - expected_loss).abs().item()] + [
    (grad - expected_grads[name.removeprefix("_orig_mod.")]).abs().max().item() for name, grad in grads.items()
])
print("result:", counter.frame_count, len(grads) == len(expected_grads), difference)
"""


@pytest.mark.slow
def test_compiled_model_runs_the_fused_loss_eagerly_after_one_graph_and_gives_its_loss_and_gradients(tmp_path):
    tests, log = Path(__file__).resolve().parent, tmp_path / "child.log"
    child = fork_python(["-c", COMPILED_HEAD_CHILD, str(tests), str(tests.parent)], dict(os.environ), tmp_path, log)
    assert child.wait(timeout=600) == 0, log.read_text()[-3000:]
    result = next(line for line in log.read_text().splitlines() if line.startswith("result: "))
    frames, same_parameters, difference = result.split()[1:]
    # the stack to the final hidden states is one graph; the head's row selection (a data-dependent shape) and the
    # chunked loss run eagerly after it, instead of breaking the graph three times
    assert int(frames) == 1
    assert same_parameters == "True" and float(difference) <= 1e-5


@pytest.mark.parametrize(
    "objective, family", [("causal-lm", "decoder"), ("masked-lm", "encoder"), ("denoising", "seq2seq")]
)
def test_pretraining_objectives_take_the_fused_loss_without_calling_the_projection(objective, family):
    from coreformer.training.objectives import OBJECTIVES

    model = lm_head_model(family)
    ids, mask = padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    expected = model(**batch, num_items_in_batch=17).loss
    projections = []
    model.lm_head.register_forward_hook(lambda *_: projections.append(1))
    loss = OBJECTIVES[objective].loss(model, batch, 17, int(mask.sum()))
    assert projections == []  # the logits were never formed: the loss came from the fused path
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
