"""The stack's output contracts, as transformers' own models keep them: attentions under every backend and layer
type, hidden states recorded by `capture_outputs` (selectable by index) and in the autograd graph under unpadding."""

import pytest
import torch
from tiny import FLEX_HEADS, FLEX_LENGTH, PAD, padded_batch, tiny_config, tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import coreformer as cf
from coreformer.attention import Attention
from coreformer.compat import SELECTS_HIDDEN_STATES

# Every layer type each family can hold (Linformer is bidirectional only).
MIXED_LAYER_TYPES = {
    "encoder": ["full", "sliding", "strided", "lowrank", "linear", "differential", "sigmoid", "mla"],
    "decoder": ["full", "sliding", "strided", "linear", "differential", "sigmoid", "mla"],
}
PARAMETERS = dict(sliding_window=2, stride=3, lowrank_k=6, kv_lora_rank=6)


@pytest.fixture
def custom_sdpa():
    """A registered attention function that, like a hub kernel, returns no probabilities, under the name
    "custom_sdpa"."""
    AttentionInterface.register("custom_sdpa", _custom_sdpa)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register("custom_sdpa", sdpa_mask)
    yield
    AttentionInterface._global_mapping.pop("custom_sdpa", None)
    AttentionMaskInterface._global_mapping.pop("custom_sdpa", None)


def _custom_sdpa(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _model(family: str, types: list[str] | None = None, **overrides):
    model_class = {"encoder": cf.CoreformerEncoderModel, "decoder": cf.CoreformerDecoderModel}[family]
    types = types or MIXED_LAYER_TYPES[family]
    return tiny_model(model_class, family, num_hidden_layers=len(types), layer_types=types, **PARAMETERS, **overrides)


def _assert_outputs_and_attentions_match_eager(family: str, backend: str, types: list[str], **overrides) -> None:
    """The backend's output is eager's on real tokens, asking for attentions changes it in no bit, and the
    attentions it returns are eager's for every layer type."""
    ids, mask = padded_batch(length=FLEX_LENGTH, left=family == "decoder")  # under flex, the other flex tests' kernels
    model = _model(family, types, **overrides)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(ids, attention_mask=mask, output_attentions=True)
        model.set_attn_implementation(backend)
        plain = model(ids, attention_mask=mask)
        output = model(ids, attention_mask=mask, output_attentions=True)
    real = mask.bool()
    torch.testing.assert_close(plain.last_hidden_state[real], reference.last_hidden_state[real], atol=1e-5, rtol=0)
    assert torch.equal(output.last_hidden_state, plain.last_hidden_state)
    assert len(output.attentions) == len(types)
    real_queries = real[:, None, :, None]
    for layer_type, ours, eager in zip(types, output.attentions, reference.attentions):
        assert ours.shape == eager.shape, layer_type
        # Padded query rows are undefined (their outputs are discarded); real rows must be eager's.
        torch.testing.assert_close(ours * real_queries, eager * real_queries, atol=1e-5, rtol=0, msg=layer_type)


@pytest.mark.parametrize("backend", ["sdpa", "custom_sdpa"])
@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_outputs_and_attentions_under_every_backend_and_layer_type_match_eager(family, backend, custom_sdpa):
    _assert_outputs_and_attentions_match_eager(family, backend, MIXED_LAYER_TYPES[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_outputs_and_attentions_under_flex_attention_match_eager_for_every_layer_type(family, flex_attention):
    # flex turns each layer type's mask function into a block-sparse BlockMask: one model holds every type.
    _assert_outputs_and_attentions_match_eager(family, "flex_attention", MIXED_LAYER_TYPES[family], **FLEX_HEADS)


@pytest.mark.parametrize("layer_type", ["sliding", "strided", "linear"])
def test_recomputed_probabilities_reproduce_the_layer_output(layer_type):
    # Probabilities times values must give back what the sparse kernel / linear form computed.
    config = tiny_config("decoder", **PARAMETERS)
    config._attn_implementation = "sdpa"
    attention = Attention(config, 0, is_causal=True, layer_type=layer_type).eval()
    hidden = torch.randn(2, 12, config.hidden_size)
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :3] = False  # left padding
    stack = tiny_model(cf.CoreformerDecoderModel, "decoder", layer_types=[layer_type, "full"], **PARAMETERS).decoder
    plan = stack.planner.plan(
        hidden,
        padding.long(),
        None,
        torch.arange(12)[None],
        None,
        None,
        output_attentions=True,
        padded_states=False,
    )
    layer = plan.layers[layer_type]._replace(unpadding=None)  # padded hidden states in, as the stack records them
    assert layer.kernel  # the sparse kernel under sdpa, the linear form always
    with torch.no_grad():
        output, probabilities = attention(hidden, layer)
        value = attention.v_proj(hidden).view(2, 12, -1, config.head_dim).transpose(1, 2)  # (B, H, T, D)
        expected = attention.o_proj((probabilities @ value).transpose(1, 2).flatten(-2))
    real = padding
    torch.testing.assert_close(output[real], expected[real], atol=1e-5, rtol=0)


def test_seq2seq_returns_encoder_decoder_and_cross_attentions_under_sdpa_as_bart_does():
    model = tiny_model(cf.CoreformerSeq2SeqModel, "seq2seq")
    ids, mask = padded_batch(length=10)
    decoder_ids = ids[:, :6]
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(ids, attention_mask=mask, decoder_input_ids=decoder_ids, output_attentions=True)
        model.set_attn_implementation("sdpa")
        output = model(
            ids, attention_mask=mask, decoder_input_ids=decoder_ids, output_attentions=True, output_hidden_states=True
        )
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        ours, eager = getattr(output, name), getattr(reference, name)
        assert len(ours) == 2, name
        for layer, expected in zip(ours, eager):
            torch.testing.assert_close(layer, expected, atol=1e-5, rtol=0)
    assert output.cross_attentions[0].shape == (3, 4, 6, 10)
    assert len(output.encoder_hidden_states) == len(output.decoder_hidden_states) == 3


def test_a_cached_linear_layer_refuses_attentions_naming_why():
    model = tiny_model(cf.CoreformerDecoderModel, "decoder", layer_types=["linear", "full"])
    ids = torch.randint(3, 50, (1, 6))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="running state, not the past keys"):
            model(ids[:, :1], past_key_values=cache, output_attentions=True)


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_hidden_states_are_recorded_from_the_blocks_and_selectable_by_index(family):
    model = _model(family)
    ids, mask = padded_batch(length=12, left=family == "decoder")
    with torch.no_grad():
        every = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        if SELECTS_HIDDEN_STATES:
            selected = model(ids, attention_mask=mask, output_hidden_states=[0, -1]).hidden_states
        else:  # a release whose recorder would return every state: refused by name, never answered wrongly
            with pytest.raises(ValueError, match=r"needs transformers>=5\.23"):
                model(ids, attention_mask=mask, output_hidden_states=[0, -1])
    assert len(every) == len(MIXED_LAYER_TYPES[family]) + 1
    if SELECTS_HIDDEN_STATES:
        # As transformers records a selection: one entry per state, None where not selected.
        assert len(selected) == len(every) and all(state is None for state in selected[1:-1])
        assert torch.equal(selected[0], every[0]) and torch.equal(selected[-1], every[-1])
    # recorded from the blocks: the states in between are exactly what the blocks returned
    blocks = _block_outputs(model, ids, dict(attention_mask=mask))
    assert all(torch.equal(state, block) for state, block in zip(every[1:-1], blocks[:-1], strict=True))


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_hidden_states_under_unpadding_are_in_the_graph_with_the_padded_computations_gradients(family, monkeypatch):
    model_class = {"encoder": cf.CoreformerEncoderForMaskedLM, "decoder": cf.CoreformerDecoderForCausalLM}[family]
    model = tiny_model(model_class, family).train()
    ids, mask = padded_batch(length=10, left=family == "decoder")
    labels = ids.masked_fill(mask == 0, -100)
    if family == "decoder":  # the loss shifts: a padding position's logits would predict the first real token
        labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)

    def gradients():
        output = model(ids, attention_mask=mask, labels=labels, output_hidden_states=True)
        for state in output.hidden_states:
            state.retain_grad()
        output.loss.backward()
        model.zero_grad()
        return output.loss.detach(), [state.grad for state in output.hidden_states]

    loss, grads = gradients()
    assert all(grad is not None for grad in grads)
    assert grads[0].shape == (*ids.shape, model.config.hidden_size)
    monkeypatch.setattr(cf.forward_plan.ForwardPlanner, "unpadding", lambda *a: None)
    padded_loss, padded_grads = gradients()
    torch.testing.assert_close(loss, padded_loss, atol=1e-6, rtol=0)
    real = mask.bool()
    for ours, reference in zip(grads, padded_grads):
        torch.testing.assert_close(ours[real], reference[real], atol=1e-6, rtol=0)


def test_unpadding_outputs_are_identical_with_and_without_hidden_states():
    model = tiny_model(cf.CoreformerEncoderModel, "encoder")
    ids, mask = padded_batch(length=10)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).last_hidden_state
        recorded = model(ids, attention_mask=mask, output_hidden_states=True).last_hidden_state
    assert torch.equal(plain, recorded)
    assert PAD in ids


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_generate_returns_attentions_under_sdpa_equal_to_eagers(cache_implementation):
    # Every decode step's attentions, with a dynamic cache (masks built per step) and a static one (the masks
    # generate() prepared, read as they are).
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", layer_types=["sliding", "full"], sliding_window=3)
    ids, mask = padded_batch(length=8, left=True)
    generate = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    outputs = {}
    for backend in ("eager", "sdpa"):
        model.set_attn_implementation(backend)
        outputs[backend] = model.generate(
            ids, attention_mask=mask, output_attentions=True, cache_implementation=cache_implementation, **generate
        )
    assert torch.equal(outputs["sdpa"].sequences, outputs["eager"].sequences)
    assert len(outputs["sdpa"].attentions) == 4
    for step, expected in zip(outputs["sdpa"].attentions, outputs["eager"].attentions):
        assert len(step) == 2
        for ours, eager in zip(step, expected):
            torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)


FAMILY_CLASSES = {
    "encoder": [cf.CoreformerEncoderModel, cf.CoreformerEncoderForMaskedLM],
    "decoder": [cf.CoreformerDecoderModel, cf.CoreformerDecoderForCausalLM],
    "seq2seq": [cf.CoreformerSeq2SeqModel, cf.CoreformerSeq2SeqForConditionalGeneration],
}


def _block_outputs(model, ids: torch.Tensor, inputs: dict) -> list[torch.Tensor]:
    """What each block returned in one forward (with hidden states recorded), caught by our own forward hooks."""
    caught = []
    blocks = [module for module in model.modules() if isinstance(module, cf.layers.Block)]
    handles = [block.register_forward_hook(lambda m, a, out: caught.append(out[0])) for block in blocks]
    try:
        with torch.no_grad():
            model(ids, **inputs, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    return caught


@pytest.mark.parametrize("family", sorted(FAMILY_CLASSES))
def test_every_layers_outputs_are_recorded_once_by_the_base_model_and_by_the_head(family):
    # transformers' contract (test_capture_outputs_decorator): each stack records its own blocks' outputs, once; a
    # capture nested in another would hand each caller part of the outputs. So: one entry per layer and stack, the
    # states in between exactly what the blocks returned, and a head returns what its own base model returns.
    ids, mask = padded_batch(length=8, left=family == "decoder")
    inputs = dict(attention_mask=mask)
    if family == "seq2seq":
        inputs["decoder_input_ids"] = ids[:, :5]
    layers = tiny_config(family).num_hidden_layers
    head = tiny_model(FAMILY_CLASSES[family][1], family)
    with torch.no_grad():
        outputs = [
            model(ids, **inputs, output_attentions=True, output_hidden_states=True) for model in (head, head.base_model)
        ]
    blocks = _block_outputs(head, ids, inputs)
    for output in outputs:
        if family == "seq2seq":
            stacks = [output.encoder_hidden_states, output.decoder_hidden_states]
            attentions = [output.encoder_attentions, output.decoder_attentions, output.cross_attentions]
        else:
            stacks, attentions = [output.hidden_states], [output.attentions]
        assert all(len(states) == layers + 1 for states in stacks)
        assert all(len(weights) == layers for weights in attentions)
        # the last state comes after the final norm; those in between are the blocks' outputs
        between = [state for states in stacks for state in states[1:-1]]
        from_blocks = [state for index, state in enumerate(blocks) if (index + 1) % layers]
        assert all(torch.equal(a, b) for a, b in zip(between, from_blocks, strict=True))
    for name in outputs[1].keys():
        if name.endswith(("hidden_states", "attentions")):
            for a, b in zip(outputs[0][name], outputs[1][name], strict=True):
                assert torch.equal(a, b), name


@pytest.mark.skipif(not SELECTS_HIDDEN_STATES, reason="hidden states are selected by index from transformers 5.23")
def test_seq2seq_selects_hidden_states_by_index_in_each_stack_by_its_own_depth():
    # A decoder deeper than the encoder: a negative index counts from the end of each stack's own states.
    model = tiny_model(cf.CoreformerSeq2SeqModel, "seq2seq", encoder_layers=2, decoder_layers=3)
    ids, mask = padded_batch(length=8)
    # (no cache: the cache built for this seq2seq config is sized from the encoder depth, a separate defect)
    inputs = dict(attention_mask=mask, decoder_input_ids=ids[:, :5], use_cache=False)
    with torch.no_grad():
        every = model(ids, **inputs, output_hidden_states=True)
        selected = model(ids, **inputs, output_hidden_states=[0, -1])
    for name, depth in (("encoder_hidden_states", 2), ("decoder_hidden_states", 3)):
        states, reference = getattr(selected, name), getattr(every, name)
        assert len(states) == len(reference) == depth + 1, name
        assert torch.equal(states[0], reference[0]) and torch.equal(states[-1], reference[-1]), name
        assert all(state is None for state in states[1:-1]), name
