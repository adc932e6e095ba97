"""The attention core: backends agree, the family is chosen by is_causal / keys-values source, caches behave."""

import pytest
import torch
from conftest import VARIANTS
from tiny import FAMILY_CLASSES, FLEX_HEADS, FLEX_LENGTH, PAD, VOCAB, padded_batch, tiny_config, tiny_model
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

import coreformer as cf
from coreformer.attention import Attention, eager_attention_forward, repeat_kv


def _forward(model, ids, mask, family, decoder_length: int = 7):
    with torch.no_grad():
        if family == "seq2seq":
            decoder_ids, decoder_mask = padded_batch(ids.shape[0], decoder_length, seed=1)
            return model(
                ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask
            ).last_hidden_state, decoder_mask
        return model(ids, attention_mask=mask).last_hidden_state, mask


def _assert_backend_matches_eager(
    family: str, backend: str, variant: dict, length: int = 10, decoder_length: int = 7
) -> None:
    model = tiny_model(FAMILY_CLASSES[family][1], family, **variant)
    ids, mask = padded_batch(length=length, left=family == "decoder")
    model.set_attn_implementation("eager")
    reference, out_mask = _forward(model, ids, mask, family, decoder_length)
    model.set_attn_implementation(backend)
    output, _ = _forward(model, ids, mask, family, decoder_length)
    real = out_mask.bool()  # padded query positions are undefined: compare real tokens only
    torch.testing.assert_close(output[real], reference[real], atol=1e-5, rtol=0)


def test_sdpa_matches_eager_with_padding(family, variant):
    _assert_backend_matches_eager(family, "sdpa", variant)


@pytest.mark.slow
def test_seq2seq_self_and_cross_attention_under_flex_attention_match_eager_with_padding(flex_attention):
    # Encoder and decoder stacks under flex, every layer type, are test_outputs'; here the seq2seq model's own
    # attention calls, cross-attention among them, at the flex tests' shapes (their kernels serve it).
    variant = {**VARIANTS["rotary_rmsnorm_swiglu_gqa"], **FLEX_HEADS}
    _assert_backend_matches_eager("seq2seq", "flex_attention", variant, FLEX_LENGTH, FLEX_LENGTH)


def _outputs_before_and_after_changing_the_last_token(model_class, family: str, backend: str):
    model = tiny_model(model_class, family)
    model.set_attn_implementation(backend)
    ids = torch.randint(3, VOCAB, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1 - 3) % (VOCAB - 3) + 3
    with torch.no_grad():
        return model(ids).last_hidden_state, model(changed).last_hidden_state


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_encoder_is_bidirectional(backend):
    before, after = _outputs_before_and_after_changing_the_last_token(cf.CoreformerEncoderModel, "encoder", backend)
    assert (before[0, 0] - after[0, 0]).abs().max() > 1e-4, "a later token must change earlier encoder outputs"


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_decoder_is_causal(backend):
    before, after = _outputs_before_and_after_changing_the_last_token(cf.CoreformerDecoderModel, "decoder", backend)
    torch.testing.assert_close(before[0, :-1], after[0, :-1], atol=0, rtol=0)
    assert (before[0, -1] - after[0, -1]).abs().max() > 1e-4


def test_every_attention_module_declares_its_causality():
    seq2seq = tiny_model(cf.CoreformerSeq2SeqModel, "seq2seq")
    for block in seq2seq.encoder.layers:
        assert block.self_attn.is_causal is False
    for block in seq2seq.decoder.layers:
        assert block.self_attn.is_causal is True
        assert block.cross_attn.is_causal is False and block.cross_attn.is_cross_attention
    assert all(type(m) is Attention for m in seq2seq.modules() if isinstance(m, Attention))


def test_cross_attention_cannot_be_causal():
    with pytest.raises(ValueError, match="cannot be causal"):
        Attention(tiny_config("seq2seq"), 0, is_causal=True, is_cross_attention=True)


def test_grouped_query_attention_equals_repeated_heads():
    config = tiny_config("decoder", num_key_value_heads=2)
    attention = Attention(config, 0, is_causal=False).eval()
    query = torch.randn(2, 4, 5, 8)
    key, value = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    grouped, _ = eager_attention_forward(attention, query, key, value, None, scaling=8**-0.5)
    expected = torch.softmax(query @ repeat_kv(key, 2).transpose(2, 3) / 8**0.5, dim=-1) @ repeat_kv(value, 2)
    torch.testing.assert_close(grouped, expected.transpose(1, 2), atol=1e-6, rtol=0)


def test_eager_returns_probabilities_that_sum_to_one_and_ignore_padding():
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", attn_implementation="eager")
    ids, mask = padded_batch()
    with torch.no_grad():
        attentions = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(attentions) == 2 and attentions[0].shape == (3, 4, 10, 10)
    torch.testing.assert_close(attentions[0].sum(-1), torch.ones(3, 4, 10))
    padded_keys = (mask == 0)[:, None, None, :].expand_as(attentions[0])
    assert attentions[0][padded_keys].abs().max() == 0


def test_output_attentions_under_sdpa_are_eagers_probabilities_and_change_no_output():
    # Replaces the earlier test that asserted a ValueError here: the probabilities are recomputed beside sdpa.
    model = tiny_model(cf.CoreformerEncoderModel, "encoder")
    ids, mask = padded_batch()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(ids, attention_mask=mask, output_attentions=True).attentions
        model.set_attn_implementation("sdpa")
        plain = model(ids, attention_mask=mask).last_hidden_state
        output = model(ids, attention_mask=mask, output_attentions=True)
    assert torch.equal(output.last_hidden_state, plain)
    assert len(output.attentions) == 2
    for ours, eager in zip(output.attentions, reference):
        torch.testing.assert_close(ours, eager, atol=1e-6, rtol=0)


def test_cross_attention_keys_are_computed_once_per_generation():
    model = tiny_model(cf.CoreformerSeq2SeqModel, "seq2seq")
    ids, mask = padded_batch()
    calls = []
    model.decoder.layers[0].cross_attn.k_proj.register_forward_hook(lambda *args: calls.append(1))
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    decoder_ids = torch.full((3, 1), 2)
    with torch.no_grad():
        encoder_outputs = model.encoder(ids, attention_mask=mask)
        for _ in range(4):
            out = model(
                attention_mask=mask,
                encoder_outputs=encoder_outputs,
                decoder_input_ids=decoder_ids,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
    assert len(calls) == 1
    assert cache.cross_attention_cache.get_seq_length() == ids.shape[1]
    assert cache.self_attention_cache.get_seq_length() == 4


def test_padding_token_rows_do_not_leak_into_real_tokens():
    # A padded row must give the same real-token outputs as the same row alone without padding.
    model = tiny_model(cf.CoreformerEncoderModel, "encoder")
    ids, mask = padded_batch()
    length = int(mask[2].sum())
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).last_hidden_state[2, :length]
        alone = model(ids[2:, :length]).last_hidden_state[0]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    assert PAD not in ids[2, :length]


def _loss_and_gradients(model, ids, mask, family):
    inputs = dict(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    if family == "seq2seq":
        inputs.update(zip(("decoder_input_ids", "decoder_attention_mask"), padded_batch(ids.shape[0], 7, seed=1)))
    model.zero_grad()
    output = model(**inputs)
    real = (inputs.get("decoder_attention_mask", mask)).bool()
    states = output.last_hidden_state[real]
    states.square().sum().backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    hidden = [h[real] for h in (output.decoder_hidden_states if family == "seq2seq" else output.hidden_states)]
    return states.detach(), hidden, gradients


@pytest.mark.parametrize("left", [False, True], ids=["right_padding", "left_padding"])
def test_unpadded_stack_computes_what_the_padded_one_does(family, variant, left, monkeypatch):
    # The stack runs projections/MLPs on the real tokens only (Unpadding); against the padded computation the real
    # tokens' outputs, every layer's hidden states and the gradients must agree.
    # dropout is 0: training mode is deterministic
    model = tiny_model(FAMILY_CLASSES[family][1], family, **variant).train()
    ids, mask = padded_batch(left=left)
    calls = []
    original = cf.forward_plan.ForwardPlanner.unpadding
    monkeypatch.setattr(cf.forward_plan.ForwardPlanner, "unpadding", lambda *a: calls.append(original(*a)) or calls[-1])
    unpadded = _loss_and_gradients(model, ids, mask, family)
    assert any(call is not None for call in calls), "the padded batch did not take the unpadded path"
    monkeypatch.setattr(cf.forward_plan.ForwardPlanner, "unpadding", lambda *a: None)
    padded = _loss_and_gradients(model, ids, mask, family)
    torch.testing.assert_close(unpadded[0], padded[0], atol=1e-5, rtol=0)
    for ours, reference in zip(unpadded[1], padded[1], strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    assert unpadded[2].keys() == padded[2].keys()
    for name in padded[2]:
        torch.testing.assert_close(unpadded[2][name], padded[2][name], atol=1e-5, rtol=1e-4, msg=name)


def test_unpadded_stack_leaves_zeros_at_the_padding():
    model = tiny_model(cf.CoreformerEncoderModel, "encoder")
    ids, mask = padded_batch()
    with torch.no_grad():
        output = model(ids, attention_mask=mask).last_hidden_state
    assert torch.equal(output[~mask.bool()], torch.zeros_like(output[~mask.bool()]))
    assert output[mask.bool()].abs().sum() > 0
