"""ONNX export (coreformer.export.onnx): graphs run by onnxruntime against the PyTorch model they came from."""

import json

import numpy as np
import onnxruntime
import pytest
import torch
from conftest import MODERNBERT, VARIANTS
from tiny import padded_batch, tiny_model

import coreformer as cf
from coreformer.export.onnx import MANIFEST_NAME, export_onnx, without_eos
from coreformer.native.parity import ExportCheckError
from coreformer_settings.exports import CHECK_TOLERANCE


def session(path):
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def save(tmp_path, model, name="source"):
    folder = tmp_path / name
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def decoder_export(tmp_path_factory):
    """A rotary / RMSNorm / SwiGLU / GQA causal LM with a sliding-window, a block-diagonal, a full, a differential and
    a sigmoid layer, exported with its check (its greedy tokens decode through the cache graph)."""
    tmp_path = tmp_path_factory.mktemp("decoder")
    model = tiny_model(
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        **VARIANTS["rotary_rmsnorm_swiglu_gqa"],
        num_hidden_layers=5,
        layer_types=["sliding", "block", "full", "differential", "sigmoid"],
        sliding_window=5,
        block_size=3,
    )
    report = export_onnx(save(tmp_path, model), tmp_path / "onnx", check=True)
    return model, tmp_path / "onnx", report


@pytest.mark.slow
def test_causal_lm_exports_prefill_and_cache_graphs_that_match_pytorch(decoder_export):
    model, folder, report = decoder_export
    assert set(report["graphs"]) == {"model", "decoder_with_past"}
    assert report["graphs"]["decoder_with_past"]["inputs"][2:4] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert report["max_abs_diff"] <= CHECK_TOLERANCE
    assert report["greedy_tokens"]["onnxruntime"] == report["greedy_tokens"]["pytorch"]
    assert json.loads((folder / MANIFEST_NAME).read_text())["graphs"] == report["graphs"]
    assert {"config.json", "model.onnx", "decoder_with_past.onnx"} <= set(report["files"])


def test_causal_lm_graph_matches_the_model_at_a_new_padded_shape(decoder_export):
    # the export shape is (2, 7); here batch 3, length 12 (longer than the sliding window), left padded
    model, folder, _ = decoder_export
    ids, mask = padded_batch(batch=3, length=12, left=True)
    logits, *presents = session(folder / "model.onnx").run(
        None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    )
    with torch.no_grad():
        output = model(ids, attention_mask=mask, use_cache=True)
    real = mask.bool()
    assert np.abs(logits[real.numpy()] - output.logits[real].numpy()).max() <= CHECK_TOLERANCE
    assert len(presents) == 2 * model.config.num_hidden_layers
    assert presents[0].shape == (3, model.config.num_key_value_heads, 12, model.config.head_dim)


@pytest.mark.slow
def test_encoder_masked_lm_with_token_types_matches_pytorch(tmp_path):
    model = tiny_model(cf.CoreformerEncoderForMaskedLM, "encoder", type_vocab_size=2)
    report = export_onnx(save(tmp_path, model), tmp_path / "onnx", check=True)
    assert report["graphs"]["model"]["inputs"] == ["input_ids", "attention_mask", "token_type_ids"]
    assert report["max_abs_diff"] <= CHECK_TOLERANCE
    ids, mask = padded_batch(batch=4, length=9)
    types = torch.zeros_like(ids).masked_fill(torch.arange(9) > 4, 1)
    (logits,) = session(tmp_path / "onnx" / "model.onnx").run(
        None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": types.numpy()}
    )
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, token_type_ids=types).logits
    real = mask.bool()
    assert np.abs(logits[real.numpy()] - expected[real].numpy()).max() <= CHECK_TOLERANCE


@pytest.mark.slow
def test_seq2seq_graphs_decode_greedily_like_generate_with_and_without_the_cache(tmp_path):
    # the decoder's first layer latent attention (MLA): its cache graph carries the latents, not keys and values
    model = tiny_model(
        cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq", decoder_layer_types=["mla", "full"], kv_lora_rank=6
    )
    report = export_onnx(save(tmp_path, model), tmp_path / "onnx", check=True)
    assert set(report["graphs"]) == {"encoder_model", "decoder_model", "decoder_with_past_model"}
    assert report["max_abs_diff"] <= CHECK_TOLERANCE
    assert report["greedy_tokens"]["onnxruntime"] == report["greedy_tokens"]["pytorch"]  # through the cache graph
    ids, mask = padded_batch(batch=2, length=8)
    (hidden,) = session(tmp_path / "onnx" / "encoder_model.onnx").run(
        None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    )
    decoder = session(tmp_path / "onnx" / "decoder_model.onnx")
    target = np.full((2, 1), model.config.decoder_start_token_id, dtype=np.int64)
    for _ in range(5):  # without the cache: each step runs the whole prefix
        (logits,) = decoder.run(
            ["logits"],
            {"decoder_input_ids": target, "encoder_hidden_states": hidden, "encoder_attention_mask": mask.numpy()},
        )
        next_ids = without_eos(torch.from_numpy(logits[:, -1]), model).argmax(-1, keepdim=True)  # as min_new_tokens
        target = np.concatenate([target, next_ids.numpy()], axis=1)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert target.tolist() == expected.tolist()


# ModernBERT's options in one graph: no first attention norm, global and local layers with a rotary table each, the
# head transform, mean pooling over padded choices (one layer of each type: the export traces every layer).
MODERNBERT_MEAN = dict(MODERNBERT, classifier_pooling="mean", num_hidden_layers=2, layer_types=["full", "sliding"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_class, family, options",
    [
        (cf.CoreformerEncoderForQuestionAnswering, "encoder", {}),  # two outputs
        (cf.CoreformerEncoderForMultipleChoice, "encoder", MODERNBERT_MEAN),  # (batch, choices, sequence) inputs
        (cf.CoreformerDecoderForSequenceClassification, "decoder", {}),  # last-token pooling, no cache graph
        (cf.CoreformerSeq2SeqForSequenceClassification, "seq2seq", {}),  # eos pooling traced without data checks
    ],
    ids=["encoder-qa", "modernbert-shaped-multiple-choice", "decoder-sequence", "seq2seq-sequence"],
)
def test_other_heads_export_and_match_pytorch(tmp_path, model_class, family, options):
    model = tiny_model(model_class, family, num_labels=3, **options)
    report = export_onnx(save(tmp_path, model), tmp_path / "onnx", check=True)
    assert list(report["graphs"]) == ["model"]
    assert report["max_abs_diff"] <= CHECK_TOLERANCE


@pytest.mark.slow
def test_gated_attention_qk_norm_and_sinks_export_with_their_cache_graphs(tmp_path):
    # Qwen3-Next's and GPT-OSS's attention options, on sliding and full layers: computed in the eager form the graphs
    # hold (the sink as one more score column), greedy decoding through the cache graphs
    options = dict(attention_gate="elementwise", qk_norm=True, attention_sinks=True, sliding_window=3)
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", layer_types=["sliding", "full"], **options)
    report = export_onnx(save(tmp_path, model), tmp_path / "onnx", check=True)
    assert report["check"]["tokens_equal"] is True and report["max_abs_diff"] <= report["tolerance"]


def test_linear_attention_causal_lm_is_refused_naming_the_layer_type(tmp_path):
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", layer_types=["linear", "full"])
    with pytest.raises(ValueError, match=r"\['linear'\] attention layers, whose cache is not keys and values"):
        export_onnx(save(tmp_path, model), tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_a_native_transformers_folder_is_refused_naming_its_model_type(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="holds a 'gpt2' model, not a coreformer one"):
        export_onnx(tmp_path / "gpt2", tmp_path / "onnx")


def test_the_check_summary_says_what_export_check_prints(decoder_export):
    _, _, report = decoder_export
    check = report["check"]
    assert check["max_abs_difference"] == report["max_abs_diff"] <= check["tolerance"] == CHECK_TOLERANCE
    assert check["tokens_equal"] is True and check["tokenizer_equal"] is None


def test_a_failed_check_exits_1_naming_the_difference_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import coreformer.export.onnx as onnx_export
    import coreformer_cli as cli

    folder = save(tmp_path, tiny_model(cf.CoreformerEncoderForMaskedLM, "encoder"))
    # the graphs are not written (export is tested above): the check alone reports them 0.25 apart
    monkeypatch.setattr(onnx_export, "export_graph", lambda graph, folder: None)
    monkeypatch.setattr(onnx_export, "check_graph", lambda graph, folder: (0.25, 0.5))  # (difference, scale)
    assert cli.main(["export", str(folder), str(tmp_path / "onnx"), "--to", "onnx", "--check"]) == 1
    assert "check failed: the ONNX graphs differ from PyTorch by 0.25" in capsys.readouterr().err
    assert not (tmp_path / "onnx").exists()


@pytest.mark.slow
def test_the_command_exports_a_native_folder_through_its_conversion_with_its_tokenizer(tmp_path, capsys):
    # `coreformer export --to onnx --check` end to end: a GPT-2 folder (converted first), the check's printed lines,
    # the tokenizer beside the graphs and the manifest naming the folder the user gave.
    from test_publish import CORPUS
    from transformers import GPT2Config, GPT2LMHeadModel

    import coreformer_cli as cli
    from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer

    tokenizer = train_tokenizer("decoder", CORPUS, vocab_size=300)
    tokens = token_config_kwargs(tokenizer, "decoder")
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32, **tokens)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    assert cli.main(["export", str(tmp_path / "gpt2"), str(tmp_path / "onnx"), "--to", "onnx", "--check"]) == 0
    printed = capsys.readouterr().out
    assert float(printed.split("max abs difference: ")[1].split()[0]) <= CHECK_TOLERANCE
    assert f"(tolerance {CHECK_TOLERANCE})" in printed and "greedy tokens equal: True" in printed
    assert "tokenizer ids equal: True" in printed  # the same lines as every format's check
    written = {path.name for path in (tmp_path / "onnx").iterdir()}
    assert {"model.onnx", "decoder_with_past.onnx", "tokenizer.json", MANIFEST_NAME} <= written
    manifest = json.loads((tmp_path / "onnx" / MANIFEST_NAME).read_text())
    assert manifest["source"] == str(tmp_path / "gpt2")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpt2", "onnx"]  # no temporary conversion left


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        export_onnx(tmp_path, tmp_path / "onnx")


def test_seq2seq_classification_still_names_a_row_without_eos_outside_export():
    # the eos check is skipped only while tracing (it branches on tensor values); eager calls keep it
    model = tiny_model(cf.CoreformerSeq2SeqForSequenceClassification, "seq2seq", num_labels=3)
    ids, mask = padded_batch(batch=2, length=6)
    ids[0, -1] = model.config.eos_token_id  # row 1 has none
    with pytest.raises(ValueError, match="Every input row needs an eos token"):
        model(ids, attention_mask=mask)


def test_linear_attention_seq2seq_decoder_is_refused_naming_the_layer_type(tmp_path):
    model = tiny_model(cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq", decoder_layer_types=["full", "linear"])
    with pytest.raises(ValueError, match=r"\['linear'\] attention layers, whose cache is not keys and values"):
        export_onnx(save(tmp_path, model), tmp_path / "onnx")


def test_logits_at_a_trained_models_scale_pass_the_check_and_a_wrong_graph_fails_it(tmp_path, monkeypatch):
    """A trained model's logits reach 10-20 (the Quickstart model's 12.5), where fp32 reordering between onnxruntime
    and PyTorch alone moves them by about 1e-5: the check's tolerance grows with their scale, and a graph whose
    weights are off by 1% still fails it."""
    import coreformer.export.onnx as onnx_export

    model = tiny_model(cf.CoreformerEncoderForMaskedLM, "encoder", tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(500 / model.lm_head.weight.abs().max())  # logits of a trained model's scale
    folder = save(tmp_path, model)
    report = export_onnx(folder, tmp_path / "onnx", check=True)
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.abs().max() > 5 and report["tolerance"] > CHECK_TOLERANCE
    assert report["max_abs_diff"] <= report["tolerance"]

    export_graph = onnx_export.export_graph

    def export_a_wrong_graph(graph, graph_folder):  # every weight of the written graph 1% off
        with torch.no_grad():
            for parameter in graph.module.parameters():
                parameter.mul_(1.01)
            try:
                export_graph(graph, graph_folder)
            finally:
                for parameter in graph.module.parameters():
                    parameter.div_(1.01)

    monkeypatch.setattr(onnx_export, "export_graph", export_a_wrong_graph)
    with pytest.raises(ExportCheckError, match="check failed: the ONNX graphs differ from PyTorch"):
        export_onnx(folder, tmp_path / "wrong", check=True)
    assert not (tmp_path / "wrong").exists()
