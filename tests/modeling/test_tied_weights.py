"""Weight tying as transformers' own models keep it (its common tests test_tied_weights_keys and
test_load_save_without_tied_weights, and BART's seq2seq embeddings): ties are declared by `_tied_weights_keys`, made
between parameters, and a checkpoint missing a tied weight is reported and initialised, never left on meta."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_model

import coreformer as cf
from coreformer.families import FAMILIES

LANGUAGE_MODELS = [
    ("encoder", cf.CoreformerEncoderForMaskedLM),
    ("decoder", cf.CoreformerDecoderForCausalLM),
    ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration),
]
SEQ2SEQ = [
    cf.CoreformerSeq2SeqModel,
    cf.CoreformerSeq2SeqForConditionalGeneration,
    cf.CoreformerSeq2SeqForSequenceClassification,
]
ALL_HEADS = [(name, getattr(cf, head.class_name)) for name, family in FAMILIES.items() for head in family.heads]
ALL_HEAD_IDS = [head.__name__ for _, head in ALL_HEADS]
EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _prefix(model) -> str:
    return "" if model.base_model is model else f"{model.base_model_prefix}."


def _shared_groups(model) -> list[set[str]]:
    """Names that point at one Parameter object, for every parameter with more than one name."""
    groups: dict[int, set[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), set()).add(name)
    return sorted((names for names in groups.values() if len(names) > 1), key=sorted)


def _declared_groups(model) -> list[set[str]]:
    groups: dict[str, set[str]] = {}
    for target, source in model.all_tied_weights_keys.items():
        groups.setdefault(source, {source}).add(target)
    return sorted(groups.values(), key=sorted)


@pytest.mark.parametrize(("family", "head"), ALL_HEADS, ids=ALL_HEAD_IDS)
@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_every_shared_parameter_is_declared_in_tied_weights_keys(family, head, tie_word_embeddings):
    model = tiny_model(head, family, tie_word_embeddings=tie_word_embeddings, num_labels=2)
    assert _shared_groups(model) == _declared_groups(model)
    if family == "seq2seq":  # the stacks own their embedding modules; the parameter is what is tied
        base = model.base_model
        assert base.encoder.embed_tokens is not base.shared and base.decoder.embed_tokens is not base.shared
        embeddings = {_prefix(model) + name for name in EMBEDDINGS}
        assert any(embeddings <= group for group in _shared_groups(model))


@pytest.mark.parametrize("head", SEQ2SEQ)
@pytest.mark.parametrize("kept", [*EMBEDDINGS, None])
def test_seq2seq_checkpoint_with_one_or_no_embedding_key_loads_tied_and_never_on_meta(head, kept, tmp_path):
    model = tiny_model(head, "seq2seq")
    model.save_pretrained(tmp_path)
    prefix = _prefix(model)
    state = load_file(tmp_path / "model.safetensors")
    reference = model.get_input_embeddings().weight.detach().clone()
    names = [prefix + name for name in EMBEDDINGS] + ["lm_head.weight"]
    state = {name: tensor for name, tensor in state.items() if name not in names}
    if kept is not None:
        state[prefix + kept] = reference
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})

    loaded, info = head.from_pretrained(tmp_path, output_loading_info=True)
    embedding = loaded.get_input_embeddings().weight
    assert not any(parameter.is_meta for parameter in loaded.parameters())
    base = loaded.base_model
    assert base.encoder.embed_tokens.weight is embedding and base.decoder.embed_tokens.weight is embedding
    if head is cf.CoreformerSeq2SeqForConditionalGeneration:
        assert loaded.lm_head.weight is embedding
    if kept is not None:
        assert info["missing_keys"] == set()
        assert torch.equal(embedding, reference)
    else:  # reported, and initialised as a fresh model would be (normal(0, initializer_range), padding row zero)
        assert {prefix + name for name in EMBEDDINGS} <= set(info["missing_keys"])
        assert not torch.equal(embedding, reference)
        assert abs(embedding.std().item() - loaded.config.initializer_range) < 0.005
        assert embedding[loaded.config.pad_token_id].abs().max() == 0


@pytest.mark.parametrize(("family", "head"), ALL_HEADS, ids=ALL_HEAD_IDS)
def test_untied_model_saves_and_loads_every_weight(family, head, tmp_path):
    model = tiny_model(head, family, tie_word_embeddings=False, num_labels=2)
    output = model.get_output_embeddings()
    if output is not None:
        with torch.no_grad():
            output.weight.add_(1.0)  # untied: the head must come back with its own values
    model.save_pretrained(tmp_path)
    loaded, info = head.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    if output is not None:
        assert loaded.get_output_embeddings().weight is not loaded.get_input_embeddings().weight
    for (name, expected), (_, found) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(expected, found), name
    if family == "seq2seq":  # tie_word_embeddings concerns lm_head only: the stacks still read `shared`
        assert _shared_groups(loaded) == [{_prefix(loaded) + name for name in EMBEDDINGS}]


def test_seq2seq_checkpoint_with_only_the_lm_head_fills_every_embedding(tmp_path):
    head = cf.CoreformerSeq2SeqForConditionalGeneration
    model = tiny_model(head, "seq2seq")
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    reference = state.pop("model.shared.weight")
    assert not any(name.startswith(("model.encoder.embed_tokens", "model.decoder.embed_tokens")) for name in state)
    save_file({**state, "lm_head.weight": reference}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = head.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == set()
    embedding = loaded.model.shared.weight
    assert torch.equal(embedding, reference) and loaded.lm_head.weight is embedding
    stacks = loaded.model.encoder, loaded.model.decoder
    assert all(stack.embed_tokens.weight is embedding for stack in stacks)
