"""GGUF export (coreformer.export.gguf): llama and gpt2 files read back by transformers' own GGUF loader equal the
native model; gptneox files (which that loader does not read) are checked through this module's reader, and their
layout against llama.cpp's conventions directly."""

import json

import gguf
import numpy as np
import pytest
import torch
from tiny import tiny_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

import coreformer as cf
from coreformer.export import ExportCheckError
from coreformer.export.gguf import DTYPES, export_gguf, rotary_pairs
from coreformer.training.tokenizer_training import train_tokenizer

TEXTS = ["hello world, this is a test of tokenizers. Unicode ünïcödé ✓ 123 4567", "two  spaces\tand a tab\nnew line"]
VOCAB = 320  # more than the tokenizer's 300: the ids it lacks are written as [PAD<id>] placeholders


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer("decoder", TEXTS * 20, vocab_size=300)


def native_folder(path, model, tokenizer):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def llama(**overrides):
    torch.manual_seed(0)
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).eval()


def gpt2(**overrides):
    torch.manual_seed(0)
    fields = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(GPT2Config(**{**fields, **overrides})).eval()


def gpt_neox(**overrides):
    """A GPT-NeoX as coreformer's decoder presets export it (sequential residual, tanh GELU, tied embeddings)."""
    torch.manual_seed(0)
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_act="gelu_new",
        use_parallel_residual=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0},
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    return GPTNeoXForCausalLM(GPTNeoXConfig(**{**fields, **overrides})).eval()


def loaded_logits(path, ids, **config):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, **config)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(ids).logits


IDS = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [False, True])
def test_llama_f32_loads_back_with_the_same_logits_tokens_and_tokenizer(tmp_path, tokenizer, tied):
    model = llama(tie_word_embeddings=tied)
    out = tmp_path / "model.gguf"
    report = export_gguf(native_folder(tmp_path / "native", model, tokenizer), out, check=True)
    assert report["max_abs_diff"] <= 1e-5
    assert report["greedy_tokens"]["gguf"] == report["greedy_tokens"]["native"]
    assert report["tokenizer"]["mismatched"] == []
    with torch.no_grad():
        expected = model(IDS).logits
    assert (loaded_logits(out, IDS) - expected).abs().max() <= 1e-5
    names = {tensor.name for tensor in gguf.GGUFReader(out).tensors}
    assert ("output.weight" in names) is not tied  # tied: no output tensor, so the loader ties them again
    loaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    assert loaded(TEXTS[0]).input_ids == tokenizer(TEXTS[0]).input_ids


def test_llama_q_and_k_are_stored_in_llama_cpp_rotary_order(tmp_path, tokenizer):
    # the loader's reverse permutation is what makes the f32 logits equal; here the stored rows themselves
    model = llama()
    out = tmp_path / "model.gguf"
    export_gguf(native_folder(tmp_path / "native", model, tokenizer), out)
    stored = {tensor.name: np.array(tensor.data) for tensor in gguf.GGUFReader(out).tensors}
    q = model.model.layers[0].self_attn.q_proj.weight.detach()
    k = model.model.layers[0].self_attn.k_proj.weight.detach()
    assert np.array_equal(stored["blk.0.attn_q.weight"], rotary_pairs(q, 4).numpy())
    assert np.array_equal(stored["blk.0.attn_k.weight"], rotary_pairs(k, 2).numpy())
    assert not np.array_equal(stored["blk.0.attn_q.weight"], q.numpy())


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_llama_lower_precision_stays_within_its_tolerance(tmp_path, tokenizer, dtype):
    out = tmp_path / f"model-{dtype}.gguf"
    report = export_gguf(native_folder(tmp_path / "native", llama(), tokenizer), out, dtype=dtype, check=True)
    assert 0 < report["max_abs_diff"] <= DTYPES[dtype].tolerance
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == DTYPES[dtype].tensor_type
    assert types["blk.0.attn_norm.weight"] == "F32"  # norms stay f32


def test_gpt2_f32_loads_back_with_the_same_logits(tmp_path, tokenizer):
    model = gpt2()
    out = tmp_path / "gpt2.gguf"
    report = export_gguf(native_folder(tmp_path / "native", model, tokenizer), out, check=True)
    assert report["max_abs_diff"] <= 1e-5
    assert report["greedy_tokens"]["gguf"] == report["greedy_tokens"]["native"]
    # transformers 5.23 reads gpt2.context_length into no GPT2Config field: the check passes n_positions itself
    assert report["passed_to_transformers_loader"] == {"n_positions": 64}
    reader = gguf.GGUFReader(out)
    assert int(reader.fields["gpt2.context_length"].parts[-1][0]) == 64
    with torch.no_grad():
        expected = model(IDS).logits
    assert (loaded_logits(out, IDS, n_positions=64) - expected).abs().max() <= 1e-5


def test_gpt2_q8_0_stays_within_its_tolerance(tmp_path, tokenizer):
    report = export_gguf(
        native_folder(tmp_path / "native", gpt2(n_positions=1024), tokenizer),
        tmp_path / "gpt2.gguf",
        dtype="q8_0",
        check=True,
    )
    assert 0 < report["max_abs_diff"] <= DTYPES["q8_0"].tolerance
    assert "passed_to_transformers_loader" not in report


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # the decoder presets' export: sequential residual, tied, biases everywhere
        {"use_parallel_residual": True, "attention_bias": False, "tie_word_embeddings": False},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ],
    ids=["presets", "parallel-no-attention-bias-untied", "partial-rotary"],
)
def test_gpt_neox_f32_reads_back_with_the_same_logits_tokens_and_tokenizer(tmp_path, tokenizer, overrides):
    model = gpt_neox(**overrides)
    out = tmp_path / "neox.gguf"
    report = export_gguf(native_folder(tmp_path / "native", model, tokenizer), out, check=True)
    assert report["architecture"] == "gptneox" and "coreformer's reader" in report["read_back_with"]
    assert report["max_abs_diff"] <= 1e-5 and report["tokenizer"]["mismatched"] == []
    assert report["greedy_tokens"]["gguf"] == report["greedy_tokens"]["native"]
    assert report["check"]["tokens_equal"] is True and report["check"]["tokenizer_equal"] is True
    reader = gguf.GGUFReader(out)
    fields = {key: reader.fields[key].contents() for key in reader.fields if key.startswith("gptneox.")}
    config = model.config
    rotary = int(config.rope_parameters.get("partial_rotary_factor", 1.0) * 16)
    assert fields["gptneox.rope.dimension_count"] == rotary
    assert fields["gptneox.use_parallel_residual"] == config.use_parallel_residual
    assert fields["gptneox.rope.freq_base"] == config.rope_parameters["rope_theta"]
    assert fields["gptneox.context_length"] == 64 and fields["gptneox.block_count"] == 2
    names = {tensor.name for tensor in reader.tensors}
    # llama.cpp's gptneox requires output and the attention biases whatever the model has
    assert {"output.weight", "blk.1.attn_qkv.bias", "blk.1.attn_output.bias"} <= names


def test_gpt_neox_qkv_is_stored_as_llama_cpp_reads_it(tmp_path, tokenizer):
    # llama.cpp's gptneox graph views q, k and v as the first, second and third `hidden` rows of attn_qkv; the
    # native tensor interleaves them per head. Checked here against the native q/k/v rows directly, not through
    # the reader the export's check uses.
    model = gpt_neox()
    out = tmp_path / "neox.gguf"
    export_gguf(native_folder(tmp_path / "native", model, tokenizer), out)
    stored = {tensor.name: np.array(tensor.data) for tensor in gguf.GGUFReader(out).tensors}
    fused = model.gpt_neox.layers[0].attention.query_key_value
    per_head = fused.weight.detach().reshape(4, 3, 16, 64)  # (heads, q/k/v, head_dim, hidden)
    bias = fused.bias.detach().reshape(4, 3, 16)
    for index in range(3):
        rows = slice(64 * index, 64 * (index + 1))
        assert np.array_equal(stored["blk.0.attn_qkv.weight"][rows], per_head[:, index].reshape(64, 64).numpy())
        assert np.array_equal(stored["blk.0.attn_qkv.bias"][rows], bias[:, index].reshape(64).numpy())
    # tied: output is the embedding, written as llama.cpp requires it
    assert np.array_equal(stored["output.weight"], stored["token_embd.weight"])


def test_gpt_neox_q8_0_stays_within_its_tolerance(tmp_path, tokenizer):
    out = tmp_path / "neox.gguf"
    report = export_gguf(
        native_folder(tmp_path / "native", gpt_neox(initializer_range=0.02), tokenizer), out, dtype="q8_0", check=True
    )
    assert 0 < report["max_abs_diff"] <= DTYPES["q8_0"].tolerance
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_qkv.weight"] == "Q8_0" and types["blk.0.attn_qkv.bias"] == "F32"


def test_gpt_neox_with_erf_gelu_is_refused_naming_the_field(tmp_path, tokenizer):
    folder = native_folder(tmp_path / "native", gpt_neox(hidden_act="gelu"), tokenizer)
    with pytest.raises(ValueError, match=r"hidden_act='gelu' \(llama.cpp's gptneox computes the tanh GELU"):
        export_gguf(folder, tmp_path / "out.gguf")


def test_a_failed_check_raises_the_export_check_error_and_writes_nothing(tmp_path, tokenizer, monkeypatch):
    import coreformer.export.gguf as gguf_export

    monkeypatch.setattr(gguf_export, "max_abs_difference", lambda reference, found: 0.5)
    # the allowed difference is the f32 tolerance times the logits' largest magnitude (above 1)
    with pytest.raises(ExportCheckError, match=r"logits differ by 0.5 \(> \d\.\d+e-05\)"):
        export_gguf(native_folder(tmp_path / "native", gpt_neox(), tokenizer), tmp_path / "out.gguf", check=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["native"]


def test_a_bert_folder_is_refused_naming_what_exports(tmp_path):
    BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="holds a BertModel .* takes LlamaForCausalLM, GPT2LMHeadModel, GPTNeoXFor"):
        export_gguf(tmp_path / "bert", tmp_path / "out.gguf")


def test_a_coreformer_folder_is_refused_pointing_at_the_export_command(tmp_path):
    tiny_model(cf.CoreformerDecoderForCausalLM, "decoder").save_pretrained(tmp_path / "coreformer")
    with pytest.raises(ValueError, match="--to gguf`, which writes the native model first"):
        export_gguf(tmp_path / "coreformer", tmp_path / "out.gguf")


def test_llama_with_attention_biases_is_refused_naming_the_field(tmp_path, tokenizer):
    folder = native_folder(tmp_path / "native", llama(attention_bias=True), tokenizer)
    with pytest.raises(ValueError, match="attention_bias=True"):
        export_gguf(folder, tmp_path / "out.gguf")


def test_gpt2_with_a_custom_inner_size_is_refused_naming_the_field(tmp_path, tokenizer):
    folder = native_folder(tmp_path / "native", gpt2(n_inner=96), tokenizer)
    with pytest.raises(ValueError, match="n_inner=96"):
        export_gguf(folder, tmp_path / "out.gguf")


def test_a_wordpiece_tokenizer_is_refused_naming_it(tmp_path):
    wordpiece = train_tokenizer("encoder", TEXTS * 20, vocab_size=80)
    folder = native_folder(tmp_path / "native", llama(), wordpiece)
    with pytest.raises(ValueError, match="tokenizer is WordPiece"):
        export_gguf(folder, tmp_path / "out.gguf")


def test_a_folder_without_tokenizer_is_refused(tmp_path):
    llama().save_pretrained(tmp_path / "native")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        export_gguf(tmp_path / "native", tmp_path / "out.gguf")


def test_an_unknown_dtype_is_refused_naming_the_choices(tmp_path, tokenizer):
    folder = native_folder(tmp_path / "native", llama(), tokenizer)
    with pytest.raises(ValueError, match="choose f32, f16, bf16, q8_0"):
        export_gguf(folder, tmp_path / "out.gguf", dtype="q4_k")


def test_a_refused_export_leaves_the_previous_file_and_no_partial(tmp_path, tokenizer):
    folder = native_folder(tmp_path / "native", llama(), tokenizer)
    out = tmp_path / "model.gguf"
    export_gguf(folder, out)
    before = out.read_bytes()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        export_gguf(folder, out)
    assert out.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.gguf", "native"]
