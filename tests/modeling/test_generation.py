"""Caches and generate(): incremental decoding equals a full forward; every decoding mode agrees with the reference."""

import pytest
import torch
from conftest import VARIANTS
from tiny import PAD, VOCAB, decode_incrementally, padded_batch, tiny_config, tiny_model
from transformers.cache_utils import DynamicCache, StaticCache

import coreformer as cf


def _greedy(model, ids, mask, **kwargs):
    # min_new_tokens keeps random weights from stopping at eos on step one, which would make every mode agree.
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, **kwargs)


@pytest.mark.compat
@pytest.mark.parametrize("variant_name", list(VARIANTS))
def test_decoder_incremental_decoding_equals_full_forward(variant_name):
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", **VARIANTS[variant_name])
    ids, mask = padded_batch(left=True)
    incremental, full, cache = decode_incrementally(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], atol=1e-5, rtol=0)


@pytest.mark.compat
def test_seq2seq_incremental_decoding_equals_full_forward():
    model = tiny_model(cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq")
    ids, mask = padded_batch()
    target = torch.randint(3, VOCAB, (3, 7))
    with torch.no_grad():
        full = model(ids, attention_mask=mask, decoder_input_ids=target).logits
        encoder_outputs = model.get_encoder()(ids, attention_mask=mask)
        cache, steps = None, []
        for t in range(target.shape[1]):
            out = model(
                attention_mask=mask,
                encoder_outputs=encoder_outputs,
                decoder_input_ids=target[:, t : t + 1],
                past_key_values=cache,
                use_cache=True,
            )
            steps.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("family", "head", "left"),
    [
        ("decoder", cf.CoreformerDecoderForCausalLM, True),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, False),
    ],
)
@pytest.mark.compat
def test_greedy_decoding_is_the_same_with_dynamic_static_and_no_cache(family, head, left):
    model = (
        tiny_model(head, family, position_embedding_type="rotary") if family == "decoder" else tiny_model(head, family)
    )
    ids, mask = padded_batch(left=left)
    reference = _greedy(model, ids, mask, use_cache=False)
    assert torch.equal(_greedy(model, ids, mask), reference)
    assert torch.equal(_greedy(model, ids, mask, cache_implementation="static"), reference)
    if family == "decoder":
        static = StaticCache(config=model.config, max_cache_len=32)
        assert torch.equal(_greedy(model, ids, mask, past_key_values=static), reference)


@pytest.mark.parametrize(
    ("family", "head", "left"),
    [
        ("decoder", cf.CoreformerDecoderForCausalLM, True),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, False),
    ],
)
@pytest.mark.compat
def test_batched_generation_with_padding_equals_one_row_at_a_time(family, head, left):
    model = tiny_model(head, family)
    ids, mask = padded_batch(left=left)
    batched = _greedy(model, ids, mask)
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        alone = _greedy(model, ids[row : row + 1, real], mask[row : row + 1, real])
        new_batched = batched[row, -8:]
        assert torch.equal(alone[0, -8:], new_batched), row


@pytest.mark.parametrize(
    ("family", "head", "left"),
    [
        ("decoder", cf.CoreformerDecoderForCausalLM, True),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, False),
    ],
)
def test_beam_search_sampling_and_assisted_decoding_run(family, head, left):
    model = tiny_model(head, family)
    ids, mask = padded_batch(left=left)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=4, num_return_sequences=2)
    assert beams.shape[0] == 6
    torch.manual_seed(0)
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=10)
    torch.manual_seed(0)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=10), sampled)
    # Assisted decoding with the model as its own assistant must reproduce plain greedy decoding exactly.
    one_ids, one_mask = ids[:1], mask[:1]
    assisted = _greedy(model, one_ids, one_mask, assistant_model=model)
    assert torch.equal(assisted, _greedy(model, one_ids, one_mask))


@pytest.mark.compat
@pytest.mark.parametrize("layer_types", [["linear", "linear"], ["linear", "full"]], ids=["linear", "linear-full"])
def test_assisted_and_prompt_lookup_decoding_roll_linear_states_back_to_plain_greedy(layer_types):
    # A different assistant proposes tokens the model rejects, and prompt lookup proposes the prompt's continuations:
    # both make the model's cache take back verified draft tokens (a linear layer rebuilds its running state).
    settings = dict(layer_types=layer_types, position_embedding_type="rotary")
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", **settings)
    assistant = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", seed=1, **settings)
    ids, mask = padded_batch(batch=1, length=6)
    ids = torch.cat([ids, ids, ids[:, :3]], dim=1)  # a repeated prompt, so prompt lookup finds candidates
    mask = torch.ones_like(ids)
    plain = _greedy(model, ids, mask)
    assert torch.equal(_greedy(model, ids, mask, assistant_model=assistant), plain)
    assert torch.equal(_greedy(model, ids, mask, prompt_lookup_num_tokens=3), plain)


def test_a_linear_state_refuses_to_take_back_more_than_its_last_forward():
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", layer_types=["linear", "full"])
    ids, _ = padded_batch(batch=1, length=6)
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    with torch.no_grad():
        model(ids[:, :4], use_cache=True, past_key_values=cache)
        model(ids[:, 4:], use_cache=True, past_key_values=cache)
        with pytest.raises(RuntimeError, match=r"only the tokens of its last forward \(2\)"):
            cache.crop(-3)
        cache.crop(-1)
        assert cache.get_seq_length() == 5
        after_crop = model(ids[:, 5:], use_cache=True, past_key_values=cache).logits
        fresh = model(ids, use_cache=False).logits[:, 5:]
    torch.testing.assert_close(after_crop, fresh, atol=1e-5, rtol=1e-5)


def test_generation_stops_each_row_at_eos_and_pads_it():
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder")
    ids, mask = padded_batch(left=True)
    free = _greedy(model, ids, mask)[:, ids.shape[1] :]
    eos = int(free[0, 0])  # make row 0's first new token the eos
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=PAD
    )
    new = out[:, ids.shape[1] :]
    for row in range(ids.shape[0]):
        hits = (free[row] == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else free.shape[1]
        assert torch.equal(new[row, :stop], free[row, :stop])
        assert (new[row, stop:] == PAD).all()


def test_dynamic_cache_keeps_one_entry_per_layer_and_token():
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder")
    ids = torch.randint(3, VOCAB, (2, 5))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert len(cache.layers) == 2 and cache.get_seq_length() == 5
    assert cache.layers[0].keys.shape == (2, 4, 5, 8)  # (B, H_kv, T, D)


def test_training_never_builds_a_cache():
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder").train()
    ids = torch.randint(3, VOCAB, (2, 5))
    assert model(ids, labels=ids).past_key_values is None


@pytest.mark.slow
def test_static_cache_decode_step_compiles_with_fullgraph():
    # torch.compile(fullgraph=True) fails on any graph break: the input checks (.item()) must step aside while
    # compiling, and masks, positions and the cache update (a full layer's static layer and a sliding layer's static
    # sliding-window layer) must trace; inductor's code for the step must compute what eager does.
    model = tiny_model(
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        position_embedding_type="rotary",
        layer_types=["sliding", "full"],
        sliding_window=3,
    )
    ids = torch.randint(3, VOCAB, (2, 6))
    next_ids, positions = torch.randint(3, VOCAB, (2, 1)), torch.full((2, 1), 6)
    logits = []
    for compiled in (False, True):
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            step = torch.compile(model.forward, fullgraph=True) if compiled else model.forward
            logits.append(
                step(input_ids=next_ids, position_ids=positions, past_key_values=cache, use_cache=True).logits
            )
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layer_types", [["sliding", "full"], ["strided", "linear"]])
def test_prefill_into_an_empty_cache_runs_the_sparse_kernels_and_matches_eager(monkeypatch, layer_types):
    # An eval forward builds a DynamicCache by default; while it is empty, sliding/strided layers must still take
    # the O(L·w) kernels rather than a dense (B, 1, L, L) mask, and compute what eager's dense mask computes.
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", layer_types=layer_types, sliding_window=3, stride=3)
    calls = []
    for module in model.modules():
        if isinstance(module, cf.attention.Attention) and module.layer_type in ("sliding", "strided"):
            attend = module.kernel.attend
            monkeypatch.setattr(module.kernel, "attend", lambda *a, attend=attend: (calls.append(1), attend(*a))[1])
    ids, mask = padded_batch(length=14, left=True)
    with torch.no_grad():
        cached = model(ids, attention_mask=mask)
        assert calls and cached.past_key_values is not None
        sdpa_tokens = {
            mode: _greedy(model, ids, mask, pad_token_id=PAD, **mode_kwargs)
            for mode, mode_kwargs in (("dynamic", {}), ("static", {"cache_implementation": "static"}))
        }
        model.set_attn_implementation("eager")
        reference = model(ids, attention_mask=mask).logits
        eager_tokens = _greedy(model, ids, mask, pad_token_id=PAD)
    real = mask.bool()
    torch.testing.assert_close(cached.logits[real], reference[real], atol=1e-5, rtol=0)
    for mode, tokens in sdpa_tokens.items():
        assert torch.equal(tokens, eager_tokens), mode


@pytest.mark.parametrize(
    ("family", "layer_types", "graphs"),
    [
        # The prefill and one decode step, the same for every later step (the 8-token prompt already fills the
        # sliding window; a window filling up mid-generation recompiles once more, in transformers' own
        # StaticSlidingWindowLayer, as for Mistral or Qwen2).
        ("decoder", ["full", "sliding"], 2),
        ("decoder", ["strided", "full"], 2),
        ("decoder", ["differential", "sigmoid"], 2),
        ("decoder", ["mla", "full"], 2),
        ("decoder", ["gated_deltanet", "full"], 2),
        # The first decoder step computes the cross-attention keys, every later one reads them (as in BART).
        ("seq2seq", ["full", "full"], 2),
    ],
)
@pytest.mark.slow
def test_static_cache_generation_compiles_fullgraph_once_and_matches_eager(family, layer_types, graphs):
    # generate() prepares per-layer-type masks for a static cache (create_masks_for_generate), so every decode step
    # hands the compiled forward tensors of one shape; fullgraph=True fails on any graph break.
    if family == "decoder":
        model = tiny_model(
            cf.CoreformerDecoderForCausalLM, "decoder", layer_types=layer_types, sliding_window=3, stride=3,
            kv_lora_rank=6,
        )  # fmt: skip
    else:
        model = tiny_model(
            cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq", decoder_layer_types=layer_types, sliding_window=3
        )
    ids, mask = padded_batch(length=8, left=family == "decoder")
    compiled = []

    def counting_backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward  # run the captured graph as is: what is counted is capture, not code generation

    generate = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, cache_implementation="static")
    eager_tokens = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **generate)
    model.forward = torch.compile(model.forward, fullgraph=True, backend=counting_backend)
    # Other models' compiled entries share transformers' forward wrapper: room enough that none is evicted.
    with torch._dynamo.config.patch(recompile_limit=64):
        tokens = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **generate)
    assert torch.equal(tokens, eager_tokens)
    assert len(compiled) == graphs, f"{len(compiled)} graphs for 10 decode steps"


def test_sliding_decoder_generates_the_same_with_a_dynamic_and_a_static_cache_from_padding_queries():
    # transformers' test_generate_with_static_cache on its sliding variant (rotary, RMSNorm, SwiGLU, MQA, batch 2 of
    # 7 tokens, random masks with holes and right padding). A right-padded row's next token comes from the logits of
    # its last position, a padding query: the sliding kernel (a prefill into an empty dynamic cache) must give it
    # what the dense mask (a static cache) does -- its band's real keys, not itself as well.
    model = tiny_model(
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        **VARIANTS["rotary_rmsnorm_swiglu_gqa"] | dict(num_key_value_heads=1),
        layer_types=["full", "sliding"],
        sliding_window=64,
    )
    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]])
    generate = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        kernel_logits = model(ids, attention_mask=mask).logits  # sdpa, empty dynamic cache: the sliding kernel
        dynamic = model.generate(ids, attention_mask=mask, output_scores=True, **generate)
        static = model.generate(ids, attention_mask=mask, output_scores=True, cache_implementation="static", **generate)
        model.set_attn_implementation("eager")
        dense_logits = model(ids, attention_mask=mask).logits
    # Every position with a real key at or before it, padding included (left padding sees no key at all: unused).
    seen = mask.cumsum(-1) > 0
    torch.testing.assert_close(kernel_logits[seen], dense_logits[seen], atol=1e-5, rtol=0)
    assert torch.equal(dynamic.sequences, static.sequences)
    for dynamic_scores, static_scores in zip(dynamic.scores, static.scores):
        torch.testing.assert_close(dynamic_scores, static_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("encoder_layers, decoder_layers", [(2, 3), (3, 2)])
def test_seq2seq_with_stacks_of_different_depths_generates_alike_with_every_cache(encoder_layers, decoder_layers):
    # The cache is sized from get_text_config(decoder=True); transformers renames only the decoder_* fields that
    # to_dict() writes, and an all-"full" decoder_layer_types is not written: the cache used to take the encoder's
    # depth (IndexError in the cache once the decoder was deeper).
    config = tiny_config("seq2seq", encoder_layers=encoder_layers, decoder_layers=decoder_layers)
    assert len(config.get_text_config(decoder=True).layer_types) == decoder_layers
    model = cf.CoreformerSeq2SeqForConditionalGeneration(config).eval()
    source = torch.randint(3, VOCAB, (2, 7))
    greedy = dict(max_new_tokens=5, do_sample=False)
    uncached = model.generate(source, use_cache=False, **greedy)
    assert torch.equal(model.generate(source, **greedy), uncached)
    assert torch.equal(model.generate(source, cache_implementation="static", **greedy), uncached)
