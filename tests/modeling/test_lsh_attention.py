"""LSH attention (`lsh_attention.py`): the kernel against a brute-force dense reference and against transformers'
Reformer `LSHSelfAttention`, causality, padding, determinism; then the "lsh" layer type in whole models: rotations
saved with the weights, cached decoding and generation, padding, gradient checkpointing, attention maps, refusals."""

import json

import pytest
import torch
from tiny import VOCAB, decode_incrementally, padded_batch, tiny_config, tiny_model
from transformers import PreTrainedConfig, ReformerConfig
from transformers.configuration_utils import ALLOWED_LAYER_TYPES
from transformers.models.reformer.modeling_reformer import LSHSelfAttention

import coreformer as cf
from coreformer.export import export_native
from coreformer.lsh_attention import (
    SELF_SCORE,
    draw_rotations,
    hash_buckets,
    length_normalized,
    lsh_attention,
    lsh_visible_mask,
)

HEADS, HEAD_DIM, BUCKETS = 2, 8, 4


def _inputs(batch=2, length=21, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, HEADS, length, HEAD_DIM, generator=generator)
    value = torch.randn(batch, HEADS, length, HEAD_DIM, generator=generator)
    return query.requires_grad_(requires_grad), value.requires_grad_(requires_grad)


def _brute_force_mask(buckets: torch.Tensor, valid: torch.Tensor, bucket_size: int, causal: bool) -> torch.Tensor:
    """The pattern written out token by token: per round, the tokens of a bucket in position order; a query sees the
    tokens of its bucket fewer than `bucket_size` places away (earlier ones when causal); rounds joined by union;
    itself only when it sees nothing else. (B, H, n, L) buckets, (B, L) valid -> (B, H, L, L)."""
    batch, heads, rounds, length = buckets.shape
    mask = torch.zeros(batch, heads, length, length, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for r in range(rounds):
                members: dict[int, list[int]] = {}
                for t in range(length):
                    if valid[b, t]:
                        members.setdefault(int(buckets[b, h, r, t]), []).append(t)
                for tokens in members.values():
                    for qi, q in enumerate(tokens):
                        for ki, k in enumerate(tokens):
                            near = 0 <= qi - ki < bucket_size if causal else abs(qi - ki) < bucket_size
                            if near and k != q:
                                mask[b, h, q, k] = True
            for q in range(length):
                if not mask[b, h, q].any():
                    mask[b, h, q, q] = True
    return mask


def _dense_attention(query, key, value, mask, scaling):
    scores = (query @ key.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ value).transpose(1, 2)  # (B, L, H, D)


def _kernel(query, value, rotations, bucket_size, causal, padding_mask=None, **options):
    key = length_normalized(query)
    buckets = hash_buckets(key, rotations, padding_mask)
    return lsh_attention(
        query,
        key,
        value,
        buckets,
        num_buckets=BUCKETS,
        bucket_size=bucket_size,
        causal=causal,
        padding_mask=padding_mask,
        scaling=HEAD_DIM**-0.5,
        **options,
    )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("num_hashes", [1, 3])
def test_kernel_equals_dense_attention_under_the_brute_force_mask(causal, num_hashes):
    query, value = _inputs(requires_grad=True)
    rotations = draw_rotations(HEADS, HEAD_DIM, num_hashes, BUCKETS, seed=1)
    padding_mask = torch.ones(2, 21, dtype=torch.bool)
    padding_mask[1, :4] = False  # left padding in the second row
    bucket_size = 3
    output = _kernel(query, value, rotations, bucket_size, causal, padding_mask)

    key = length_normalized(query)
    buckets = hash_buckets(key, rotations, padding_mask)
    mask = _brute_force_mask(buckets, padding_mask, bucket_size, causal)
    assert mask.sum(-1).max() > 1 and (mask.sum(-1) == 1).any()  # some queries see several keys, some only themselves
    expected = _dense_attention(query, key, value, mask, HEAD_DIM**-0.5)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)

    weights = torch.randn_like(output)
    grads = torch.autograd.grad((output * weights).sum(), (query, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, value))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_visible_mask_equals_the_brute_force_mask(causal):
    query, _ = _inputs(length=17)
    rotations = draw_rotations(HEADS, HEAD_DIM, 2, BUCKETS, seed=2)
    padding_mask = torch.ones(2, 17, dtype=torch.bool)
    padding_mask[0, -5:] = False
    buckets = hash_buckets(length_normalized(query), rotations, padding_mask)
    mask = lsh_visible_mask(
        buckets,
        buckets,
        query_positions=torch.arange(17),
        bucket_size=2,
        causal=causal,
        key_padding_mask=padding_mask,
    )
    assert torch.equal(mask, _brute_force_mask(buckets, padding_mask, 2, causal))
    # The last queries alone against all keys (a cached decoding step) see what they see in the full mask.
    tail = lsh_visible_mask(
        buckets[..., -4:],
        buckets,
        query_positions=torch.arange(13, 17),
        bucket_size=2,
        causal=causal,
        key_padding_mask=padding_mask,
    )
    assert torch.equal(tail, mask[:, :, -4:])


def _reformer(num_hashes: int, chunk_length: int, causal: bool, seed: int) -> LSHSelfAttention:
    config = ReformerConfig(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        attention_head_size=HEAD_DIM,
        num_hashes=num_hashes,
        num_buckets=BUCKETS,
        lsh_attn_chunk_length=chunk_length,
        lsh_num_chunks_before=1,
        lsh_num_chunks_after=0,
        lsh_attention_probs_dropout_prob=0.0,
        is_decoder=causal,
        hash_seed=seed,
        attn_layers=["lsh"],
    )
    torch.manual_seed(0)
    return LSHSelfAttention(config, layer_idx=0).eval()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("num_hashes", [1, 2])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_reformer_compatible_kernel_equals_transformers_lsh_self_attention(causal, num_hashes, padded):
    """Matched settings: transformers' `LSHSelfAttention` with `num_buckets=4` (an int, not factorised),
    `lsh_attn_chunk_length=4`, one chunk before and none after, no dropout, `hash_seed=7` (Reformer then draws its
    rotations with `torch.manual_seed(7); torch.randn((H, D, n_hashes, n_buckets // 2))`, which is what we pass in),
    length 16 (a multiple of the chunk, and longer than one chunk, where Reformer skips hashing), its `query_key` and
    `value` weights, its output before `ReformerSelfOutput`. Our kernel with `reformer_compatible=True`: every key
    of the chunk and the one before, circularly across rounds, duplicates not discounted, as Reformer does."""
    seed, length, chunk = 7, 16, 4
    reformer = _reformer(num_hashes, chunk, causal, seed)
    hidden = torch.randn(2, length, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        attention_mask[1, -5:] = 0
    with torch.no_grad():
        expected = reformer(hidden, attention_mask=attention_mask if padded else None).hidden_states

        def heads(projection):  # (B, L, H*D) -> (B, H, L, D)
            return projection(hidden).view(2, length, HEADS, HEAD_DIM).transpose(1, 2)

        torch.manual_seed(seed)
        rotations = torch.randn(HEADS, HEAD_DIM, num_hashes, BUCKETS // 2)
        value = heads(reformer.value)
        output = _kernel(
            heads(reformer.query_key),
            value,
            rotations,
            chunk,
            causal,
            attention_mask.bool() if padded else None,
            reformer_compatible=True,
        )
    # A query that sees only itself has a log-sum-exp near -1e5 in every round, where fp32 steps by 0.008: Reformer's
    # join exp(lse_r - logsumexp(lse)) then weighs the rounds to a sum of 0.998 or so (ours subtracts the maximum
    # first, and gives the query's value). Those rows agree to that rounding; every other row to 1e-5.
    expected = expected.view(2, length, HEADS, HEAD_DIM)
    own_value = torch.isclose(output, value.transpose(1, 2), atol=1e-6, rtol=0).all(-1)  # (B, L, H)
    alone = own_value & attention_mask.bool()[..., None]
    seen = ~own_value & attention_mask.bool()[..., None]
    assert seen.sum() > alone.sum() and (alone.any() or not causal)  # the first token sees only itself when causal
    torch.testing.assert_close(output[seen], expected[seen], atol=1e-5, rtol=0)
    torch.testing.assert_close(output[alone], expected[alone], atol=1e-5, rtol=2e-2 if num_hashes > 1 else 0)


def test_the_layer_pattern_is_not_reformers_chunk_pattern():
    """The two patterns differ (the reason for `reformer_compatible`): Reformer attends across bucket boundaries."""
    query, value = _inputs(length=16)
    rotations = draw_rotations(HEADS, HEAD_DIM, 1, BUCKETS, seed=0)
    ours = _kernel(query, value, rotations, 4, causal=False)
    reformer = _kernel(query, value, rotations, 4, causal=False, reformer_compatible=True)
    assert not torch.allclose(ours, reformer, atol=1e-3)


@pytest.mark.parametrize("num_hashes", [1, 2])
def test_later_tokens_never_change_earlier_outputs(num_hashes):
    query, value = _inputs(length=24)
    rotations = draw_rotations(HEADS, HEAD_DIM, num_hashes, BUCKETS, seed=3)
    output = _kernel(query, value, rotations, 4, causal=True)
    changed_query, changed_value = query.clone(), value.clone()
    changed_query[:, :, 15:] = torch.randn_like(changed_query[:, :, 15:])
    changed_value[:, :, 15:] = torch.randn_like(changed_value[:, :, 15:])
    changed = _kernel(changed_query, changed_value, rotations, 4, causal=True)
    torch.testing.assert_close(changed[:, :15], output[:, :15], atol=1e-6, rtol=0)
    assert not torch.allclose(changed[:, 15:], output[:, 15:])
    # A prefix alone gives its tokens the same outputs: nothing after them (nor the chunk padding) matters.
    torch.testing.assert_close(_kernel(query[:, :, :15], value[:, :, :15], rotations, 4, True), output[:, :15])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
def test_padding_changes_nothing_for_real_tokens(causal, left):
    query, value = _inputs(batch=1, length=13)
    rotations = draw_rotations(HEADS, HEAD_DIM, 2, BUCKETS, seed=4)
    alone = _kernel(query, value, rotations, 3, causal)
    pad = 6
    padding = (0, 0, pad, 0) if left else (0, 0, 0, pad)
    padded_query = torch.nn.functional.pad(query, padding, value=5.0)  # padding with content, to show it is unseen
    padded_value = torch.nn.functional.pad(value, padding, value=5.0)
    padding_mask = torch.ones(1, 13 + pad, dtype=torch.bool)
    if left:
        padding_mask[:, :pad] = False
    else:
        padding_mask[:, 13:] = False
    padded_output = _kernel(padded_query, padded_value, rotations, 3, causal, padding_mask)
    torch.testing.assert_close(padded_output[padding_mask], alone[0], atol=1e-6, rtol=0)


def test_two_calls_agree_and_rotations_come_from_their_own_generator():
    torch.manual_seed(0)
    before = torch.randn(3)
    torch.manual_seed(0)
    rotations = draw_rotations(HEADS, HEAD_DIM, 2, BUCKETS, seed=5)
    assert torch.equal(torch.randn(3), before)  # the global generator did not move
    assert torch.equal(rotations, draw_rotations(HEADS, HEAD_DIM, 2, BUCKETS, seed=5))
    query, value = _inputs()
    torch.testing.assert_close(
        _kernel(query, value, rotations, 4, True), _kernel(query, value, rotations, 4, True), atol=0, rtol=0
    )


def test_a_query_sees_itself_only_when_it_sees_nothing_else():
    query, value = _inputs(batch=1, length=8)
    rotations = torch.zeros(HEADS, HEAD_DIM, 1, BUCKETS // 2)  # every token in bucket 0: a sliding band in order
    output = _kernel(query, value, rotations, 3, causal=True)
    # The first token has no earlier key: its own value. The second sees the first only, not itself.
    torch.testing.assert_close(output[:, 0], value[:, :, 0])
    torch.testing.assert_close(output[:, 1], value[:, :, 0])
    assert SELF_SCORE > -1e9  # the self score is finite: a query alone keeps weight 1 on itself


def test_odd_bucket_counts_are_refused():
    with pytest.raises(ValueError, match="even number of buckets"):
        draw_rotations(HEADS, HEAD_DIM, 1, 5, seed=0)


LSH = dict(lsh_bucket_size=3, lsh_num_hashes=2, lsh_num_buckets=4)


def _lsh_model(family: str = "decoder", **overrides):
    model_class = cf.CoreformerDecoderForCausalLM if family == "decoder" else cf.CoreformerEncoderModel
    fields = dict(layer_types=["lsh", "lsh"], position_embedding_type="rotary", **LSH)
    fields.update(overrides)
    return tiny_model(model_class, family, **fields)


def _attention(model, layer: int = 0):
    stack = model.model.decoder if hasattr(model, "lm_head") else model.encoder
    return stack.layers[layer].self_attn


def test_lsh_layers_share_queries_and_keys_and_save_their_rotations(tmp_path):
    model = _lsh_model()
    assert _attention(model).k_proj is None
    assert not any("k_proj" in name for name in model.state_dict())
    for layer in (0, 1):  # drawn at initialisation from lsh_hash_seed + layer
        expected = draw_rotations(4, 8, LSH["lsh_num_hashes"], LSH["lsh_num_buckets"], seed=layer)
        assert torch.equal(_attention(model, layer).lsh_rotations, expected)
    # The checkpoint's rotations are the ones used after loading, not redrawn from the seed.
    _attention(model).lsh_rotations.copy_(draw_rotations(4, 8, 2, 4, seed=99))
    model.save_pretrained(tmp_path)
    loaded = cf.CoreformerDecoderForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(_attention(loaded).lsh_rotations, _attention(model).lsh_rotations)
    ids = torch.randint(3, VOCAB, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_lsh_decoding_through_the_cache_equals_the_full_forward():
    model = _lsh_model()
    ids, mask = padded_batch(length=14, left=True)
    incremental, full, _ = decode_incrementally(model, ids, mask, prefix=5)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_lsh_cached_greedy_generation_equals_uncached(cache_implementation):
    model = _lsh_model()
    ids, mask = padded_batch(length=8, left=True)
    options = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, cache_implementation=cache_implementation, **options)
        uncached = model.generate(ids, use_cache=False, **options)
    assert torch.equal(cached, uncached)


def test_lsh_seq2seq_cached_generation_equals_uncached():
    model = tiny_model(
        cf.CoreformerSeq2SeqForConditionalGeneration,
        "seq2seq",
        layer_types=["lsh", "full"],
        decoder_layer_types=["lsh", "full"],
        **LSH,
    )
    ids, mask = padded_batch(length=9)
    options = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        assert torch.equal(
            model.generate(ids, use_cache=True, **options), model.generate(ids, use_cache=False, **options)
        )


def test_lsh_decoder_later_tokens_never_change_earlier_logits():
    model = _lsh_model()
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[:, 9:] = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, changed_logits = model(ids).logits, model(changed).logits
    torch.testing.assert_close(changed_logits[:, :9], logits[:, :9], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_lsh_padding_changes_nothing_for_real_tokens(family):
    """Left-padded decoder rows get position ids that skip the padding (as generate() passes them): buckets hash the
    rotary-rotated keys, so the positions must be the row's own."""
    model = _lsh_model(family)
    ids, mask = padded_batch(length=13, left=family == "decoder")
    positions = (mask.cumsum(-1) - 1).clamp_min(0) if family == "decoder" else None
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, position_ids=positions)
        batched = batched.logits if family == "decoder" else batched.last_hidden_state
        for row in range(ids.shape[0]):
            real = mask[row].bool()
            alone = model(ids[row : row + 1, real])
            alone = alone.logits if family == "decoder" else alone.last_hidden_state
            torch.testing.assert_close(batched[row, real], alone[0], atol=1e-5, rtol=0)


def test_lsh_gradient_checkpointing_gives_identical_gradients():
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpointing in (False, True):
        model = _lsh_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_lsh_attention_maps_are_the_pattern_s_softmax(family):
    model = _lsh_model(family)
    ids, mask = padded_batch(length=12, left=family == "decoder")
    with torch.no_grad():
        attentions = model(ids, attention_mask=mask, output_attentions=True).attentions
    first = attentions[0]  # (B, H, T, T)
    real = mask.bool()
    torch.testing.assert_close(first.sum(-1)[real[:, None].expand(-1, 4, -1)], torch.ones(int(real.sum()) * 4))
    assert (first == 0).float().mean() > 0.5  # most keys are outside the pattern
    # Padding keys get no weight from real queries.
    weight_on_padding = (first * (~real)[:, None, None, :]).sum(-1)
    assert weight_on_padding[real[:, None].expand(-1, 4, -1)].max() == 0
    if family == "decoder":
        out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True, output_attentions=True)  # a prefill
        with pytest.raises(ValueError, match="cached decoding step of an 'lsh' layer"):
            model(ids[:, 6:7], attention_mask=mask[:, :7], past_key_values=out.past_key_values, output_attentions=True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(lsh_bucket_size=None), "need `lsh_bucket_size`, a positive integer"),
        (dict(lsh_num_buckets=5), "`lsh_num_buckets` must be even"),
        (dict(lsh_num_hashes=0), "`lsh_num_hashes` must be a positive integer"),
        (dict(num_key_value_heads=2), "set `num_key_value_heads`"),
    ],
)
def test_lsh_config_is_validated_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("decoder", layer_types=["lsh", "full"], **{**LSH, **overrides})


def test_lsh_is_saved_under_a_layer_type_name_transformers_accepts(tmp_path):
    config = tiny_config("decoder", layer_types=["lsh", "full"], **LSH)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    # transformers' generic config (what AutoTokenizer reads without coreformer) validates the names, after mapping
    # legacy spellings to current ones (every supported release accepts the one written)
    generic = PreTrainedConfig(layer_types=written["layer_types"])
    assert set(generic.layer_types) <= set(ALLOWED_LAYER_TYPES)
    assert cf.CoreformerDecoderConfig.from_pretrained(tmp_path).layer_types == ["lsh", "full"]
    assert config.get_text_config(decoder=True).layer_types == ["full_attention", "full_attention"]


def test_lsh_models_are_refused_by_onnx_and_native_export_naming_the_layer_type(tmp_path):
    from coreformer.export.onnx import export_onnx

    model = _lsh_model(layer_types=["lsh", "full"])
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"\['lsh'\] attention layers, which do not export to ONNX"):
        export_onnx(tmp_path / "model", tmp_path / "onnx")
    with pytest.raises(ValueError, match="layer_types"):
        export_native(tmp_path / "model", tmp_path / "native")


@pytest.mark.slow
def test_compiled_lsh_and_block_decoder_forward_equals_eager():
    # torch.compile's default backend (inductor generates the code): the hash, sort, gathers and masks of both kernels.
    model = _lsh_model(layer_types=["lsh", "block"], block_size=4)
    model.set_attn_implementation("sdpa")  # block layers: their O(L·b) kernel
    ids, mask = padded_batch(length=13, left=True)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        compiled = torch.compile(model)(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(compiled[real], eager[real], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_lsh_and_block_encoder_training_step_equals_eager():
    # The captured forward and its autograd graph (aot_eager: capture without code generation, the part that can bake
    # a wrong constant or drop a mutation), then a packed row: a second graph, with per-document kernels.
    model = _lsh_model("encoder", layer_types=["lsh", "block"], block_size=4)
    model.set_attn_implementation("sdpa")
    compiled = torch.compile(model, backend="aot_eager")
    ids, mask = padded_batch(length=13)
    real = mask.bool()
    runs = []
    for forward in (model, compiled):
        model.zero_grad()
        states = forward(ids, attention_mask=mask).last_hidden_state
        (states.sin() * real[..., None]).sum().backward()  # real tokens only: eager leaves padding rows at zero
        runs.append((states.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}))
    (eager, eager_grads), (ours, grads) = runs
    torch.testing.assert_close(ours[real], eager[real], atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], atol=1e-4, rtol=1e-4, msg=name)
    packed_ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(5), torch.arange(8)])[None]  # two documents, the second mid-block
    with torch.no_grad():
        packed = compiled(packed_ids, position_ids=positions).last_hidden_state
        alone = torch.cat([model(packed_ids[:, :5]).last_hidden_state, model(packed_ids[:, 5:]).last_hidden_state], 1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
