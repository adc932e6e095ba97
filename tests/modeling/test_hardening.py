"""Bad and unusual input: every config either builds a working model or is refused naming the field; odd batches and
low precision give correct results or one clear error."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import FAMILY_CLASSES, VOCAB, padded_batch, tiny_model
from transformers import AutoModel, AutoModelForCausalLM

import coreformer as cf
from coreformer.layer_types import LAYER_TYPES

HEADS = {
    "encoder": cf.CoreformerEncoderForMaskedLM,
    "decoder": cf.CoreformerDecoderForCausalLM,
    "seq2seq": cf.CoreformerSeq2SeqForConditionalGeneration,
}
CONFIG_FIELDS = set(cf.CoreformerSeq2SeqConfig.__dataclass_fields__) | {"num_hidden_layers"}


@st.composite
def config_fields(draw):
    """Config values, valid and invalid alike: small ranges so that every valid draw runs in milliseconds."""
    family = draw(st.sampled_from(list(FAMILY_CLASSES)))
    layers = draw(st.integers(-1, 3))
    types = st.lists(st.sampled_from(tuple(LAYER_TYPES)), min_size=max(layers, 0), max_size=max(layers, 0))
    fields = dict(
        vocab_size=draw(st.integers(-1, 64)),
        hidden_size=draw(st.sampled_from([0, 6, 8, 12, 16, 24])),
        num_attention_heads=draw(st.integers(0, 5)),
        num_key_value_heads=draw(st.one_of(st.none(), st.integers(0, 4))),
        head_dim=draw(st.one_of(st.none(), st.integers(-1, 6))),
        intermediate_size=draw(st.integers(0, 20)),
        hidden_act=draw(st.sampled_from(["gelu", "gelu_new", "silu", "relu", "tanh", "swishy"])),
        gated_mlp=draw(st.booleans()),
        max_position_embeddings=draw(st.integers(0, 24)),
        position_embedding_type=draw(st.sampled_from(["learned", "sinusoidal", "rotary", "none", "alibi"])),
        norm_type=draw(st.sampled_from(["layernorm", "rmsnorm", "batchnorm"])),
        norm_position=draw(st.sampled_from(["pre", "post", "sandwich"])),
        type_vocab_size=draw(st.integers(-1, 2)),
        attention_bias=draw(st.booleans()),
        hidden_dropout=draw(st.sampled_from([0.0, 0.1, 1.0, -0.1])),
        sliding_window=draw(st.one_of(st.none(), st.integers(-1, 4))),
        stride=draw(st.one_of(st.none(), st.integers(0, 4))),
        lowrank_k=draw(st.one_of(st.none(), st.integers(0, 30))),
        kv_lora_rank=draw(st.one_of(st.none(), st.integers(0, 6))),
        linear_feature_map=draw(st.sampled_from(["elu", "performer", "relu"])),
        pad_token_id=draw(st.sampled_from([0, 63, 100])),
        bos_token_id=None,
        eos_token_id=draw(st.sampled_from([1, None])),
    )
    if family == "seq2seq":
        fields.update(encoder_layers=layers, decoder_layers=draw(st.integers(1, 2)), decoder_start_token_id=1)
        fields.update(
            layer_types=draw(types),
            decoder_layer_types=draw(st.lists(st.sampled_from(tuple(LAYER_TYPES)), min_size=1, max_size=2)),
        )
    else:
        fields.update(num_hidden_layers=layers, layer_types=draw(types))
    return family, fields


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config_fields())
def test_every_config_builds_a_working_model_or_is_refused_naming_the_field(case):
    family, fields = case
    config_class = FAMILY_CLASSES[family][0]
    torch.manual_seed(0)
    try:  # refused by the config, or by the model it builds (the head width is checked where it sizes weights)
        model = HEADS[family](config_class(**fields)).train()
    except ValueError as error:
        message = str(error)
        assert any(f"`{name}`" in message or f"'{name}'" in message for name in CONFIG_FIELDS), message
        return
    config = model.config
    length = min(6, config.max_position_embeddings)
    ids = torch.randint(0, config.vocab_size, (2, length))
    output = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    assert torch.isfinite(output.loss)
    output.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_empty_batches_and_single_tokens_give_correctly_shaped_outputs(family):
    model = tiny_model(HEADS[family], family)
    for backend in ("eager", "sdpa"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            assert model(torch.zeros(0, 5, dtype=torch.long)).logits.shape == (0, 5, VOCAB)
            single = model(torch.tensor([[5], [6]])).logits
        assert single.shape == (2, 1, VOCAB) and torch.isfinite(single).all()


def test_rows_that_are_all_padding_stay_finite_and_leave_other_rows_unchanged(family):
    model = tiny_model(HEADS[family], family)
    ids, mask = padded_batch()
    all_padding = mask.clone()
    all_padding[1] = 0
    for backend in ("eager", "sdpa"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            reference = model(ids, attention_mask=mask).logits
            output = model(ids, attention_mask=all_padding).logits
        assert torch.isfinite(output).all()
        torch.testing.assert_close(output[0], reference[0], atol=1e-5, rtol=0)


def test_malformed_inputs_get_one_clear_error():
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder")
    ids = torch.randint(3, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="integer token ids"):
        model(ids.float())
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq_len\)"):
        model(ids[None])
    with pytest.raises(ValueError, match="no tokens"):
        model(ids[:, :0])
    with pytest.raises(ValueError, match=r"inputs_embeds must be \(batch, seq_len, hidden_size=32\)"):
        model(inputs_embeds=torch.zeros(2, 5, 16))


def test_inputs_embeds_of_another_dtype_are_matched_to_the_model():
    model = tiny_model(cf.CoreformerEncoderModel, "encoder")
    ids = torch.randint(3, VOCAB, (2, 5))
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        expected = model(inputs_embeds=embeds).last_hidden_state
        output = model(inputs_embeds=embeds.double()).last_hidden_state
    torch.testing.assert_close(output, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_long_sequences_with_large_activations_stay_finite(family, dtype):
    # Queries/keys scaled 40x make raw scores in the thousands: softmax must still be computed stably (fp32 in
    # eager; the kernels' own scaling in sdpa), and eager and sdpa must agree on real tokens.
    outputs = {}
    for backend in ("eager", "sdpa"):
        model = tiny_model(FAMILY_CLASSES[family][1], family, max_position_embeddings=1024).to(dtype)
        model.set_attn_implementation(backend)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    parameter.mul_(40)
            ids, mask = padded_batch(batch=2, length=1024, left=family == "decoder")
            extra = {"decoder_input_ids": ids[:, :32]} if family == "seq2seq" else {}
            outputs[backend] = model(ids, attention_mask=mask, **extra).last_hidden_state.float()
        assert torch.isfinite(outputs[backend]).all()
    real = mask.bool() if family != "seq2seq" else torch.ones(2, 32, dtype=torch.bool)
    # The stated tolerance: outputs (magnitude ~4) agree to 8 ulps at the worst element (bf16 ulp 1/32 there, fp16
    # 1/256), and to well under one ulp on average; the backends round q, k and probabilities at different points.
    ulp = 2**-5 if dtype == torch.bfloat16 else 2**-8
    difference = (outputs["sdpa"][real] - outputs["eager"][real]).abs()
    assert difference.max() <= 8 * ulp and difference.mean() <= ulp / 4, (difference.max(), difference.mean())


def test_attention_mask_of_the_wrong_length_is_refused_naming_the_shapes():
    model = tiny_model(cf.CoreformerEncoderModel, "encoder")
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 9\) but the input needs \(3, 10\)"):
        model(ids, attention_mask=mask[:, :9])


def test_a_checkpoint_of_another_family_or_model_type_is_refused(tmp_path):
    tiny_model(cf.CoreformerDecoderForCausalLM, "decoder").save_pretrained(tmp_path / "decoder")
    with pytest.raises(ValueError, match="'coreformer_decoder' model, not 'coreformer_encoder'"):
        cf.CoreformerEncoderForMaskedLM.from_pretrained(tmp_path / "decoder")
    bert = {"model_type": "bert", "vocab_size": 10, "hidden_size": 8, "num_attention_heads": 2}
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps(bert))
    with pytest.raises(ValueError, match="convert it first with `coreformer convert"):
        cf.CoreformerEncoderModel.from_pretrained(tmp_path / "bert")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_truncated_or_corrupt_weights_name_the_checkpoint_and_the_fix(tmp_path, damage):
    tiny_model(cf.CoreformerDecoderForCausalLM, "decoder").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file" * 4)
    with pytest.raises(ValueError, match="truncated or corrupt .* save the checkpoint again"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_config_from_a_newer_version_with_unknown_fields_still_loads(tmp_path):
    model = tiny_model(cf.CoreformerEncoderModel, "encoder")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["attention_sink_tokens"] = 4  # a field this version does not know
    (tmp_path / "config.json").write_text(json.dumps(config))
    reloaded = AutoModel.from_pretrained(tmp_path)
    ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).last_hidden_state, model(ids).last_hidden_state, atol=0, rtol=0)


DETERMINISM = textwrap.dedent(
    """
    import hashlib, sys, torch
    sys.path.insert(0, sys.argv[1])
    torch.set_num_threads(1)  # the same reduction order in every process
    from tiny import padded_batch, tiny_model
    import coreformer as cf
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", seed=7, hidden_dropout=0.1).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask = padded_batch()
    losses = []
    for _ in range(5):
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(losses, digest)
    """
)


@pytest.mark.slow
def test_the_same_seed_gives_identical_weights_and_losses_across_runs(monkeypatch, capsys):
    # A fresh process and this one (dropout on, so the RNG matters) must agree bit for bit: a second fresh process
    # would only repeat the imports.
    tests_dir = str(Path(__file__).resolve().parents[1])  # where tiny.py lives
    fresh = subprocess.run([sys.executable, "-c", DETERMINISM, tests_dir], capture_output=True, text=True, check=True)
    monkeypatch.setattr(sys, "argv", ["-c", tests_dir])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the run's insert is undone with it
    threads = torch.get_num_threads()
    try:
        exec(compile(DETERMINISM, "<determinism>", "exec"), {"__name__": "__main__"})
    finally:
        torch.set_num_threads(threads)
    here = capsys.readouterr().out
    assert fresh.stdout == here and here.strip()


def test_linformer_input_longer_than_its_projections_is_refused_naming_the_fix():
    # Rotary positions do not stop a long input by themselves; the E/F projections have max_position_embeddings
    # columns, and without the check the input failed with an opaque matmul shape error.
    model = tiny_model(
        cf.CoreformerEncoderModel,
        "encoder",
        layer_types=["lowrank", "full"],
        lowrank_k=4,
        max_position_embeddings=16,
        position_embedding_type="rotary",
    )
    model(torch.randint(3, VOCAB, (1, 16)))  # up to the limit works
    with pytest.raises(ValueError, match=r"17 tokens, more than the 16 \(max_position_embeddings\).*truncat"):
        model(torch.randint(3, VOCAB, (1, 17)))
