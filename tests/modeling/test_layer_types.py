"""Efficient attention per layer (`layer_types`): each type against an explicit reference, caches, and whole models."""

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny import PAD, VOCAB, decode_incrementally, padded_batch, tiny_config, tiny_model
from transformers.cache_utils import DynamicCache

import coreformer as cf
from coreformer import sparse_attention
from coreformer.layer_kernel import LayerKernel
from coreformer.layer_types import LAYER_TYPES, LayerType
from coreformer.linear_attention import elu_feature_map, linear_attention, performer_feature_map
from coreformer.probes import AssociativeRecall, recall_model_config, train_associative_recall
from coreformer.sparse_attention import sliding_window_attention, strided_attention

PARAMETERS = dict(sliding_window=2, stride=3, lowrank_k=6, kv_lora_rank=6)


def _explicit_mask(layer_type: str, mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """The dense (B, 1, T, T) additive mask a layer type stands for, written out position by position."""
    length = mask.shape[1]
    q = torch.arange(length)[:, None]
    kv = torch.arange(length)[None, :]
    distance = (q - kv).abs()
    allowed = torch.ones(length, length, dtype=torch.bool)
    if layer_type == "sliding":
        allowed = distance <= PARAMETERS["sliding_window"]
    elif layer_type == "strided":
        stride = PARAMETERS["stride"]
        allowed = (distance < stride) | (distance % stride == 0)
    if causal:
        allowed = allowed & (kv <= q)
    allowed = allowed[None, None] & mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("layer_type", ["full", "sliding", "strided"])
@pytest.mark.parametrize("family", ["encoder", "decoder"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_masked_types_equal_an_explicit_dense_mask(layer_type, family, backend):
    model_class = cf.CoreformerEncoderModel if family == "encoder" else cf.CoreformerDecoderModel
    model = tiny_model(model_class, family, layer_types=[layer_type] * 2, **PARAMETERS)
    reference = tiny_model(model_class, family, **PARAMETERS)  # all "full": the explicit mask does the work
    reference.load_state_dict(model.state_dict())
    model.set_attn_implementation(backend)
    reference.set_attn_implementation("eager")
    ids, mask = padded_batch(length=12, left=family == "decoder")
    with torch.no_grad():
        output = model(ids, attention_mask=mask).last_hidden_state
        expected = reference(
            ids, attention_mask=_explicit_mask(layer_type, mask, family == "decoder")
        ).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(output[real], expected[real], atol=1e-5, rtol=0)


def _kernel_and_dense_reference(kernel, allowed_pattern, causal, **kernel_args):
    """Output and q/k/v gradients of a sparse kernel and of sdpa under the dense mask it stands for, on a batch with
    right padding (row 1) and left padding (row 2); compared on real query positions only."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(3, 2, 30, 8, generator=generator, requires_grad=True) for _ in range(3))
    padding = torch.ones(3, 30, dtype=torch.bool)
    padding[1, 25:] = padding[2, :4] = False
    distance = torch.arange(30)[:, None] - torch.arange(30)[None, :]
    allowed = allowed_pattern(distance) & ((distance >= 0) if causal else True) & padding[:, None, None, :]
    dense = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=0.3)
    outputs = (kernel(query, key, value, causal=causal, padding_mask=padding, scaling=0.3, **kernel_args), dense)
    results = []
    for output in outputs[0], outputs[1].transpose(1, 2):
        real = output[padding]  # queries that are padding have no defined output
        results.append((real, *torch.autograd.grad(real.pow(2).sum(), (query, key, value))))
    return results


@pytest.fixture(params=["fused", "autograd"])
def kernel_path(request, monkeypatch):
    """Run the sparse kernels through torch's fused CPU kernels (the default on CPU) or, as on other devices and
    with attention dropout, through autograd."""
    if request.param == "autograd":
        monkeypatch.setattr(sparse_attention, "_fused_kernels_apply", lambda query, dropout: False)
    return request.param


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk_size", [4, 7, 64])
def test_chunked_band_kernel_equals_the_dense_band_mask(causal, chunk_size, kernel_path):
    output, expected = _kernel_and_dense_reference(
        sliding_window_attention, lambda d: d.abs() <= 5, causal, window=5, chunk_size=chunk_size
    )
    for got, want in zip(output, expected):  # output, then the gradients of query, key, value
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("stride", "chunk_size"), [(4, 3), (4, None), (7, 5), (40, None)])
def test_strided_kernel_equals_the_dense_strided_mask(causal, stride, chunk_size, kernel_path):
    # stride 40 > length: no key is a whole stride away, so that part is empty for every query.
    output, expected = _kernel_and_dense_reference(
        strided_attention,
        lambda d: (d.abs() < stride) | (d % stride == 0),
        causal,
        stride=stride,
        chunk_size=chunk_size,
    )
    for got, want in zip(output, expected):  # output, then the gradients of query, key, value
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_strided_kernel_in_bf16_is_as_accurate_as_bf16_sdpa_under_the_dense_mask(causal, kernel_path):
    # The band and the far part join through their log-sum-exps. In bf16 an lse near 10 is only known to ±0.03, so
    # the join must run in fp32: carried as a bf16 key it gave twice sdpa's error here. What may remain is one more
    # rounding of each part's output (measured 1.3x).
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 256, 16, generator=generator).bfloat16() for _ in range(3))
    padding = torch.ones(2, 256, dtype=torch.bool)
    padding[1, 247:] = False
    distance = torch.arange(256)[:, None] - torch.arange(256)[None, :]
    allowed = (distance.abs() < 4) | (distance % 4 == 0)
    allowed = allowed & ((distance >= 0) if causal else True) & padding[:, None, None, :]
    exact = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=allowed, scale=1.0
    ).transpose(1, 2)[padding]

    def error(output: torch.Tensor) -> float:  # relative RMS error over the real queries
        return ((output[padding].float() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()

    dense = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=1.0)
    output = strided_attention(query, key, value, stride=4, causal=causal, padding_mask=padding, scaling=1.0)
    assert output.dtype == torch.bfloat16
    assert error(output) < 1.5 * error(dense.transpose(1, 2))


def test_strided_attention_dropout_is_unbiased():
    # With attention dropout the kernels go through autograd (torch's fused CPU kernels have no dropout); each part
    # drops its keys one by one and rescales, so the output averages to the exact one.
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 24, 4, generator=generator) for _ in range(3))
    exact = strided_attention(query, key, value, stride=4, causal=False, padding_mask=None, scaling=0.5)
    torch.manual_seed(0)
    samples = torch.stack(
        [
            strided_attention(query, key, value, stride=4, causal=False, padding_mask=None, scaling=0.5, dropout=0.2)
            for _ in range(1000)
        ]
    )
    assert not torch.equal(samples[0], exact)
    assert ((samples.mean(0) - exact).abs() <= 5 * samples.std(0) / 1000**0.5 + 1e-6).all()


@pytest.mark.parametrize("kernel", [sliding_window_attention, strided_attention])
def test_sparse_kernels_keep_for_backward_only_what_full_sdpa_keeps(kernel):
    # Autograd holds this between a layer's forward and backward, for every layer: query, key, value, the output
    # and its log-sum-exp, as full attention under sdpa. No (L x window) mask, score or probability tensor and no
    # copy of the key windows (the chunks and masks are rebuilt in backward).
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randn(2, 256, 2, 16, generator=generator, requires_grad=True) for _ in range(3)]
    query, key, value = (states.transpose(1, 2) for states in tokens)  # (B, H, T, D), laid out as the model does

    def saved_bytes(attend) -> int:
        storages = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            attend()
        return sum(storages.values())

    full = saved_bytes(lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=0.25))
    arguments = dict(window=8) if kernel is sliding_window_attention else dict(stride=8)
    sparse = saved_bytes(lambda: kernel(query, key, value, causal=False, padding_mask=None, scaling=0.25, **arguments))
    assert sparse <= full


@pytest.mark.parametrize("layer_type", ["sliding", "strided"])
@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_sparse_kernels_under_sdpa_match_eager_on_long_padded_sequences(layer_type, family):
    # sdpa takes the sparse kernels, eager the dense mask from transformers' machinery: outputs and every gradient.
    model_class = cf.CoreformerEncoderModel if family == "encoder" else cf.CoreformerDecoderModel
    model = tiny_model(
        model_class,
        family,
        layer_types=[layer_type, "full"],
        sliding_window=9,
        stride=9,
        max_position_embeddings=256,
        position_embedding_type="rotary",
    )
    ids, mask = padded_batch(length=150, left=family == "decoder")
    real = mask.bool()
    results = []
    for backend in ("eager", "sdpa"):
        model.set_attn_implementation(backend)
        model.zero_grad()
        output = model(ids, attention_mask=mask, use_cache=False).last_hidden_state[real]
        output.pow(2).mean().backward()
        results.append((output.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (expected, expected_grads), (output, grads) = results
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def _quadratic_linear_attention(query_features, key_features, value, causal):
    """The O(L²) form: A = φ(Q) φ(K)ᵀ (causally masked), output = A V / rowsum(A)."""
    scores = query_features @ key_features.transpose(-2, -1)
    if causal:
        scores = torch.tril(scores)
    return (scores @ value / scores.sum(-1, keepdim=True)).transpose(1, 2)


@pytest.mark.parametrize("feature_map", ["elu", "performer"])
@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_o_l_form_equals_its_quadratic_form(feature_map, causal):
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 3, 150, 8, generator=generator) for _ in range(3))  # 150 spans 3 chunks
    if feature_map == "elu":
        query_features, key_features = elu_feature_map(query), elu_feature_map(key)
    else:
        projection = torch.randn(8, 16, generator=generator)
        query_features = performer_feature_map(query, projection, is_query=True)
        key_features = performer_feature_map(key, projection, is_query=False)
    output, _ = linear_attention(query_features, key_features, value, causal=causal)
    expected = _quadratic_linear_attention(query_features, key_features, value, causal)
    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)


def test_linear_attention_state_continues_exactly_token_by_token():
    generator = torch.Generator().manual_seed(1)
    query, key, value = (elu_feature_map(torch.randn(1, 2, 10, 4, generator=generator)) for _ in range(3))
    full, _ = linear_attention(query, key, value, causal=True)
    state, steps = None, []
    for t in range(10):
        step, state = linear_attention(
            query[:, :, t : t + 1], key[:, :, t : t + 1], value[:, :, t : t + 1], causal=True, state=state
        )
        steps.append(step)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


@pytest.mark.compat
@pytest.mark.parametrize(
    "layer_type", ["full", "sliding", "strided", "linear", "differential", "sigmoid", "mla", "gated_deltanet"]
)
def test_cached_decoding_equals_the_full_forward(layer_type):
    model = tiny_model(
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        layer_types=[layer_type, "full"],
        position_embedding_type="rotary",
        **PARAMETERS,
    )
    ids, mask = padded_batch(length=14, left=True)
    incremental, full, cache = decode_incrementally(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], atol=1e-5, rtol=0)
    if layer_type == "sliding":
        # The sliding layer keeps only its window; the full layer keeps everything.
        assert cache.layers[0].keys.shape[2] == PARAMETERS["sliding_window"]
        assert cache.layers[1].keys.shape[2] == ids.shape[1]
    if layer_type == "linear":
        assert cache.layers[0].state.shape == (3, 4, 8, 9)  # (B, H, features, head_dim + 1): no growth with length


def test_linear_attention_cache_needs_the_model_config():
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", layer_types=["linear", "full"])
    with pytest.raises(ValueError, match="DynamicCache\\(config=model.config\\)"):
        model(torch.randint(3, VOCAB, (1, 4)), past_key_values=DynamicCache(), use_cache=True)


def test_lowrank_encoder_ignores_right_padding():
    # Padded keys are zeroed before the projection and E/F are cut to the sequence length, so a padded row equals
    # the same row alone.
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", layer_types=["lowrank", "lowrank"], **PARAMETERS)
    ids, mask = padded_batch(length=12)
    length = int(mask[2].sum())
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).last_hidden_state[2, :length]
        alone = model(ids[2:, :length]).last_hidden_state[0]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    assert PAD not in ids[2, :length]


MIXED = {
    "encoder": dict(layer_types=["sliding", "lowrank", "linear", "strided"]),
    "decoder": dict(layer_types=["sliding", "linear", "strided", "full"], position_embedding_type="rotary"),
    "seq2seq": dict(layer_types=["lowrank", "sliding"], decoder_layer_types=["linear", "sliding"]),
}
HEADS = {
    "encoder": cf.CoreformerEncoderForMaskedLM,
    "decoder": cf.CoreformerDecoderForCausalLM,
    "seq2seq": cf.CoreformerSeq2SeqForConditionalGeneration,
}


def _mixed_model(family: str, **extra):
    layers = {"num_hidden_layers": 4} if family != "seq2seq" else {}
    return tiny_model(HEADS[family], family, **MIXED[family], **layers, **PARAMETERS, **extra)


def test_mixed_layer_types_train_and_generate(family):
    model = _mixed_model(family, linear_feature_map="performer").train()
    ids, mask = padded_batch(batch=4, length=12, left=family == "decoder")
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    losses = []
    for _ in range(20):
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    if family == "encoder":
        return
    model.eval()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    reference = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs), reference)
    assert model.generate(ids, num_beams=3, **{k: v for k, v in kwargs.items() if k != "do_sample"}).shape[0] == 4


CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["coreformer"] = None  # a machine without coreformer
    import torch, transformers
    cases = torch.load(sys.argv[1])
    for case in cases:  # before any remote code is loaded: the generic config, no trust_remote_code
        if "words" in case:
            tokenizer = transformers.AutoTokenizer.from_pretrained(case["folder"])
            assert tokenizer(case["words"])["input_ids"] == case["word_ids"], tokenizer(case["words"])
    for case in cases:
        model = getattr(transformers, case["auto_class"]).from_pretrained(case["folder"], trust_remote_code=True)
        assert model.config.layer_types == case["layer_types"], model.config.layer_types
        with torch.no_grad():
            logits = model(input_ids=case["ids"], attention_mask=case["mask"]).logits
        assert (logits - case["logits"]).abs().max() <= 1e-6, case["folder"]
        if "generated" in case:
            generated = model.generate(case["ids"], attention_mask=case["mask"], max_new_tokens=5, min_new_tokens=5,
                                       do_sample=False)
            assert torch.equal(generated, case["generated"]), case["folder"]
    print("ok")
    """
)


@pytest.mark.compat
@pytest.mark.slow
def test_mixed_layer_types_save_load_and_remote_code(tmp_path):
    # In a process without coreformer: each folder loads with remote code and computes what it did here; the
    # decoder's tokenizer loads first through transformers' generic config, which validates `layer_types` against
    # its own names (config.json carries those there and ours under coreformer_layer_types).
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    auto_classes = {
        "encoder": "AutoModelForMaskedLM",
        "decoder": "AutoModelForCausalLM",
        "seq2seq": "AutoModelForSeq2SeqLM",
    }
    cases = []
    for family, auto_class in auto_classes.items():
        model = _mixed_model(family, linear_feature_map="performer")
        ids, mask = padded_batch(length=12, left=family == "decoder")
        folder = tmp_path / family
        model.save_pretrained(folder)
        reloaded = type(model).from_pretrained(folder).eval()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
            torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits, logits, atol=0, rtol=0)
        case = dict(
            auto_class=auto_class,
            folder=str(folder),
            ids=ids,
            mask=mask,
            logits=logits,
            layer_types=model.config.layer_types,
        )
        if family != "encoder":
            case["generated"] = model.generate(
                ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False
            )
        if family == "decoder":
            words = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
            words.pre_tokenizer = pre_tokenizers.Whitespace()
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]")
            tokenizer.save_pretrained(folder)
            case.update(words="a b c", word_ids=[2, 3, 0])
        cases.append(case)
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "cases.pt")], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_layer_types_are_validated_with_the_fix():
    with pytest.raises(ValueError, match="'lowrank' in a causal stack"):
        tiny_config("decoder", layer_types=["lowrank", "full"], lowrank_k=4)
    with pytest.raises(ValueError, match="'lowrank' in a causal stack"):
        tiny_config("seq2seq", decoder_layer_types=["lowrank", "full"], lowrank_k=4)
    with pytest.raises(ValueError, match="'sliding' layers need `sliding_window`"):
        tiny_config("encoder", layer_types=["sliding", "full"])
    with pytest.raises(ValueError, match="unknown attention types \\['reformer'\\]"):
        tiny_config("encoder", layer_types=["reformer", "full"])
    with pytest.raises(ValueError, match="one entry per layer \\(2\\)"):
        tiny_config("decoder", layer_types=["full"])
    with pytest.raises(ValueError, match="`stride` must be >= 2"):
        tiny_config("decoder", layer_types=["strided", "full"], stride=1)
    # Strides cannot reach flash (it reads no mask); a window can, as the `sliding_window` argument.
    model = tiny_model(cf.CoreformerDecoderModel, "decoder", layer_types=["strided", "full"], stride=2)
    model.config._attn_implementation = "flash_attention_2"  # what from_pretrained would set on a GPU
    with pytest.raises(ValueError, match=r"\['strided'\] layers are defined by their mask, which flash_attention_2"):
        model(torch.randint(3, VOCAB, (1, 4)))


def test_transformers_sees_its_own_layer_type_names():
    config = tiny_config("decoder", layer_types=["sliding", "linear"], sliding_window=2)
    assert config.layer_types == ["sliding", "linear"]
    translated = config.get_text_config(decoder=True)
    assert translated.layer_types == ["sliding_attention", "coreformer_linear_attention"]
    assert translated.sliding_window == 3  # transformers counts the query itself
    seq2seq = tiny_config("seq2seq", decoder_layer_types=["sliding", "full"], sliding_window=2)
    assert seq2seq.get_text_config(decoder=True).layer_types == ["sliding_attention", "full_attention"]


@pytest.mark.slow
def test_full_attention_learns_associative_recall():
    # Two layers of full attention must find an earlier key and copy what followed it (an induction circuit); it
    # appears abruptly, after ~500 steps here. How the other types do is reported by benchmarks/long_context.py.
    task = AssociativeRecall()
    config = recall_model_config(task, "full")
    accuracy = train_associative_recall(config, task, steps=800, lr=1e-3)
    chance = 1 / task.num_values
    assert accuracy > 0.9, f"accuracy {accuracy:.3f} (chance {chance:.3f})"


def test_all_full_layer_types_stay_out_of_config_json_and_come_back_on_load(tmp_path):
    # transformers' generic config (used e.g. by AutoTokenizer where coreformer is not installed) rejects layer-type
    # names it does not know, so the default is not written; non-default lists are, and both round-trip.
    for name, overrides in {"default": {}, "mixed": dict(layer_types=["sliding", "full"], sliding_window=2)}.items():
        config = tiny_config("decoder", **overrides)
        config.save_pretrained(tmp_path / name)
        written = json.loads((tmp_path / name / "config.json").read_text())
        assert ("layer_types" in written) == (name == "mixed")
        if name == "mixed":  # transformers' names where it looks, ours beside them
            assert written["layer_types"] == ["sliding_attention", "full_attention"]
            assert written["coreformer_layer_types"] == ["sliding", "full"]
        assert cf.CoreformerDecoderConfig.from_pretrained(tmp_path / name).layer_types == config.layer_types


def test_a_config_rebuilt_from_its_dict_keeps_mixed_layer_types():
    # transformers' own tests (and users) rebuild configs as `Config(**config.to_dict())`; the dict carries
    # transformers' names under `layer_types` and ours under `coreformer_layer_types`.
    for family, overrides in {
        "decoder": dict(layer_types=["full", "sliding"], sliding_window=2),
        "seq2seq": dict(
            layer_types=["strided", "full"], decoder_layer_types=["sliding", "full"], stride=2, sliding_window=2
        ),
    }.items():
        config = tiny_config(family, **overrides)
        rebuilt = type(config)(**config.to_dict())
        assert rebuilt.layer_types == config.layer_types
        assert rebuilt.to_dict() == config.to_dict()


@pytest.mark.slow
def test_flex_block_mask_skips_blocks_for_sliding_layers(flex_attention):
    # The point of flex for a band: whole 128 x 128 blocks outside the window are never computed.
    model = tiny_model(
        cf.CoreformerEncoderModel, "encoder", layer_types=["sliding", "full"], sliding_window=64, stride=4
    )
    model.set_attn_implementation("flex_attention")
    length = 1024
    hidden = torch.zeros(1, length, model.config.hidden_size)
    masks = model.encoder.planner.build_masks(hidden, None, None, torch.arange(length)[None])
    # 8 x 8 blocks; a band of +-64 touches at most 3 per row: at least 58% of them skipped. Full attention skips none.
    assert masks["sliding"].sparsity() > 55
    assert masks["full"] is None or masks["full"].sparsity() == 0


class _UniformKernel(LayerKernel):
    """A toy layer type's kernel: every query averages the values of the real keys, scaled by a buffer of its own."""

    def build(self, attention):
        attention.register_buffer("toy_scale", torch.empty(()))

    def init_weights(self, attention):
        attention.toy_scale.fill_(2.0)

    def attend(self, attention, query, key, value, mask, cache, plan):
        return (self.probabilities(attention, query, key, plan) @ value).transpose(1, 2) * attention.toy_scale

    def probabilities(self, attention, query, key, plan):
        visible = torch.ones(*query.shape[:3], key.shape[2])  # (B, H, T, S)
        if plan.mask is not None:
            visible = visible * plan.mask[:, None, None, :]
        return visible / visible.sum(-1, keepdim=True)


def test_a_new_layer_type_is_a_kernel_and_one_table_entry(monkeypatch):
    # What adding a layer type takes: a LayerKernel and one entry in the table; config, stack, plan, attention,
    # weight init and recomputed probabilities follow from them.
    entry = LayerType(
        "full_attention", "full_attention", padding_mask_only=True, kernel=lambda config: _UniformKernel()
    )
    monkeypatch.setitem(LAYER_TYPES, "uniform", entry)
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", layer_types=["uniform", "full"])
    attention = model.encoder.layers[0].self_attn
    assert float(attention.toy_scale) == 2.0 and "encoder.layers.0.self_attn.toy_scale" in model.state_dict()
    ids, mask = padded_batch(length=8)
    with torch.no_grad():
        attentions = model(ids, attention_mask=mask, output_attentions=True).attentions
    uniform = (mask / mask.sum(1, keepdim=True))[:, None, None, :]  # (B, 1, 1, S): the real keys, equally
    torch.testing.assert_close(attentions[0], uniform.expand_as(attentions[0]))
    # The plan hands the layer its padding mask and runs its kernel; the layer computes the kernel's output.
    hidden = torch.randn(*ids.shape, model.config.hidden_size)
    plan = model.encoder.planner.plan(
        hidden,
        mask,
        None,
        torch.arange(8)[None],
        None,
        None,
        output_attentions=False,
        padded_states=False,
    )
    layer = plan.layers["uniform"]
    assert layer.kernel and torch.equal(layer.mask, mask.bool())
    with torch.no_grad():
        ours = attention(hidden, layer._replace(unpadding=None))[0]  # padded states in
        value = attention.v_proj(hidden).view(*hidden.shape[:2], -1, attention.head_dim)  # (B, T, H, D)
        average = (value * mask[:, :, None, None]).sum(1) / mask.sum(1)[:, None, None]  # (B, H, D)
        reference = attention.o_proj(2.0 * average.flatten(-2))[:, None].expand_as(ours)  # (B, T, hidden)
    torch.testing.assert_close(ours[mask.bool()], reference[mask.bool()], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_config_reaches_the_table_without_torch_or_kernels():
    # The configuration reads the table; the kernels load only when a layer is built (the table's loaders import
    # them inside functions). Every module-level import from the config down, followed within the package:
    package = os.path.dirname(cf.__file__)
    seen, todo, outside = set(), ["configuration_coreformer"], set()
    while todo:
        name = todo.pop()
        seen.add(name)
        with open(os.path.join(package, f"{name}.py")) as source:
            tree = ast.parse(source.read())
        for node in tree.body:  # module level only
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in seen:
                todo.append(node.module)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                outside.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                outside |= {alias.name.split(".")[0] for alias in node.names}
    assert "layer_types" in seen and not seen & {"sparse_attention", "linear_attention", "lowrank_attention"}
    assert "torch" not in outside, sorted(seen)


@pytest.mark.compat
@pytest.mark.parametrize(
    ("model_class", "family", "layer_types"),
    [
        (cf.CoreformerEncoderForMaskedLM, "encoder", ["lowrank", "lsh"]),
        (cf.CoreformerDecoderForCausalLM, "decoder", ["full", "lsh"]),
        (cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq", ["lowrank", "full"]),
    ],
)
def test_what_low_precision_must_not_round_is_declared_as_transformers_contract_reads_it(
    tmp_path, model_class, family, layer_types
):
    # transformers' test_keep_in_fp32_modules_exist / test_keep_in_fp32_modules, on the layer types that declare
    # something (its common tests build full layers only): every name matches a module of the model, none is in both
    # lists, fp16 loads keep both lists fp32, bf16 loads the strict one only.
    import re

    model = tiny_model(model_class, family, layer_types=layer_types, lowrank_k=8, lsh_bucket_size=4)
    names = {name for name in model.state_dict()}
    both = model._keep_in_fp32_modules | model._keep_in_fp32_modules_strict
    assert model._keep_in_fp32_modules_strict and not model._keep_in_fp32_modules & model._keep_in_fp32_modules_strict
    for kept in both:
        assert any(re.search(rf"(?:^|\.){kept}(?:\.|$)", name) for name in names), kept
    model.save_pretrained(tmp_path)
    for dtype, fp32 in ((torch.float16, both), (torch.bfloat16, model._keep_in_fp32_modules_strict)):
        loaded = model_class.from_pretrained(tmp_path, dtype=dtype)
        for name, tensor in loaded.state_dict().items():
            if tensor.is_floating_point():
                kept = any(re.search(rf"(?:^|\.){pattern}(?:\.|$)", name) for pattern in fp32)
                assert tensor.dtype == (torch.float32 if kept else dtype), (dtype, name)
