"""The forward plan (`forward_plan.py`): what a stack decides once per forward, read back from the plan itself."""

import pytest
import torch
from tiny import padded_batch, tiny_model
from transformers.cache_utils import DynamicCache

import coreformer as cf

PARAMETERS = dict(sliding_window=2, stride=3)


def _plan(stack, ids, mask, *, cache=None, output_attentions=False, documents=None):
    hidden = torch.zeros(*ids.shape, stack.config.hidden_size)
    positions = torch.arange(ids.shape[1])[None]
    return stack.planner.plan(
        hidden,
        mask,
        cache,
        positions,
        None,
        None,
        documents=documents,
        output_attentions=output_attentions,
        padded_states=False,
    )


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_sparse_kernels_run_under_sdpa_and_the_linear_form_always(backend):
    types = ["sliding", "linear", "full"]
    model = tiny_model(cf.CoreformerDecoderModel, "decoder", layer_types=types, num_hidden_layers=3, **PARAMETERS)
    model.set_attn_implementation(backend)
    ids, mask = padded_batch(length=8, left=True)
    plan = _plan(model.decoder, ids, mask)
    assert plan.layers["sliding"].kernel is (backend == "sdpa")
    assert plan.layers["linear"].kernel and not plan.layers["full"].kernel
    # a layer whose kernel runs, or that takes the padding mask itself, gets the (B, S) boolean padding mask
    assert torch.equal(plan.layers["linear"].mask, mask.bool())
    if backend == "sdpa":
        assert torch.equal(plan.layers["sliding"].mask, mask.bool())
    else:
        assert plan.layers["sliding"].mask.shape == (ids.shape[0], 1, 8, 8)


def test_cached_keys_turn_the_sparse_kernels_off_and_packed_rows_keep_them():
    model = tiny_model(cf.CoreformerDecoderModel, "decoder", layer_types=["sliding", "strided"], **PARAMETERS)
    ids, mask = padded_batch(length=8)
    assert _plan(model.decoder, ids, mask).layers["strided"].kernel  # an empty cache or none: the kernels apply
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    extended = torch.cat([mask, torch.ones(ids.shape[0], 1, dtype=mask.dtype)], dim=1)
    cached = _plan(model.decoder, ids[:, :1], extended, cache=cache)
    assert not any(layer.kernel for layer in cached.layers.values())
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]]).expand(ids.shape[0], -1)
    packed = _plan(model.decoder, ids, None, documents=documents)  # packed rows: document ids beside row ids
    assert all(layer.kernel and torch.equal(layer.documents, documents) for layer in packed.layers.values())


def test_probability_masks_are_built_only_when_attentions_are_asked_for():
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", layer_types=["sliding", "linear"], **PARAMETERS)
    ids, mask = padded_batch(length=8)
    assert all(layer.probability_mask is None for layer in _plan(model.encoder, ids, mask).layers.values())
    plan = _plan(model.encoder, ids, mask, output_attentions=True)
    assert all(layer.output_attentions for layer in plan.layers.values())
    # eager's additive (B, 1, T, S) form beside the sparse kernel; the linear kernel writes its own
    assert plan.layers["sliding"].probability_mask.shape == (ids.shape[0], 1, 8, 8)
    assert plan.layers["linear"].probability_mask is None


def test_one_plan_serves_every_layer_of_a_type_and_unpads_once():
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", layer_types=["full", "full"])
    ids, mask = padded_batch(length=8)
    plan = _plan(model.encoder, ids, mask)
    assert list(plan.layers) == ["full"] and plan.cross is None
    assert plan.unpadding is not None and plan.unpadding.indices.numel() == int(mask.sum())
    assert _plan(model.encoder, ids, torch.ones_like(mask)).unpadding is None  # nothing to take out
