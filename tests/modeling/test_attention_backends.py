"""Which attention code each layer runs under each backend, decided once by the stack (`layer_types.py`'s table):
sparse kernels under sdpa, the dense reference under eager, and a function registered through transformers'
`AttentionInterface` under its own name, called as in-library sliding models call it."""

import pytest
import torch
from tiny import padded_batch, tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import coreformer as cf
from coreformer.layer_types import LAYER_TYPES

WINDOW, STRIDE = 2, 3


@pytest.fixture
def recording_backend():
    """Registers "recording" (an attention function that logs each call, then runs sdpa), and with `masked=True` an
    sdpa mask function under the same name; both are removed again afterwards."""
    calls = []

    def attend(module, query, key, value, attention_mask, **kwargs):
        calls.append(
            dict(
                layer=module.layer_idx,
                cross=module.is_cross_attention,
                sliding_window=kwargs.get("sliding_window", "not passed"),
                mask=attention_mask,
            )
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def register(masked: bool) -> list[dict]:
        AttentionInterface.register("recording", attend)
        if masked:
            AttentionMaskInterface.register("recording", sdpa_mask)
        return calls

    yield register
    AttentionInterface._global_mapping.pop("recording", None)
    AttentionMaskInterface._global_mapping.pop("recording", None)


def _self_attention_calls(calls: list[dict]) -> dict[int, dict]:
    return {call["layer"]: call for call in calls if not call["cross"]}


@pytest.mark.parametrize("family", ["encoder", "decoder"])
def test_a_registered_attention_function_gets_every_layer_with_its_sliding_window(recording_backend, family):
    calls = recording_backend(masked=True)
    model_class = {"encoder": cf.CoreformerEncoderModel, "decoder": cf.CoreformerDecoderForCausalLM}[family]
    model = tiny_model(
        model_class,
        family,
        num_hidden_layers=3,
        layer_types=["full", "sliding", "strided"],
        sliding_window=WINDOW,
        stride=STRIDE,
    )
    ids, mask = padded_batch(length=12, left=family == "decoder")
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(ids, attention_mask=mask)[0]
        model.set_attn_implementation("recording")
        output = model(ids, attention_mask=mask)[0]
    by_layer = _self_attention_calls(calls)
    assert sorted(by_layer) == [0, 1, 2]
    # As Mistral/Qwen2 pass it: the window counting the query itself, None on layers that are not sliding.
    assert by_layer[1]["sliding_window"] == WINDOW + 1
    assert by_layer[0]["sliding_window"] is None and by_layer[2]["sliding_window"] is None
    real = mask.bool()
    torch.testing.assert_close(output[real], reference[real], atol=1e-5, rtol=0)


def test_a_registered_function_without_a_mask_function_gets_sliding_layers_and_refuses_strided(recording_backend):
    # How vLLM's transformers backend plugs in: no mask function, so layers get no mask and must rely on
    # `sliding_window`; a strided pattern cannot be expressed that way, which is said instead of run wrongly.
    calls = recording_backend(masked=False)
    model = tiny_model(cf.CoreformerDecoderModel, "decoder", layer_types=["full", "sliding"], sliding_window=WINDOW)
    model.set_attn_implementation("recording")
    with torch.no_grad():
        model(torch.randint(3, 50, (1, 9)))
    by_layer = _self_attention_calls(calls)
    assert sorted(by_layer) == [0, 1] and by_layer[1]["sliding_window"] == WINDOW + 1
    assert by_layer[1]["mask"] is None
    strided = tiny_model(cf.CoreformerDecoderModel, "decoder", layer_types=["full", "strided"], stride=STRIDE)
    strided.set_attn_implementation("recording")
    with pytest.raises(ValueError, match="AttentionMaskInterface.register\\('recording', sdpa_mask\\)"):
        strided(torch.randint(3, 50, (1, 9)))


def test_seq2seq_cross_attention_goes_to_the_registered_function_without_a_window(recording_backend):
    calls = recording_backend(masked=True)
    model = tiny_model(
        cf.CoreformerSeq2SeqForConditionalGeneration,
        "seq2seq",
        decoder_layer_types=["sliding", "full"],
        sliding_window=WINDOW,
    )
    model.set_attn_implementation("recording")
    ids, mask = padded_batch(length=8)
    with torch.no_grad():
        model(ids, attention_mask=mask, decoder_input_ids=ids[:, :5])
    cross = [call for call in calls if call["cross"]]
    assert len(cross) == 2 and all(call["sliding_window"] is None for call in cross)


@pytest.mark.parametrize(("backend", "kernel_runs"), [("sdpa", True), ("eager", False), ("recording", False)], ids=str)
def test_sparse_kernels_run_under_sdpa_only(recording_backend, monkeypatch, backend, kernel_runs):
    recording_backend(masked=True)
    model = tiny_model(
        cf.CoreformerEncoderModel, "encoder", layer_types=["sliding", "strided"], sliding_window=WINDOW, stride=STRIDE
    )
    ran = []
    for module in model.modules():
        if isinstance(module, cf.attention.Attention) and module.kernel is not None:
            attend = module.kernel.attend
            monkeypatch.setattr(module.kernel, "attend", lambda *a, attend=attend: (ran.append(1), attend(*a))[1])
    model.set_attn_implementation(backend)
    with torch.no_grad():
        model(*padded_batch(length=12))
    assert bool(ran) == kernel_runs


def test_every_layer_type_is_one_table_entry_the_config_reads():
    config = cf.CoreformerDecoderConfig(
        num_hidden_layers=3, layer_types=["full", "sliding", "linear"], sliding_window=4
    )
    assert config.get_text_config(decoder=True).layer_types == [
        LAYER_TYPES[name].cache_layer for name in ["full", "sliding", "linear"]
    ]
