"""Attention maps: the plotted arrays are the model's attention probabilities, recomputed here by hand from the
q/k projections of every attention module's inputs, and the PNG (from a model, a folder or the command line) is
written with token labels."""

import matplotlib.image
import numpy as np
import pytest
import torch

import coreformer as cf
from coreformer.attention import Attention
from coreformer.probes.attention_maps import attention_maps, plot_head, plot_layer, save_attention_map
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer
from coreformer_cli import COMMANDS

CORPUS = [
    "The old tower is in Paris.",
    "In Rome you find the bridge.",
    "Visitors see the castle of Oslo every day.",
    "Where is the market?",
] * 5
TEXT = "The old bridge is in Rome."
CASES = {
    "encoder": (cf.CoreformerEncoderConfig, cf.CoreformerEncoderForMaskedLM, {"encoder"}),
    "decoder": (cf.CoreformerDecoderConfig, cf.CoreformerDecoderForCausalLM, {"decoder"}),
    "seq2seq": (
        cf.CoreformerSeq2SeqConfig,
        cf.CoreformerSeq2SeqForConditionalGeneration,
        {"encoder", "decoder", "cross"},
    ),
}


@pytest.fixture(scope="module")
def tokenizers():
    return {family: train_tokenizer(family, CORPUS, vocab_size=80 if family == "encoder" else 300) for family in CASES}


def build(family: str, tokenizer, **overrides):
    config_class, head, _ = CASES[family]
    layers = dict(encoder_layers=2, decoder_layers=2) if family == "seq2seq" else dict(num_hidden_layers=2)
    config = config_class(
        **token_config_kwargs(tokenizer, family),
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        **layers,
        **overrides,
    )
    torch.manual_seed(0)
    return head(config).eval()


def reference_probabilities(model, run) -> dict[str, list[np.ndarray]]:
    """softmax(q k^T / sqrt(d)) (+ causal mask) of every attention module, from the inputs it received during `run`."""
    captured = {}

    def capture(name):
        def hook(module, args, kwargs):
            captured[name] = (module, args[0], kwargs.get("key_value_states"))

        return hook

    handles = [
        module.register_forward_pre_hook(capture(name), with_kwargs=True)
        for name, module in model.named_modules()
        if isinstance(module, Attention)
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    stacks = {}
    for name, (module, hidden_states, key_value_states) in captured.items():
        source = key_value_states if module.is_cross_attention else hidden_states

        def heads(projection, states, head_dim=module.head_dim):  # (1, T, H*D) -> (1, H, T, D)
            return projection(states).view(1, states.shape[1], -1, head_dim).transpose(1, 2)

        with torch.no_grad():
            scores = heads(module.q_proj, hidden_states) @ heads(module.k_proj, source).transpose(-1, -2)
            scores = scores / module.head_dim**0.5  # (1, H, T, S)
            if module.is_causal:
                future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
        stack = "cross" if "cross_attn" in name else ("encoder" if "encoder." in name else "decoder")
        stacks.setdefault(stack, []).append(scores.softmax(-1)[0].numpy())
    return stacks


@pytest.mark.parametrize("family", list(CASES))
def test_attention_maps_equal_a_softmax_recomputed_from_queries_and_keys(tokenizers, family):
    model = build(family, tokenizers[family])
    result = {}
    reference = reference_probabilities(model, lambda: result.update(attention_maps(model, tokenizers[family], TEXT)))
    assert set(result) == set(reference) == CASES[family][2]
    tokens = len(tokenizers[family](TEXT)["input_ids"])
    for stack, maps in result.items():
        assert maps.num_layers == 2
        for layer, expected in enumerate(reference[stack]):
            probabilities = maps.layer(layer)
            assert probabilities.shape == (4, len(maps.query_tokens), len(maps.key_tokens))
            np.testing.assert_allclose(probabilities, expected, atol=1e-6)
            np.testing.assert_allclose(probabilities.sum(-1), 1.0, atol=1e-5)
        assert len(maps.key_tokens) == tokens or stack == "decoder"
    assert model.config._attn_implementation == "sdpa"  # switched to eager for the call only


def test_plotted_heatmaps_are_the_probabilities_with_token_labels(tokenizers, tmp_path):
    maps = attention_maps(build("encoder", tokenizers["encoder"]), tokenizers["encoder"], TEXT)["encoder"]
    figure, arrays = plot_layer(maps, layer=1)
    np.testing.assert_array_equal(arrays, maps.layer(1))
    drawn = [ax for ax in figure.axes if ax.images]
    assert len(drawn) == 4
    for head, ax in enumerate(drawn):
        np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), maps.layer(1)[head])
        assert [label.get_text() for label in ax.get_xticklabels()] == maps.key_tokens
        assert [label.get_text() for label in ax.get_yticklabels()] == maps.query_tokens
    assert maps.query_tokens[0] == "[CLS]" and maps.query_tokens[-1] == "[SEP]"
    figure.savefig(tmp_path / "grid.png")
    image = matplotlib.image.imread(tmp_path / "grid.png")
    assert image.ndim == 3 and min(image.shape[:2]) > 100
    np.testing.assert_array_equal(plot_head(maps, layer=-1, head=2), maps.layer(1)[2])


def test_save_attention_map_from_a_folder_and_from_the_command_line(tokenizers, tmp_path, capsys):
    model = build("seq2seq", tokenizers["seq2seq"])
    model.save_pretrained(tmp_path / "model")
    tokenizers["seq2seq"].save_pretrained(tmp_path / "model")
    expected = attention_maps(model, tokenizers["seq2seq"], TEXT, target="The bridge.")
    # A seq2seq model's default stack is cross-attention: decoder queries over source keys.
    grid = save_attention_map(tmp_path / "model", TEXT, tmp_path / "grid.png", layer=0, target="The bridge.")
    np.testing.assert_allclose(grid, expected["cross"].layer(0), atol=1e-6)
    argv = [str(tmp_path / "model"), TEXT, "--layer", "1", "--head", "3", "--stack", "encoder"]
    assert COMMANDS["attention-map"].main([*argv, "-o", str(tmp_path / "head.png")]) == 0
    printed = capsys.readouterr().out
    assert "head.png" in printed and printed.count(" x ") == 1  # one head: (queries, keys), not a grid of heads
    for name in ("grid.png", "head.png"):
        assert matplotlib.image.imread(tmp_path / name).ndim == 3
    one_head = save_attention_map(
        model, TEXT, tmp_path / "x.png", tokenizer=tokenizers["seq2seq"], head=3, stack="encoder"
    )
    np.testing.assert_allclose(
        one_head, attention_maps(model, tokenizers["seq2seq"], TEXT)["encoder"].layer(-1)[3], atol=1e-6
    )


def test_bad_requests_give_one_clear_error(tokenizers, tmp_path):
    tokenizer = tokenizers["encoder"]
    model = build("encoder", tokenizer)
    maps = attention_maps(model, tokenizer, TEXT)["encoder"]
    with pytest.raises(ValueError, match="has 2 layers"):
        maps.layer(2)
    with pytest.raises(ValueError, match="has 4 heads"):
        plot_head(maps, 0, 4)
    with pytest.raises(ValueError, match="no 'cross' stack"):
        save_attention_map(model, TEXT, tmp_path / "x.png", tokenizer=tokenizer, stack="cross")
    with pytest.raises(ValueError, match="seq2seq"):
        attention_maps(model, tokenizer, TEXT, target="x")
    mixed = build("encoder", tokenizer, layer_types=["full", "linear"])
    linear_maps = attention_maps(mixed, tokenizer, TEXT)["encoder"]
    # Linear layers' probabilities are written out (they are no longer refused): rows sum to one.
    assert linear_maps.layer(0).shape == linear_maps.layer(1).shape
    np.testing.assert_allclose(linear_maps.layer(1).sum(-1), 1.0, atol=1e-5)
    no_tokenizer = tmp_path / "no-tokenizer"
    model.save_pretrained(no_tokenizer)
    with pytest.raises(ValueError, match=r"holds no tokenizer .* tokenizer.save_pretrained"):
        save_attention_map(no_tokenizer, TEXT, tmp_path / "y.png")
    assert not (tmp_path / "y.png").exists()


def test_the_command_names_a_missing_folder_before_any_hub_call(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()  # `outputs/nope` can only be meant as a local folder
    assert COMMANDS["attention-map"].main(["outputs/nope", "def f(): pass", "-o", str(tmp_path / "map.png")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("coreformer attention-map: error: no such folder: outputs/nope (looked for ")
        and err.count("\n") == 1
    ), err
    assert not (tmp_path / "map.png").exists()
