"""Tests of export/exporters.py (the writing direction of coreformer.native) and `coreformer export`: every target and
head round-trips through plain transformers in a fresh process without coreformer (logits and greedy tokens), export ->
convert is the identity, every refusal names the fields that differ, and the command line's exit codes and messages.

One fresh process checks every exported folder of the module (`exported` fixture), so the file stays quick.
"""

import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import MODERNBERT
from tiny import PAD, tiny_model
from transformers import AutoTokenizer

import coreformer as cf
import coreformer_cli as cli
from coreformer.export import CheckJob, CheckResult, check_exported, choose_target, export_to, to_native
from coreformer.export import exporters as export_module
from coreformer.export.exporters import gguf_path
from coreformer.modeling_base import CoreformerPreTrainedModel
from coreformer.native.conversion import convert_from_hf
from coreformer_settings.exports import CHECK_TOLERANCE, EXPORT_FORMATS, GGUF_DTYPES, RUN_EXPORT_FORMATS

LLAMA = dict(
    position_embedding_type="rotary",
    norm_type="rmsnorm",
    norm_position="pre",
    hidden_act="silu",
    gated_mlp=True,
    num_key_value_heads=2,
    attention_bias=False,
    mlp_bias=False,
    rope_theta=500.0,
)
# DeepSeek-V3's latent attention in miniature (every size explicit, as a DeepSeek-V3 config states them)
DEEPSEEK_LATENTS = dict(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=6)
# Wider init than 0.02 so that tiny random decoders generate varied tokens, not one repeated id.
WIDE = dict(initializer_range=0.2)
TARGETS = {
    "gpt2": ("decoder", dict(WIDE)),
    "llama": ("decoder", dict(LLAMA, **WIDE)),
    "llama-biases": ("decoder", dict(LLAMA, attention_bias=True, mlp_bias=True, **WIDE)),
    "mistral": ("decoder", dict(LLAMA, layer_types=["sliding", "sliding"], sliding_window=3, **WIDE)),
    "qwen2": ("decoder", dict(LLAMA, layer_types=["sliding", "full"], sliding_window=3, **WIDE)),
    "diffllama": ("decoder", dict(LLAMA, layer_types=["differential", "differential"], **WIDE)),
    "deepseek-v3": (
        "decoder",
        dict(LLAMA, layer_types=["mla", "mla"], num_key_value_heads=4, **DEEPSEEK_LATENTS, **WIDE),
    ),
    # Qwen3-Next's dense configuration: Gated DeltaNet beside a gated, QK-normed full layer rotating half its heads
    # (every size explicit, as a Qwen3-Next config states them)
    "qwen3-next": (
        "decoder",
        dict(
            LLAMA,
            layer_types=["gated_deltanet", "full"],
            attention_gate="elementwise",
            qk_norm=True,
            partial_rotary_factor=0.5,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            layer_norm_eps=1e-6,
            **WIDE,
        ),
    ),  # fmt: skip
    # A GPT-2 block with rotary positions (the decoder presets); GPT-NeoX's attention biases are optional.
    "gpt-neox": ("decoder", dict(position_embedding_type="rotary", rope_theta=500.0, **WIDE)),
    "gpt-neox-no-attention-bias": (  # and Pythia's partial rotary
        "decoder",
        dict(position_embedding_type="rotary", attention_bias=False, partial_rotary_factor=0.25, **WIDE),
    ),
    "bert": ("encoder", {}),
    "roberta": ("encoder", dict(position_offset=PAD + 1, type_vocab_size=1, max_position_embeddings=62)),
    # rotary GeGLU pre-norm, no first attention norm, global/local layers with a rope theta each, head transforms
    "modernbert": ("encoder", dict(MODERNBERT, classifier_pooling="mean")),
    "modernbert-cls": ("encoder", MODERNBERT),  # classifier_pooling None: the encoder's "cls"
    "bart": ("seq2seq", dict(position_offset=2, **WIDE)),
    "bart-offset-0": ("seq2seq", dict(WIDE)),  # coreformer's default: BART's table gets two unread rows in front
}
NATIVE_PREFIX = {
    "gpt2": "GPT2",
    "llama": "Llama",
    "llama-biases": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "diffllama": "DiffLlama",
    "deepseek-v3": "DeepseekV3",
    "qwen3-next": "Qwen3Next",
    "gpt-neox": "GPTNeoX",
    "gpt-neox-no-attention-bias": "GPTNeoX",
    "bert": "Bert",
    "roberta": "Roberta",
    "modernbert": "ModernBert",
    "modernbert-cls": "ModernBert",
    "bart": "Bart",
    "bart-offset-0": "Bart",
}
DECODER_HEADS = [
    cf.CoreformerDecoderModel,
    cf.CoreformerDecoderForCausalLM,
    cf.CoreformerDecoderForSequenceClassification,
    cf.CoreformerDecoderForTokenClassification,
]
ENCODER_HEADS = [
    cf.CoreformerEncoderModel,
    cf.CoreformerEncoderForMaskedLM,
    cf.CoreformerEncoderForSequenceClassification,
    cf.CoreformerEncoderForTokenClassification,
    cf.CoreformerEncoderForQuestionAnswering,
    cf.CoreformerEncoderForMultipleChoice,
]
SEQ2SEQ_HEADS = [
    cf.CoreformerSeq2SeqModel,
    cf.CoreformerSeq2SeqForConditionalGeneration,
    cf.CoreformerSeq2SeqForSequenceClassification,
]
HEADS = {"decoder": DECODER_HEADS, "encoder": ENCODER_HEADS, "seq2seq": SEQ2SEQ_HEADS}
# Every head of GPT-2, Llama, GPT-NeoX, BERT, RoBERTa, ModernBERT and BART; the variants with their generative head
# and a classifier.
CASES = [
    (target, head)
    for target, (family, _) in TARGETS.items()
    for head in HEADS[family]
    if target in ("gpt2", "llama", "gpt-neox", "bert", "roberta", "modernbert", "bart")
    or head.__name__.endswith(("ForCausalLM", "ForConditionalGeneration", "ForSequenceClassification"))
]
CASE_IDS = [f"{target}-{head.__name__.removeprefix('Coreformer')}" for target, head in CASES]


def build(target: str, head: type) -> CoreformerPreTrainedModel:
    family, overrides = TARGETS[target]
    fields = dict(overrides, num_labels=2 if head is cf.CoreformerEncoderForQuestionAnswering else 3)
    model = tiny_model(head, family, seed=1, **fields)
    if getattr(model, "final_logits_bias", None) is not None:
        torch.nn.init.normal_(model.final_logits_bias)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[CoreformerPreTrainedModel, Path, CheckResult]]:
    """Every case exported with `to_native` and saved, then checked in ONE fresh process without coreformer."""
    root = tmp_path_factory.mktemp("exported")
    models, folders = {}, {}
    for (target, head), case in zip(CASES, CASE_IDS):
        models[case] = build(target, head)
        folders[case] = root / case
        to_native(models[case]).save_pretrained(folders[case])
    results = check_exported([CheckJob(folders[case], models[case]) for case in CASE_IDS])
    return {case: (models[case], folders[case], result) for case, result in zip(CASE_IDS, results)}


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize(("target", "head"), CASES, ids=CASE_IDS)
def test_export_loads_in_plain_transformers_with_the_same_logits_and_greedy_tokens(exported, target, head):
    model, folder, result = exported[f"{target}-{head.__name__.removeprefix('Coreformer')}"]
    suffix = re.sub(r"^Coreformer(Encoder|Decoder|Seq2Seq)", "", head.__name__)  # "Model", "ForMaskedLM", ...
    expected = "GPT2LMHeadModel" if (target, suffix) == ("gpt2", "ForCausalLM") else NATIVE_PREFIX[target] + suffix
    assert result.native_class == expected
    assert result.differences, "no output was compared"
    assert result.worst <= CHECK_TOLERANCE, result.differences
    if model.can_generate():
        assert result.tokens_equal is True
    else:
        assert result.tokens_equal is None
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and config["architectures"] == [expected]
    assert not any(path.suffix == ".py" for path in folder.iterdir())  # nothing for trust_remote_code to run
    if target.startswith("gpt-neox"):  # also the pre-v5 rotary names, which llama.cpp's converter reads
        partial = model.config.partial_rotary_factor
        assert config["use_parallel_residual"] is False
        assert config["rope_parameters"]["partial_rotary_factor"] == partial
        assert (config["rotary_pct"], config["rotary_emb_base"]) == (partial, model.config.rope_theta)


@pytest.mark.parametrize(("target", "head"), CASES, ids=CASE_IDS)
def test_export_then_convert_is_the_identity(target, head):
    model = build(target, head)
    native = to_native(model)
    back = convert_from_hf(native)
    assert type(back) is type(model)
    ours, again = model.state_dict(), back.state_dict()
    if target == "bart-offset-0":  # the same function in BART's layout: two unread rows in front of each table
        for name in [name for name in ours if name.endswith("embed_positions.weight")]:
            assert not again[name][:2].any()
            again[name] = again[name][2:]
        assert back.config.position_offset == 2
    if target == "modernbert-cls":  # ModernBERT names its pooling: the encoder's default comes back by name
        assert (model.config.classifier_pooling, back.config.classifier_pooling) == (None, "cls")
        back.config.classifier_pooling = None
    if head is cf.CoreformerSeq2SeqForConditionalGeneration and "final_logits_bias" not in ours:
        assert not again.pop("final_logits_bias").any()  # BART always has one: written as zeros
    assert set(again) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(again[name], tensor), name
    # Every field that changes what the network computes comes back (dropout and init are training-only).
    skipped = {"hidden_dropout", "attention_dropout", "classifier_dropout", "initializer_range"}
    skipped |= {"classifier_dropout_before_dense", "final_logits_bias", "position_offset", "transformers_version"}
    skipped |= {"architectures", "dtype", "use_cache", "max_position_embeddings", "_name_or_path"}
    ours_config, back_config = model.config.to_dict(), back.config.to_dict()
    differing = {k for k in ours_config.keys() | back_config.keys() if ours_config.get(k) != back_config.get(k)}
    assert differing <= skipped, {k: (ours_config.get(k), back_config.get(k)) for k in differing - skipped}
    if target != "bart-offset-0":
        assert back.config.max_position_embeddings == model.config.max_position_embeddings
        assert back.config.position_offset == model.config.position_offset


# Refusals: one per reason, each naming the differing fields (and the nearest native class).
REFUSALS = {
    "strided layers in a rotary GPT-2 block": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(position_embedding_type="rotary", layer_types=["strided", "full"], stride=2),
        "GPTNeoXForCausalLM",
        ["layer_types=['strided', 'full']"],
    ),
    "grouped-query attention in a rotary GPT-2 block": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(position_embedding_type="rotary", num_key_value_heads=2),
        "GPTNeoXForCausalLM",
        ["num_key_value_heads=2 (GPT-NeoX has no GQA)"],
    ),
    "a rotary GPT-2 block without MLP biases": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(position_embedding_type="rotary", mlp_bias=False),
        "GPTNeoXForCausalLM",
        ["mlp_bias=False (GPT-NeoX has MLP biases)"],
    ),
    "grouped-query attention with learned positions": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(num_key_value_heads=2),
        "GPT2LMHeadModel",
        ["num_key_value_heads=2"],
    ),
    "strided layers": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(LLAMA, layer_types=["strided", "full"], stride=2),
        "LlamaForCausalLM",
        ["layer_types=['strided', 'full']"],
    ),
    "sliding layers with biases": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(LLAMA, attention_bias=True, mlp_bias=True, layer_types=["sliding", "sliding"], sliding_window=3),
        "LlamaForCausalLM",  # one difference; Mistral and Qwen2 would need two
        ["layer_types=['sliding', 'sliding']"],
    ),
    "a biased LM head": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(lm_head_bias=True),
        "GPT2LMHeadModel",
        ["lm_head_bias=True"],
    ),
    "a dense sequence classifier on a decoder": (
        cf.CoreformerDecoderForSequenceClassification,
        "decoder",
        dict(classifier_dense=True, classifier_bias=True),
        "GPT2ForSequenceClassification",
        ["classifier_dense=True", "classifier_bias=True"],
    ),
    "sinusoidal positions in an encoder": (
        cf.CoreformerEncoderForMaskedLM,
        "encoder",
        dict(position_embedding_type="sinusoidal"),
        "BertForMaskedLM",
        ["position_embedding_type='sinusoidal'"],
    ),
    # Near misses of ModernBERT: each names the one field that keeps it from ModernBERT's function.
    "a ModernBERT-shaped encoder with its first attention norm": (
        cf.CoreformerEncoderForMaskedLM,
        "encoder",
        dict(MODERNBERT, first_layer_attention_norm=True),
        "ModernBertForMaskedLM",
        ["first_layer_attention_norm=True (ModernBERT's first layer has no attention norm)"],
    ),
    "a ModernBERT-shaped encoder with grouped-query attention": (
        cf.CoreformerEncoderForMaskedLM,
        "encoder",
        dict(MODERNBERT, num_key_value_heads=2),
        "ModernBertForMaskedLM",
        ["num_key_value_heads=2 (ModernBERT has no GQA)"],
    ),
    "a ModernBERT-shaped encoder with strided layers": (
        cf.CoreformerEncoderModel,
        "encoder",
        dict(MODERNBERT, layer_types=["full", "strided", "sliding", "full"], stride=2),
        "ModernBertModel",
        ["layer_types=['full', 'strided', 'sliding', 'full']"],
    ),
    "a ModernBERT-shaped classifier pooling the last token": (
        cf.CoreformerEncoderForSequenceClassification,
        "encoder",
        dict(MODERNBERT, classifier_pooling="last"),
        "ModernBertForSequenceClassification",
        ["classifier_pooling='last' (ModernBERT pools 'cls' or 'mean')"],
    ),
    "a ModernBERT-shaped classifier without the prediction head": (
        cf.CoreformerEncoderForTokenClassification,
        "encoder",
        dict(MODERNBERT, classifier_transform=False),
        "ModernBertForTokenClassification",
        ["classifier_transform=False"],
    ),
    # The options only ModernBERT has keep every other target away.
    "BERT without LayerNorm biases": (
        cf.CoreformerEncoderForMaskedLM,
        "encoder",
        dict(norm_bias=False),
        "BertForMaskedLM",
        ["norm_bias=False (BERT's LayerNorms have biases)"],
    ),
    "sliding layers with their own rope theta": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(LLAMA, layer_types=["sliding", "full"], sliding_window=3, local_rope_theta=10.0),
        "Qwen2ForCausalLM",
        ["local_rope_theta=10.0 (Qwen2 has one rope_theta for every layer)"],
    ),
    "a decoder classifier pooling the first token": (
        cf.CoreformerDecoderForSequenceClassification,
        "decoder",
        dict(classifier_pooling="cls"),
        "GPT2ForSequenceClassification",
        ["classifier_pooling='cls'"],
    ),
    "a token classifier with a head transform": (
        cf.CoreformerEncoderForTokenClassification,
        "encoder",
        dict(classifier_transform=True),
        "BertForTokenClassification",
        ["classifier_transform=True"],
    ),
    # The attention options of the core no registered architecture has (Qwen3-Next's gate and QK-norm, GPT-OSS's sinks)
    "a Llama-shaped decoder with attention sinks": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(LLAMA, attention_sinks=True),
        "LlamaForCausalLM",
        ["attention_sinks=True (llama has no attention sinks)"],
    ),
    # with a gate per channel it is Qwen3-Next with full layers only; a gate per head has no native twin
    "a Llama-shaped decoder with a gate per head and QK-norm": (
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        dict(LLAMA, attention_gate="headwise", qk_norm=True),
        "Qwen3NextForCausalLM",
        ["attention_gate='headwise' (Qwen3-Next gates every attention channel)"],
    ),
    "BART with another norm epsilon": (
        cf.CoreformerSeq2SeqForConditionalGeneration,
        "seq2seq",
        dict(layer_norm_eps=1e-12),
        "BartForConditionalGeneration",
        ["layer_norm_eps=1e-12"],
    ),
}


@pytest.mark.parametrize("reason", list(REFUSALS))
def test_a_configuration_no_native_architecture_computes_is_refused_naming_the_fields(reason):
    head, family, overrides, closest, named = REFUSALS[reason]
    model = tiny_model(head, family, **overrides)
    with pytest.raises(ValueError) as raised:
        to_native(model)
    message = str(raised.value)
    assert f"closest native architecture is {closest}" in message, message
    for text in named:
        assert text in message, message
    assert message.count("\n") == 0  # one line


def test_the_first_matching_target_is_chosen():
    plain = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", **LLAMA)
    assert choose_target(plain.config, "CoreformerDecoderForCausalLM")[1] == "LlamaForCausalLM"
    sliding = tiny_model(
        cf.CoreformerDecoderForCausalLM, "decoder", **LLAMA, layer_types=["sliding", "sliding"], sliding_window=3
    )
    assert choose_target(sliding.config, "CoreformerDecoderForCausalLM")[1] == "MistralForCausalLM"
    # Learned positions stay GPT-2's, rotary ones in the same block go to GPT-NeoX.
    plain_decoder = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder")
    assert choose_target(plain_decoder.config, "CoreformerDecoderForCausalLM")[1] == "GPT2LMHeadModel"
    rotary = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", position_embedding_type="rotary")
    assert choose_target(rotary.config, "CoreformerDecoderForCausalLM")[1] == "GPTNeoXForCausalLM"


@pytest.mark.parametrize(
    "family, preset, target",
    [
        ("decoder", "tiny", "LlamaForCausalLM"),
        ("decoder", "small", "LlamaForCausalLM"),
        ("decoder", "base", "LlamaForCausalLM"),
        ("encoder", "small", "ModernBertForMaskedLM"),
        ("encoder", "base", "ModernBertForMaskedLM"),
    ],
)
def test_the_default_presets_have_a_native_twin(saved_decoder, family, preset, target):
    """The Quickstart model (decoder-tiny) and the default presets, built as pretraining builds them, export to a
    native architecture (the tiny encoder's logits are checked in test_recipe_presets)."""
    from coreformer.training.pretraining.inputs import build_model_config
    from coreformer.training.pretraining.run import resolve_arguments

    args = resolve_arguments(family=family, preset=preset)
    config = build_model_config(args, AutoTokenizer.from_pretrained(saved_decoder))
    head = "CoreformerDecoderForCausalLM" if family == "decoder" else "CoreformerEncoderForMaskedLM"
    assert choose_target(config, head)[1] == target
    if preset != "tiny":
        return  # the larger presets' weights are too many to build here for one more equal comparison
    torch.manual_seed(0)
    model = cf.CoreformerDecoderForCausalLM(config).eval()
    native = to_native(model)
    ids = torch.randint(5, config.vocab_size, (2, 17))
    with torch.no_grad():
        assert (native(ids).logits - model(ids).logits).abs().max().item() <= CHECK_TOLERANCE


# ---------------------------------------------------------------------------------------------------------------------
# Folders and the command line
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_decoder(tmp_path_factory) -> Path:
    """A tiny GPT-2-shaped coreformer decoder with a trained tokenizer and a card (test_publish's builder)."""
    from test_publish import build_folder

    folder = tmp_path_factory.mktemp("saved") / "tiny-decoder"
    build_folder("decoder", folder)
    return folder


@pytest.mark.slow
def test_cli_export_with_check_writes_a_native_folder(saved_decoder, tmp_path, capsys):
    out = tmp_path / "native"
    assert cli.main(["export", str(saved_decoder), str(out), "--check"]) == 0
    printed = capsys.readouterr().out
    difference = float(printed.split("max abs difference: ")[1].split()[0])
    assert difference <= CHECK_TOLERANCE
    assert "greedy tokens equal: True" in printed and "GPT2LMHeadModel" in printed
    names = {path.name for path in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and "auto_map" not in config
    card = cf.hub.model_card.validate_model_card(out / "README.md")
    assert str(saved_decoder) in card.text and cf.__version__ in card.text and "max abs difference" in card.text
    assert "custom_code" not in card.data.tags
    assert f'AutoModelForCausalLM.from_pretrained("{out}")' in card.text  # the exported folder, not the source


def test_the_command_line_offers_exactly_the_registered_exporters():
    import coreformer_cli
    from coreformer.export.gguf import DTYPES

    parser = coreformer_cli.COMMANDS["export"].build_parser()
    choices = {action.dest: tuple(action.choices) for action in parser._actions if action.choices is not None}
    assert tuple(export_module.EXPORTERS) == EXPORT_FORMATS == choices["to"]
    assert tuple(DTYPES) == GGUF_DTYPES == choices["gguf_dtype"]
    assert set(RUN_EXPORT_FORMATS) <= set(EXPORT_FORMATS)


@pytest.mark.slow
def test_check_of_a_bf16_folder_compares_in_fp32(tmp_path):
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", **LLAMA, **WIDE).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    summary = export_to(tmp_path / "bf16", tmp_path / "out", check=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert summary["check"]["max_abs_difference"] <= CHECK_TOLERANCE and summary["check"]["tokens_equal"]


def test_cli_refusal_is_one_line_with_exit_code_2_and_nothing_written(tmp_path, capsys):
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", num_key_value_heads=2)
    model.save_pretrained(tmp_path / "gqa")
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "gqa"), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("coreformer export: error: cannot export CoreformerDecoderForCausalLM")
    assert "num_key_value_heads=2" in error and error.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_cli_missing_folder_is_the_usual_error(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_cli_non_empty_out_needs_overwrite(saved_decoder, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(["export", str(saved_decoder), str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert cli.main(["export", str(saved_decoder), str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_cli_failed_check_exits_1_and_writes_nothing(saved_decoder, tmp_path, capsys, monkeypatch):
    def off_by_one_tenth(jobs):
        return [CheckResult("GPT2LMHeadModel", {"logits": 0.1}, True, True) for _ in jobs]

    monkeypatch.setattr(export_module, "check_exported", off_by_one_tenth)
    assert cli.main(["export", str(saved_decoder), str(tmp_path / "out"), "--check"]) == 1
    assert "check failed: max abs difference 0.1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_exports_a_modernbert_shaped_encoder_with_check(tmp_path, capsys):
    """`coreformer export FOLDER OUT --to native --check` for a saved ModernBERT-shaped MLM with its tokenizer."""
    from test_publish import CORPUS

    from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer

    tokenizer = train_tokenizer("encoder", CORPUS, vocab_size=300)
    config = cf.CoreformerEncoderConfig(
        **token_config_kwargs(tokenizer, "encoder"),
        **dict(MODERNBERT, hidden_size=32, num_attention_heads=4, intermediate_size=48, hidden_dropout=0.0),
    )
    torch.manual_seed(0)
    folder, out = tmp_path / "modernbert-shaped", tmp_path / "native"
    cf.CoreformerEncoderForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert cli.main(["export", str(folder), str(out), "--to", "native", "--check"]) == 0
    printed = capsys.readouterr().out
    assert float(printed.split("max abs difference: ")[1].split()[0]) <= CHECK_TOLERANCE
    assert "ModernBertForMaskedLM" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "modernbert" and "auto_map" not in config
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert config["local_attention"] == 2 * MODERNBERT["sliding_window"]
    assert {"model.safetensors", "README.md", "tokenizer.json"} <= {path.name for path in out.iterdir()}
    assert not any(path.suffix == ".py" for path in out.iterdir())
    card = cf.hub.model_card.validate_model_card(out / "README.md")
    assert "ModernBertForMaskedLM" in card.text and "modernbert" in card.data.tags


def test_onnx_and_gguf_dispatch_to_the_serve_functions(saved_decoder, tmp_path, monkeypatch):
    calls = []

    def export_onnx(source: Path, out: Path, *, check: bool = False, label: str | None = None) -> dict:
        calls.append(("onnx", source, out, check, label))
        return {"out": str(out)}

    def export_gguf(native_folder: Path, out: Path, *, dtype: str = "f32", check: bool = False, label=None) -> dict:
        config = json.loads((native_folder / "config.json").read_text())
        calls.append(("gguf", config["architectures"], out, dtype, check, label))
        return {"out": str(out)}

    monkeypatch.setitem(sys.modules, "coreformer.export.onnx", types.SimpleNamespace(export_onnx=export_onnx))
    monkeypatch.setitem(sys.modules, "coreformer.export.gguf", types.SimpleNamespace(export_gguf=export_gguf))
    export_to(saved_decoder, tmp_path / "onnx", to="onnx", check=True)
    export_to(saved_decoder, tmp_path / "gguf", to="gguf", gguf_dtype="f16")
    assert calls == [
        ("onnx", saved_decoder, tmp_path / "onnx", True, str(saved_decoder)),
        ("gguf", ["GPT2LMHeadModel"], tmp_path / "gguf" / "model-f16.gguf", "f16", False, str(saved_decoder)),
    ]
    assert gguf_path(tmp_path / "model.gguf", "q8_0") == tmp_path / "model.gguf"
    assert not list((tmp_path / "gguf").iterdir())  # the temporary native export is gone


@pytest.mark.slow
def test_cli_exports_gguf_through_the_real_exporter(saved_decoder, tmp_path, capsys):
    # The dispatch test above uses stand-ins; this one runs the real GGUF writer and its check end to end, on a
    # Llama-shaped decoder with the saved decoder's trained tokenizer (the real ONNX exporter's run of the command:
    # tests/export/test_onnx.py).
    llama = tmp_path / "llama"
    config = cf.CoreformerDecoderConfig.from_pretrained(saved_decoder, **LLAMA, **WIDE)
    torch.manual_seed(0)
    cf.CoreformerDecoderForCausalLM(config).save_pretrained(llama)
    AutoTokenizer.from_pretrained(saved_decoder).save_pretrained(llama)
    gguf_file = tmp_path / "tiny.gguf"
    command = ["export", str(llama), str(gguf_file), "--to", "gguf", "--gguf-dtype", "f16", "--check"]
    assert cli.main(command) == 0
    assert "max abs difference: " in capsys.readouterr().out
    assert gguf_file.is_file() and gguf_file.stat().st_size > 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["llama", "tiny.gguf"]  # no temporary left


def _decoder_tiny_folder(saved_decoder: Path, folder: Path, **overrides) -> Path:
    """A model of the decoder-tiny preset's block (shrunk: 2 layers x 32), with the saved decoder's tokenizer."""
    config = cf.CoreformerDecoderConfig.from_pretrained(saved_decoder, position_embedding_type="rotary", **overrides)
    assert choose_target(config, "CoreformerDecoderForCausalLM")[1] == "GPTNeoXForCausalLM"
    torch.manual_seed(0)
    cf.CoreformerDecoderForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(saved_decoder).save_pretrained(folder)
    return folder


def test_the_decoder_presets_reach_gguf_as_gpt_neox_with_the_check_printed(saved_decoder, tmp_path, capsys):
    """The Quickstart model exports as GPT-NeoX, which llama.cpp runs as its gptneox architecture."""
    pytest.importorskip("gguf", reason="the gguf package writes GGUF files (pip install gguf)")
    folder = _decoder_tiny_folder(saved_decoder, tmp_path / "rotary", **WIDE)
    out = tmp_path / "out" / "tiny.gguf"
    assert cli.main(["export", str(folder), str(out), "--to", "gguf", "--check"]) == 0
    printed = capsys.readouterr().out
    difference = float(printed.split("max abs difference: ")[1].split()[0])
    allowed = float(printed.split("(tolerance ")[1].split(")")[0])  # grows with the logits' scale above 1
    assert difference <= allowed and CHECK_TOLERANCE <= allowed
    assert "greedy tokens equal: True" in printed and "tokenizer ids equal: True" in printed
    assert f"wrote {out}" in printed
    import gguf

    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "gptneox"
    assert reader.fields["general.name"].contents() == "rotary"  # the user's folder, not the temporary export
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["tiny.gguf"]


def test_errors_name_the_folder_given_never_a_temporary_one(saved_decoder, tmp_path):
    pytest.importorskip("gguf", reason="the gguf package writes GGUF files (pip install gguf)")
    # refused by the GGUF writer after the temporary native export: the erf GELU llama.cpp does not compute
    folder = _decoder_tiny_folder(saved_decoder, tmp_path / "erf", hidden_act="gelu")
    with pytest.raises(ValueError) as refused:
        export_to(folder, tmp_path / "out.gguf", to="gguf")
    assert str(refused.value).startswith(f"{folder} (GPTNeoXForCausalLM) cannot be written as GGUF gptneox")
    assert "coreformer-native-" not in str(refused.value)
    # no tokenizer: the advice names the folder to save it in
    config = cf.CoreformerDecoderConfig.from_pretrained(saved_decoder, position_embedding_type="rotary")
    cf.CoreformerDecoderForCausalLM(config).save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'bare'))} has no tokenizer.json"):
        export_to(tmp_path / "bare", tmp_path / "out.gguf", to="gguf")
    assert not list(tmp_path.glob("**/*.gguf")) and not list(tmp_path.glob("coreformer-*"))


def test_a_native_folder_exports_like_its_coreformer_twin(saved_decoder, tmp_path, capsys):
    """`coreformer export` takes a transformers folder too: GGUF as it is, native and ONNX through its conversion."""
    pytest.importorskip("gguf", reason="the gguf package writes GGUF files (pip install gguf)")
    llama = tmp_path / "llama"
    config = cf.CoreformerDecoderConfig.from_pretrained(saved_decoder, **LLAMA, **WIDE)
    torch.manual_seed(0)
    cf.CoreformerDecoderForCausalLM(config).save_pretrained(tmp_path / "coreformer")
    AutoTokenizer.from_pretrained(saved_decoder).save_pretrained(tmp_path / "coreformer")
    export_to(tmp_path / "coreformer", llama)  # an exported Llama: a native folder
    assert cli.main(["export", str(llama), str(tmp_path / "llama.gguf"), "--to", "gguf"]) == 0
    assert "wrote " + str(tmp_path / "llama.gguf") in capsys.readouterr().out
    assert cli.main(["export", str(llama), str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert f"`{llama}`" in (tmp_path / "again" / "README.md").read_text()  # exported from the folder given


def test_a_native_encoder_folder_exports_through_its_conversion(tmp_path):
    import transformers

    config = transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48
    )
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(config).eval()
    bert.save_pretrained(tmp_path / "bert")
    assert export_to(tmp_path / "bert", tmp_path / "out")["native_class"] == "BertForMaskedLM"
    reloaded = transformers.BertForMaskedLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.tensor([[5, 9, 13, 21]])
    with torch.no_grad():
        assert (reloaded(ids).logits - bert(ids).logits).abs().max().item() <= CHECK_TOLERANCE


def test_export_to_refuses_unknown_targets(saved_decoder, tmp_path):
    with pytest.raises(ValueError, match="unknown export target 'tflite'"):
        export_to(saved_decoder, tmp_path / "out", to="tflite")


def test_export_for_a_folder_neither_coreformer_nor_read_by_it_says_so(tmp_path):
    (tmp_path / "opt").mkdir()
    (tmp_path / "opt" / "config.json").write_text(json.dumps({"architectures": ["OPTForCausalLM"]}))
    with pytest.raises(ValueError, match=r"OPTForCausalLM'\], not a coreformer model nor a native class coreformer"):
        export_to(tmp_path / "opt", tmp_path / "out")


@pytest.mark.slow
def test_check_compares_the_tokenizer_too(saved_decoder, tmp_path):
    from transformers import AutoTokenizer

    summary = export_to(saved_decoder, tmp_path / "out", check=True)
    assert summary["check"]["tokenizer_equal"] is True
    assert summary["check"]["tokens_equal"] is True
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.eos_token_id == json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"]


# ---------------------------------------------------------------------------------------------------------------------
# Training runs export at the end; publishing pushes an exported folder
# ---------------------------------------------------------------------------------------------------------------------


def _native_logits_match(run_folder: Path, auto_class: str) -> None:
    """The exported OUTPUT_DIR/native, loaded by its native class here, computes the run's model's logits."""
    import transformers

    native_folder = run_folder / "native"
    config = json.loads((native_folder / "config.json").read_text())
    assert "auto_map" not in config
    native = getattr(transformers, config["architectures"][0]).from_pretrained(native_folder).eval()
    ours = getattr(transformers, auto_class).from_pretrained(run_folder).eval()
    assert type(native).__module__.startswith("transformers.models.")
    ids = torch.tensor([[5, 9, 13, 21, 34, 55, 89]])
    with torch.no_grad():
        assert (native(ids).logits - ours(ids).logits).abs().max().item() <= CHECK_TOLERANCE


@pytest.mark.slow
def test_a_pretraining_run_with_export_native_writes_the_native_folder(tmp_path):
    from test_pretraining import tiny_args

    from coreformer.training.pretraining import run_pretraining

    args = tiny_args("decoder", tmp_path / "run", max_steps=2, eval_every=0, warmup_steps=1, export="native")
    run_pretraining(args)
    assert json.loads((tmp_path / "run" / "native" / "config.json").read_text())["model_type"] == "gpt2"
    assert (tmp_path / "run" / "native" / "tokenizer.json").is_file()
    _native_logits_match(tmp_path / "run", "AutoModelForCausalLM")


@pytest.mark.slow
def test_a_finetuning_run_with_export_native_writes_the_native_folder(saved_decoder, tmp_path):
    from test_finetuning import tiny_args

    from coreformer.training.finetuning import run_finetuning

    run_finetuning(tiny_args("sequence-classification", saved_decoder, tmp_path / "ft", max_steps=1, export="native"))
    config = json.loads((tmp_path / "ft" / "native" / "config.json").read_text())
    assert config["architectures"] == ["GPT2ForSequenceClassification"]
    _native_logits_match(tmp_path / "ft", "AutoModelForSequenceClassification")


def test_a_run_whose_model_has_no_native_architecture_says_why_and_keeps_its_model(tmp_path, capsys):
    from test_pretraining import tiny_args

    from coreformer.training.pretraining import run_pretraining

    model = dict(position_embedding_type="rotary", num_key_value_heads=2)  # GQA in a LayerNorm block: no native twin
    args = tiny_args("decoder", tmp_path / "run", max_steps=1, eval_every=0, warmup_steps=1, model=model)
    args.export = "native"
    run_pretraining(args)
    assert "--export native skipped: cannot export CoreformerDecoderForCausalLM" in capsys.readouterr().err
    assert (tmp_path / "run" / "model.safetensors").is_file() and not (tmp_path / "run" / "native").exists()


@pytest.mark.parametrize("second", ["no export", "a refused export"])
def test_a_resumed_pretraining_run_never_keeps_the_previous_native_folder(tmp_path, monkeypatch, second):
    """The second session's finish carries checkpoints and logs over from the folder, but not the first session's
    native export: it holds the first session's weights."""
    from test_pretraining import tiny_args

    from coreformer.training.pretraining import run_pretraining

    settings = dict(eval_every=0, warmup_steps=1, save_every=1)
    run_pretraining(tiny_args("decoder", tmp_path / "run", max_steps=1, export="native", **settings))
    assert (tmp_path / "run" / "native" / "config.json").is_file()
    export, refusals = None, []
    if second == "a refused export":
        export = "native"

        def refused(*args, **kwargs):
            refusals.append("refused")
            raise ValueError("cannot export (refused for this test)")

        monkeypatch.setattr(cf.export, "export_to", refused)  # where a run's --export finds it
    run_pretraining(
        tiny_args("decoder", tmp_path / "run", max_steps=2, export=export, resume_from_checkpoint="latest", **settings)
    )
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2  # the resumed session's model
    assert (tmp_path / "run" / "checkpoints").is_dir()  # what finish does carry over
    assert not (tmp_path / "run" / "native").exists()
    assert refusals == ([] if export is None else ["refused"])


@pytest.mark.slow
def test_a_finetuning_run_never_keeps_a_previous_runs_native_folder(saved_decoder, tmp_path):
    from test_finetuning import tiny_args

    from coreformer.training.finetuning import run_finetuning

    out = tmp_path / "ft"
    run_finetuning(tiny_args("sequence-classification", saved_decoder, out, max_steps=1, export="native"))
    assert (out / "native" / "config.json").is_file()
    run_finetuning(tiny_args("sequence-classification", saved_decoder, out, max_steps=1, overwrite=True))
    assert (out / "model.safetensors").is_file() and not (out / "native").exists()


@pytest.mark.slow
def test_publish_pushes_an_exported_folder_that_loads_by_id_without_coreformer(saved_decoder, tmp_path):
    import subprocess

    from hub_server import LoopbackHub
    from test_publish import hub_env, run_publish

    out = tmp_path / "work" / "tiny-native"
    export_to(saved_decoder, out)
    hub = LoopbackHub()
    hub.start()
    try:
        published = run_publish(out, "user/tiny-native", hub_env(hub, tmp_path / "publisher-home"))
        assert published.returncode == 0, published.stderr[-3000:]
        files = hub.repos["user/tiny-native"].commits[hub.repos["user/tiny-native"].branches["main"]]
        assert set(files) == {path.name for path in out.iterdir()} | {".gitattributes"}
        loader = (
            "import sys\nsys.modules['coreformer'] = None\n"
            "import torch, transformers\n"
            "model = transformers.AutoModelForCausalLM.from_pretrained('user/tiny-native').eval()\n"
            "assert type(model).__name__ == 'GPT2LMHeadModel', type(model)\n"
            "with torch.no_grad():\n"
            "    print(model(torch.tensor([[5, 9, 13]])).logits.flatten().tolist())\n"
        )
        env = hub_env(hub, tmp_path / "loader-home")
        loaded = subprocess.run(
            [sys.executable, "-c", loader], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180
        )
    finally:
        hub.stop()
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    ours = cf.CoreformerDecoderForCausalLM.from_pretrained(saved_decoder).eval()
    with torch.no_grad():
        expected = ours(torch.tensor([[5, 9, 13]])).logits.flatten()
    found = torch.tensor(json.loads(loaded.stdout.strip().splitlines()[-1]))
    assert (found - expected).abs().max().item() <= CHECK_TOLERANCE
