"""Gated DeltaNet's math (`gated_deltanet.py`): the chunked rule against transformers' Qwen3-Next references and the
recurrence written out token by token; Qwen3-Next's whole `Qwen3NextGatedDeltaNet` rebuilt from the pieces on its own
weights; prefill then decoding through transformers' "linear_attention" cache layer == one pass, with a state that
does not grow; packed rows give each document exactly what it gets alone, in the rule and in the convolution.

The "gated_deltanet" layer type built on it: the layer against Qwen3-Next's module on copied weights; in a decoder
beside a full layer, padding, cached and static-cache decoding (the state does not grow), generate(), gradient
checkpointing, attentions; refused by name where it cannot run."""

import re

import pytest
import torch
from tiny import (
    FLEX_HEADS,
    FLEX_LENGTH,
    PAD,
    VOCAB,
    decode_incrementally,
    gradients_with_and_without_checkpointing,
    padded_batch,
    tiny_config,
    tiny_model,
)
from torch import nn
from transformers import DynamicCache, PretrainedConfig, Qwen3NextConfig, StaticCache
from transformers.cache_utils import LinearAttentionLayer
from transformers.models.qwen3_next import modeling_qwen3_next as qwen

import coreformer as cf
from coreformer.attention import Attention
from coreformer.export.onnx import refuse_unexportable
from coreformer.forward_plan import LayerPlan
from coreformer.gated_deltanet import (
    cached_states,
    decay_and_beta,
    gated_delta_rule,
    gated_delta_step,
    gated_rms_norm,
    l2_normalize,
    short_convolution,
    store_states,
)
from coreformer.layer_types import check_served

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 8, 6  # grouped: each key head serves two value heads
LENGTH = 37  # a prime: no chunk size below divides it
KERNEL = 4
DOCUMENT_LENGTHS = (5, 11, 2, 19)  # one shorter than the kernel's reach, one over several chunks of 4 and 8
TOL = dict(atol=1e-5, rtol=0)


def rule_inputs(batch: int = 2, length: int = LENGTH, seed: int = 0) -> dict[str, torch.Tensor]:
    """Normalised (B, H_k, T, D_k) queries/keys, (B, H_v, T, D_v) values, (B, H_v, T) log decays and betas."""
    generator = torch.Generator().manual_seed(seed)
    query, key = (torch.randn(batch, KEY_HEADS, length, KEY_DIM, generator=generator) for _ in range(2))
    return dict(
        query=l2_normalize(query),
        key=l2_normalize(key),
        value=torch.randn(batch, VALUE_HEADS, length, VALUE_DIM, generator=generator),
        decay=-2 * torch.rand(batch, VALUE_HEADS, length, generator=generator),
        beta=torch.rand(batch, VALUE_HEADS, length, generator=generator),
    )


def initial_state(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(seed))


def time_major(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our heads-first tensors in transformers' (B, T, H, ...) layout, under its argument names. Query/key heads are
    repeated to the value heads here, as `Qwen3NextGatedDeltaNet` does before calling the rules: 5.16.1's rules take
    equal head counts (grouping moved into them later), and our grouping is checked against the definition below."""
    group = VALUE_HEADS // KEY_HEADS
    query, key = (inputs[name].repeat_interleave(group, dim=1).transpose(1, 2) for name in ("query", "key"))
    value, decay, beta = (inputs[name].transpose(1, 2) for name in ("value", "decay", "beta"))
    return dict(query=query, key=key, value=value, g=decay, beta=beta)


def per_token_definition(query, key, value, decay, beta, state=None):
    """The gated delta rule as defined, one batch row, value head and token at a time, a (D_k, D_v) matrix S:
    S ← exp(g_t) S;  S ← S + β_t k_t (v_t - Sᵀ k_t)ᵀ;  o_t = Sᵀ q_t / √D_k. Key head h // (H_v / H_k) serves head h."""
    batch, _, length, _ = value.shape
    group = VALUE_HEADS // KEY_HEADS
    output = torch.zeros(batch, length, VALUE_HEADS, VALUE_DIM)
    final = torch.zeros(batch, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    for b in range(batch):
        for h in range(VALUE_HEADS):
            memory = torch.zeros(KEY_DIM, VALUE_DIM) if state is None else state[b, h].clone()
            for t in range(length):
                q, k, v = query[b, h // group, t], key[b, h // group, t], value[b, h, t]
                memory = decay[b, h, t].exp() * memory
                memory = memory + beta[b, h, t] * torch.outer(k, v - memory.T @ k)
                output[b, t, h] = memory.T @ q / KEY_DIM**0.5
            final[b, h] = memory
    return output, final


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("with_state", [False, True], ids=["from_zero", "from_state"])
def test_chunked_rule_matches_transformers_chunked_and_recurrent_rules(chunk_size, with_state):
    inputs, state = rule_inputs(), initial_state() if with_state else None
    output, final = gated_delta_rule(**inputs, state=state, chunk_size=chunk_size)
    chunked = qwen.torch_chunk_gated_delta_rule(
        **time_major(inputs), chunk_size=chunk_size, initial_state=state, output_final_state=True
    )
    recurrent = qwen.torch_recurrent_gated_delta_rule(
        **time_major(inputs), initial_state=state, output_final_state=True
    )
    for reference_output, reference_final in (chunked, recurrent):
        torch.testing.assert_close(output, reference_output, **TOL)
        torch.testing.assert_close(final, reference_final, **TOL)


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_chunked_rule_and_step_match_the_per_token_definition(chunk_size):
    inputs, state = rule_inputs(), initial_state()
    expected_output, expected_final = per_token_definition(**inputs, state=state)
    for output, final in (
        gated_delta_rule(**inputs, state=state, chunk_size=chunk_size),
        gated_delta_step(**inputs, state=state),
    ):
        torch.testing.assert_close(output, expected_output, **TOL)
        torch.testing.assert_close(final, expected_final, **TOL)


def test_chunked_rule_gradients_match_the_recurrence():
    """Training runs the chunked form: its gradients (through the triangular solves) are the recurrence's, for every
    input and the initial state."""
    generator = torch.Generator().manual_seed(8)
    inputs = {name: tensor.requires_grad_() for name, tensor in rule_inputs().items()}
    inputs["state"] = initial_state().requires_grad_()
    output_weights = torch.randn(2, LENGTH, VALUE_HEADS, VALUE_DIM, generator=generator)
    state_weights = torch.randn(2, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=generator)
    gradients = []
    for rule in (lambda **x: gated_delta_rule(**x, chunk_size=8), gated_delta_step):
        output, final = rule(**inputs)
        loss = (output * output_weights).sum() + (final * state_weights).sum()
        gradients.append(torch.autograd.grad(loss, list(inputs.values())))
    for chunked, recurrent in zip(*gradients):
        torch.testing.assert_close(chunked, recurrent, **TOL)


def test_short_convolution_matches_transformers_causal_conv1d_and_its_update():
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, LENGTH, 10, generator=generator)
    weight, bias = torch.randn(10, KERNEL, generator=generator), torch.randn(10, generator=generator)
    output, _ = short_convolution(hidden, weight, bias)
    expected = qwen.causal_conv1d_fn(hidden.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)
    torch.testing.assert_close(output, expected, **TOL)

    prefix = 7
    _, state = short_convolution(hidden[:, :prefix], weight, bias)
    reference_state = torch.cat([hidden[:, :1, :].transpose(1, 2) * 0, state], dim=-1)  # transformers keeps K inputs
    for t in range(prefix, LENGTH):
        step, state = short_convolution(hidden[:, t : t + 1], weight, bias, state=state)
        reference = qwen.causal_conv1d_update(
            hidden[:, t : t + 1].transpose(1, 2), reference_state, weight, bias, "silu"
        )
        torch.testing.assert_close(step, reference.transpose(1, 2), **TOL)
        torch.testing.assert_close(step, expected[:, t : t + 1], **TOL)


def test_qwen3_next_gated_deltanet_rebuilt_from_the_pieces_on_its_weights():
    """The whole Qwen3-Next linear-attention module (projections, convolution, gates, rule, gated norm) against our
    functions composed the way a layer would compose them, on the module's own (randomised) weights."""
    config = Qwen3NextConfig(
        hidden_size=32, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM, linear_conv_kernel_dim=KERNEL,
        num_hidden_layers=1, layer_types=["linear_attention"], hidden_act="silu", rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(3)
    module = qwen.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for parameter in (module.dt_bias, module.norm.weight):
            parameter.normal_()
    hidden = torch.randn(2, LENGTH, 32)
    with torch.no_grad():
        expected = module(hidden)
        query, key, value, gate, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden), module.in_proj_ba(hidden)
        )  # Qwen3-Next's interleaved projection layout, (B, T, heads, dim) each
        mixed = torch.cat([x.flatten(2) for x in (query, key, value)], dim=-1)  # (B, T, C)
        mixed, _ = short_convolution(mixed, module.conv1d.weight[:, 0])
        query, key, value = mixed.split([KEY_HEADS * KEY_DIM, KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM], dim=-1)
        query, key = (l2_normalize(x.unflatten(-1, (KEY_HEADS, KEY_DIM)).transpose(1, 2)) for x in (query, key))
        value = value.unflatten(-1, (VALUE_HEADS, VALUE_DIM)).transpose(1, 2)  # (B, H_v, T, D_v)
        decay, beta = (x.transpose(1, 2) for x in decay_and_beta(a, b, module.A_log, module.dt_bias))  # (B, H_v, T)
        output, _ = gated_delta_rule(query, key, value, decay, beta)
        output = gated_rms_norm(output, gate, module.norm.weight)  # (B, T, H_v, D_v)
        output = module.out_proj(output.flatten(2))
    torch.testing.assert_close(output, expected, **TOL)


def cache_layers():
    """transformers' own cache layer for a "linear_attention" layer, as a dynamic and as a static cache build it."""
    config = PretrainedConfig(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    return {"dynamic": DynamicCache(config=config), "static": StaticCache(config=config, max_cache_len=64)}


def mixer_inputs(length: int, seed: int = 4) -> dict[str, torch.Tensor]:
    """What a layer feeds its mixer: the (B, T, C) channels before the convolution (q, k, v side by side), the
    convolution's taps, and per-token log decays and betas."""
    generator = torch.Generator().manual_seed(seed)
    channels = 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM
    return dict(
        channels=torch.randn(2, length, channels, generator=generator),
        weight=torch.randn(channels, KERNEL, generator=generator) / 2,
        decay=-2 * torch.rand(2, VALUE_HEADS, length, generator=generator),
        beta=torch.rand(2, VALUE_HEADS, length, generator=generator),
    )


def mix(inputs, span: slice, layer=None, *, decoding: bool = False, documents=None):
    """Convolution then the rule over the tokens `span`, from and into `layer`'s states when there is one."""
    conv_state, state = cached_states(layer) if layer is not None else (None, None)
    mixed, conv_state = short_convolution(
        inputs["channels"][:, span], inputs["weight"], state=conv_state, documents=documents
    )
    query, key, value = mixed.split([KEY_HEADS * KEY_DIM, KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM], dim=-1)
    query, key = (l2_normalize(x.unflatten(-1, (KEY_HEADS, KEY_DIM)).transpose(1, 2)) for x in (query, key))
    value = value.unflatten(-1, (VALUE_HEADS, VALUE_DIM)).transpose(1, 2)  # (B, H_v, T, D_v)
    gates = dict(decay=inputs["decay"][:, :, span], beta=inputs["beta"][:, :, span])
    if decoding:
        output, state = gated_delta_step(query, key, value, **gates, state=state)
    else:
        output, state = gated_delta_rule(query, key, value, **gates, state=state, chunk_size=8, documents=documents)
    if layer is not None:
        store_states(layer, conv_state, state)
    return output, conv_state, state


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_prefill_then_decoding_through_the_cache_matches_one_pass(kind):
    inputs, prefill = mixer_inputs(LENGTH), 10
    expected, _, _ = mix(inputs, slice(0, LENGTH))
    layer = cache_layers()[kind].layers[0]
    outputs = [mix(inputs, slice(0, prefill), layer)[0]]
    outputs += [mix(inputs, slice(t, t + 1), layer, decoding=True)[0] for t in range(prefill, LENGTH)]
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, **TOL)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_decode_state_does_not_grow_with_length(kind):
    inputs, layer, shapes = mixer_inputs(64), cache_layers()[kind].layers[0], {}
    for t in range(64):
        _, conv_state, state = mix(inputs, slice(t, t + 1), layer, decoding=True)
        if t + 1 in (8, 64):
            cached = cached_states(layer)
            shapes[t + 1] = (conv_state.shape, state.shape, cached[0].shape, cached[1].shape)
    assert shapes[8] == shapes[64]
    assert shapes[64][0][-1] == KERNEL - 1 and shapes[64][1][-2:] == (KEY_DIM, VALUE_DIM)


def packed_rows(generator: torch.Generator) -> torch.Tensor:
    """(B, T) document ids: each row holds the documents of DOCUMENT_LENGTHS in another rotated order, so each document
    is last in one row and its boundaries fall at other places of the chunks in each."""
    rows = []
    for shift in range(len(DOCUMENT_LENGTHS)):
        lengths = torch.tensor(DOCUMENT_LENGTHS).roll(shift)
        ids = torch.randperm(100, generator=generator)[: len(lengths)]  # ids need not be sorted or small
        rows.append(ids.repeat_interleave(lengths))
    return torch.stack(rows)


def document_spans(documents: torch.Tensor, row: int) -> list[slice]:
    _, counts = torch.unique_consecutive(documents[row], return_counts=True)
    starts = [0, *torch.cumsum(counts, 0).tolist()]
    return [slice(start, end) for start, end in zip(starts[:-1], starts[1:])]


@pytest.mark.parametrize("chunk_size", [4, 8, 64])
def test_packed_rows_give_each_document_of_the_rule_what_it_gets_alone(chunk_size):
    generator = torch.Generator().manual_seed(5)
    documents = packed_rows(generator)
    inputs, state = rule_inputs(batch=len(documents), length=sum(DOCUMENT_LENGTHS)), initial_state(len(documents))
    output, final = gated_delta_rule(**inputs, state=state, chunk_size=chunk_size, documents=documents)
    for row in range(len(documents)):
        spans = document_spans(documents, row)
        for index, span in enumerate(spans):
            alone = {name: tensor[row : row + 1, :, span] for name, tensor in inputs.items()}
            own_state = state[row : row + 1] if index == 0 else None  # the state given is the first document's
            alone_output, alone_final = gated_delta_rule(**alone, state=own_state, chunk_size=chunk_size)
            torch.testing.assert_close(output[row : row + 1, span], alone_output, **TOL)
        torch.testing.assert_close(final[row : row + 1], alone_final, **TOL)  # the row's last document's


def test_packed_rows_give_each_document_of_the_convolution_what_it_gets_alone():
    generator = torch.Generator().manual_seed(6)
    documents = packed_rows(generator)
    hidden = torch.randn(len(documents), sum(DOCUMENT_LENGTHS), 10, generator=generator)
    weight = torch.randn(10, KERNEL, generator=generator)
    state = torch.randn(len(documents), 10, KERNEL - 1, generator=generator)
    output, final = short_convolution(hidden, weight, state=state, documents=documents)
    for row in range(len(documents)):
        for index, span in enumerate(document_spans(documents, row)):
            own_state = state[row : row + 1] if index == 0 else None
            alone_output, alone_final = short_convolution(hidden[row : row + 1, span], weight, state=own_state)
            torch.testing.assert_close(output[row : row + 1, span], alone_output, **TOL)
        torch.testing.assert_close(final[row : row + 1], alone_final, **TOL)


def test_packed_mixer_matches_each_document_alone():
    """Convolution and rule together, as a layer runs them on a packed row."""
    generator = torch.Generator().manual_seed(7)
    documents = packed_rows(generator)[:2]
    inputs = mixer_inputs(sum(DOCUMENT_LENGTHS))
    output, _, _ = mix(inputs, slice(None), documents=documents)
    for row in range(2):
        for span in document_spans(documents, row):
            alone = {name: tensor if name == "weight" else tensor[row : row + 1] for name, tensor in inputs.items()}
            alone_output, _, _ = mix(alone, span)  # the document's tokens only, from zero states
            torch.testing.assert_close(output[row : row + 1, span], alone_output, **TOL)


# The "gated_deltanet" layer type: the kernel in a model.
SIZES = dict(
    linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS, linear_key_head_dim=KEY_DIM,
    linear_value_head_dim=VALUE_DIM, linear_conv_kernel_dim=KERNEL,
)  # fmt: skip


def qwen3_next_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """A `Qwen3NextGatedDeltaNet`'s weights under the layer's names: its interleaved `in_proj_qkvz` / `in_proj_ba`
    rows regrouped by the module's own `fix_query_key_value_ordering` (applied to the weights' columns, each a
    token), `out_proj` as `o_proj`."""
    hidden = module.in_proj_qkvz.weight.shape[1]
    parts = module.fix_query_key_value_ordering(module.in_proj_qkvz.weight.T[None], module.in_proj_ba.weight.T[None])
    query, key, value, z, b, a = (part.reshape(hidden, -1).T for part in parts)  # (rows, hidden) each
    return {
        "in_proj_qkv.weight": torch.cat([query, key, value]),
        "in_proj_z.weight": z,
        "in_proj_b.weight": b,
        "in_proj_a.weight": a,
        "conv1d.weight": module.conv1d.weight,
        "dt_bias": module.dt_bias,
        "A_log": module.A_log,
        "norm.weight": module.norm.weight,
        "o_proj.weight": module.out_proj.weight,
    }


def test_gated_deltanet_layer_matches_qwen3_next_on_copied_weights():
    reference_config = Qwen3NextConfig(
        hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6, **SIZES
    )
    torch.manual_seed(5)
    reference = qwen.Qwen3NextGatedDeltaNet(reference_config, layer_idx=0).eval()
    with torch.no_grad():
        for parameter in (reference.dt_bias, reference.norm.weight):
            parameter.normal_()
    config = cf.CoreformerDecoderConfig(
        vocab_size=99, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
        layer_types=["gated_deltanet", "full"], layer_norm_eps=1e-6, **SIZES,
    )  # fmt: skip
    ours = Attention(config, 0, is_causal=True, layer_type="gated_deltanet").eval()
    ours.load_state_dict(qwen3_next_weights(reference))
    states = torch.randn(2, LENGTH, 32, generator=torch.Generator().manual_seed(6))
    padding = torch.ones(2, LENGTH, dtype=torch.long)
    padding[1, :7] = 0  # left padding, as generate() pads
    with torch.no_grad():
        expected = reference(states, attention_mask=padding)
        actual, weights = ours(states, plan=LayerPlan(mask=padding.bool(), kernel=True))
    assert weights is None  # no keys, no map
    real = padding.bool()
    torch.testing.assert_close(actual[real], expected[real], **TOL)


def gdn_model(**overrides):
    fields = dict(layer_types=["gated_deltanet", "full"], position_embedding_type="rotary", **SIZES)
    return tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", **(fields | overrides))


def test_left_padded_rows_equal_each_row_alone():
    model = gdn_model()
    ids, mask = padded_batch(length=12, left=True)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for row in range(ids.shape[0]):
            real = mask[row].bool()
            alone = model(ids[row : row + 1, real]).logits[0]
            torch.testing.assert_close(batch[row, real], alone, **TOL)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_decoding_through_the_cache_equals_the_full_forward_with_a_state_that_does_not_grow(kind):
    model = gdn_model()
    ids, mask = padded_batch(length=14, left=True)
    cache = StaticCache(config=model.config, max_cache_len=16) if kind == "static" else None
    incremental, full, cache = decode_incrementally(model, ids, mask, prefix=4, cache=cache)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], **TOL)
    layer = cache.layers[0]
    assert isinstance(layer, LinearAttentionLayer)  # transformers' own, built from the layer type
    conv_state, state = cached_states(layer)
    assert conv_state.shape == (3, 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM, KERNEL - 1)
    assert state.shape == (3, VALUE_HEADS, KEY_DIM, VALUE_DIM)  # after 4 tokens as after 14
    assert cache.get_seq_length() == ids.shape[1]  # counted by the attention layer


def test_generate_with_and_without_the_cache_gives_the_same_tokens():
    model = gdn_model()
    ids, mask = padded_batch(length=8, left=True)
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    cached = model.generate(ids, **settings)
    uncached = model.generate(ids, use_cache=False, **settings)
    assert torch.equal(cached, uncached)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    plain, checkpointed = gradients_with_and_without_checkpointing(
        gdn_model, lambda name: "layers.0.self_attn." in name
    )
    assert {name.split("self_attn.")[1] for name in plain} == {
        "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
        "dt_bias", "A_log", "norm.weight", "o_proj.weight",
    }  # fmt: skip
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


def test_attentions_are_the_attention_layers_maps_alone():
    model = gdn_model(layer_types=["gated_deltanet", "full", "gated_deltanet", "full"], num_hidden_layers=4)
    ids, mask = padded_batch(length=8, left=True)
    with torch.no_grad():
        output = model(ids, attention_mask=mask, output_attentions=True)
    assert len(output.attentions) == 2  # as Qwen3-Next returns its full layers' only
    assert all(attentions.shape == (3, 4, 8, 8) for attentions in output.attentions)


@pytest.mark.parametrize(
    ("family", "fields", "message"),
    [
        ("encoder", dict(layer_types=["gated_deltanet", "full"]), "puts 'gated_deltanet' in a bidirectional stack"),
        ("decoder", dict(layer_types=["gated_deltanet"] * 2), "make at least one layer an attention layer"),
        ("decoder", dict(layer_types=["gated_deltanet", "full"], linear_num_value_heads=3), "must be a multiple"),
        ("decoder", dict(layer_types=["gated_deltanet", "full"], linear_conv_kernel_dim=0), "positive integer"),
        ("decoder", dict(layer_types=["gated_deltanet", "full"], attention_sinks=True), "own scores in a kernel"),
    ],
)
def test_config_refuses_what_gated_deltanet_layers_cannot_do(family, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config(family, **fields)


def test_serving_engines_onnx_and_a_cache_of_another_layout_are_refused_by_name(tmp_path):
    model = gdn_model()
    with pytest.raises(ValueError, match="'gated_deltanet' \\(layer 0\\)"):
        check_served(model.config.layer_types, "vLLM", "serve it with generate().")
    with pytest.raises(ValueError, match="'gated_deltanet'"):
        refuse_unexportable(model.config)
    with pytest.raises(ValueError, match="DynamicCache\\(config=model.config\\)"):
        model(torch.randint(3, VOCAB, (1, 4)), past_key_values=DynamicCache(), use_cache=True)


def test_empty_batches_single_tokens_and_rows_of_padding_alone():
    model = gdn_model()
    ids, mask = padded_batch()
    all_padding = mask.clone()
    all_padding[1] = 0
    with torch.no_grad():
        assert model(torch.zeros(0, 5, dtype=torch.long)).logits.shape == (0, 5, VOCAB)
        assert model(torch.tensor([[5], [6]])).logits.shape == (2, 1, VOCAB)
        reference = model(ids, attention_mask=mask).logits
        output = model(ids, attention_mask=all_padding).logits
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output[0], reference[0], **TOL)


def test_assisted_decoding_is_refused_as_for_every_stateful_model():
    # A crop cannot take the rejected draft tokens back out of the recurrent state.
    model = gdn_model()
    assert model._is_stateful and not type(model)._is_stateful  # this model's layers, not the class's
    with pytest.raises(ValueError, match="stateful"):
        model.generate(torch.randint(3, VOCAB, (1, 6)), max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=2)


@pytest.mark.parametrize(
    "backend", ["sdpa", pytest.param("flex_attention", marks=pytest.mark.xdist_group("flex_attention"))]
)
def test_the_attention_layers_backend_leaves_the_outputs_as_eager_gives_them(request, backend):
    # Gated DeltaNet calls no backend; the full layer beside it runs under each (flex: the other flex tests' shapes).
    if backend == "flex_attention":
        request.getfixturevalue("flex_attention")  # skips where flex cannot build its kernel
    model = gdn_model(**FLEX_HEADS)
    ids, mask = padded_batch(length=FLEX_LENGTH, left=True)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(backend)
        actual = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], **TOL)
