"""docs/guides/serving.md's table, computed from what each path decides: every layer type of the table in
`coreformer.layer_types`, asked of the function the path itself calls to accept or refuse it (continuous batching's
and vLLM's checks, the native architectures' requirements, the ONNX exporter's refusals, the GGUF writer's
architectures). The page must say exactly that; each column names the tests that run the path on every layer type.
"""

import re
from pathlib import Path

import pytest
from conftest import MODERNBERT, VARIANTS

import coreformer as cf
from coreformer.export import choose_target
from coreformer.export.gguf import ARCHITECTURES as GGUF_ARCHITECTURES
from coreformer.export.onnx import refuse_uncachable, refuse_unexportable
from coreformer.forward_plan import ForwardPlanner
from coreformer.layer_types import LAYER_TYPES
from coreformer.vllm_serving import refuse_unserved

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "serving.md"
# column -> the tests that run the path on every layer type (file::function, all of which must exist)
BACKED_BY = {
    "`generate()`": ["tests/modeling/test_layer_types.py::test_cached_decoding_equals_the_full_forward"],
    "`generate_batch()`": [
        "tests/modeling/test_continuous_batching.py::test_generate_batch_equals_per_prompt_generate",
        "tests/modeling/test_continuous_batching.py::test_generate_batch_refuses_every_other_causal_layer_type_by_name",
    ],
    "vLLM (the folder)": [
        "tests/serving/test_vllm.py::test_vllm_serves_full_and_sliding_decoders_with_generates_greedy_tokens",
        "tests/serving/test_vllm.py::test_vllm_refuses_every_other_layer_type_when_it_loads_the_folder",
    ],
    "native export": ["tests/native/test_export.py::test_a_configuration_no_native_architecture_computes_is_refused"],
    "ONNX Runtime": ["tests/export/test_onnx.py::test_linear_attention_causal_lm_is_refused_naming_the_layer_type"],
    "llama.cpp (GGUF)": ["tests/export/test_gguf.py::test_a_bert_folder_is_refused_naming_what_exports"],
    "quantized weights": [
        "tests/modeling/test_quantization.py::test_quantized_logits_stay_as_close_to_fp32_as_the_native_exports"
    ],
}
SETTINGS = dict(sliding_window=4, stride=2, block_size=4, lowrank_k=8, lsh_bucket_size=4, kv_lora_rank=8)
SHAPE = dict(vocab_size=99, hidden_size=32, num_attention_heads=4, intermediate_size=48, num_hidden_layers=2)


def causal(layer_type: str) -> bool:
    return LAYER_TYPES[layer_type].not_causal is None


def model_config(layer_type: str):
    """Every layer of `layer_type`, in a model whose other settings have a native twin: a Llama-shaped decoder, or
    (for bidirectional-only types) a ModernBERT-shaped encoder."""
    settings = {**SHAPE, **SETTINGS, "layer_types": [layer_type] * SHAPE["num_hidden_layers"]}
    if layer_type in ("lsh", "mla"):  # queries are their own keys; every head's keys expand from the latent
        settings["num_key_value_heads"] = settings["num_attention_heads"]
    if layer_type == "gated_deltanet":  # beside a full layer, gated and QK-normed as Qwen3-Next's
        settings.update(layer_types=[layer_type, "full"], attention_gate="elementwise", qk_norm=True)
    if causal(layer_type):
        llama = {**VARIANTS["rotary_rmsnorm_swiglu_gqa"], "tie_word_embeddings": False}
        return cf.CoreformerDecoderConfig(**{**llama, **settings}), "CoreformerDecoderForCausalLM"
    return cf.CoreformerEncoderConfig(**{**MODERNBERT, **settings}), "CoreformerEncoderForMaskedLM"


def verdict(decide) -> str:
    try:
        decide()
    except ValueError:
        return "refused"
    return "exact"


def computed_row(layer_type: str) -> dict[str, str]:
    config, class_name = model_config(layer_type)
    row = {"`generate()`": "exact" if causal(layer_type) else "—"}
    planner = ForwardPlanner(config, config.layer_types, is_causal=True)
    row["`generate_batch()`"] = verdict(planner.check_continuous_batching) if causal(layer_type) else "—"
    row["vLLM (the folder)"] = verdict(
        lambda: refuse_unserved(config, config.layer_types, is_causal=causal(layer_type), cross_attention=False)
    )
    row["native export"] = verdict(lambda: choose_target(config, class_name))
    onnx = verdict(lambda: refuse_unexportable(config))
    if onnx == "exact" and causal(layer_type) and verdict(lambda: refuse_uncachable(config.layer_types)) == "refused":
        onnx = "no cache"
    row["ONNX Runtime"] = onnx
    if causal(layer_type):
        gguf = row["native export"] == "exact" and choose_target(config, class_name)[1] in GGUF_ARCHITECTURES
        row["llama.cpp (GGUF)"] = "exact" if gguf else "refused"
    else:
        row["llama.cpp (GGUF)"] = "—"
    row["quantized weights"] = "as native"  # every cell of test_quantization's matrix, which covers every type
    return row


def guide_table() -> tuple[list[str], dict[str, dict[str, str]]]:
    """(the columns, {layer type: {column: cell}}) of the page's table."""
    lines = [line for line in GUIDE.read_text().splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header[1:], cells[1:], strict=True))
    return header[1:], rows


def test_the_guide_lists_every_layer_type_and_says_what_each_path_decides():
    columns, rows = guide_table()
    assert columns == list(BACKED_BY)
    assert list(rows) == list(LAYER_TYPES)
    for layer_type, cells in rows.items():
        assert cells == computed_row(layer_type), layer_type


@pytest.mark.parametrize("column", list(BACKED_BY))
def test_each_column_names_tests_that_exist(column):
    for reference in BACKED_BY[column]:
        path, function = reference.split("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {function}\w*\(", source, re.MULTILINE), reference
