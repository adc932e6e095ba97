"""ModernBERT in coreformer: the config options that let a coreformer encoder compute ModernBERT's function
(norm_bias, first_layer_attention_norm, local_rope_theta, classifier_transform, head_transform_bias,
classifier_pooling), and `convert_from_hf` of every ModernBERT head against transformers' own model.

Export to ModernBERT (and export -> convert) is tested with the other targets in tests/native/test_export.py.
"""

import pytest
import torch
import transformers
from tiny import PAD, VOCAB, padded_batch, tiny_config, tiny_model

import coreformer as cf
from coreformer.native.conversion import convert_from_hf

# ---------------------------------------------------------------------------------------------------------------------
# The options, one by one (defaults leave every existing model as it was)
# ---------------------------------------------------------------------------------------------------------------------


def test_new_options_default_to_what_every_model_computed_before():
    config = tiny_config("encoder")
    assert config.norm_bias and config.first_layer_attention_norm and not config.classifier_transform
    assert config.local_rope_theta is None and config.head_transform_bias and config.classifier_pooling is None
    model = tiny_model(cf.CoreformerEncoderForSequenceClassification, "encoder")
    assert isinstance(model.model.encoder.layers[0].self_attn_norm, torch.nn.LayerNorm)
    assert model.head_transform is None and model.model.encoder.local_rotary_emb is None


def test_norm_bias_false_builds_layernorms_without_bias():
    names = set(tiny_model(cf.CoreformerEncoderForMaskedLM, "encoder", norm_bias=False).state_dict())
    with_bias = set(tiny_model(cf.CoreformerEncoderForMaskedLM, "encoder").state_dict())
    norm_biases = {name for name in with_bias if "norm" in name and name.endswith(".bias")}
    assert norm_biases and with_bias - names == norm_biases


def test_first_layer_attention_norm_false_leaves_only_the_first_block_unnormalised():
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", norm_position="pre", first_layer_attention_norm=False)
    first, second = model.encoder.layers
    assert isinstance(first.self_attn_norm, torch.nn.Identity)
    assert isinstance(second.self_attn_norm, torch.nn.LayerNorm) and isinstance(first.mlp_norm, torch.nn.LayerNorm)
    with pytest.raises(ValueError, match="norm_position='pre'"):
        tiny_config("encoder", first_layer_attention_norm=False)  # post-norm: no norm inside the branch to drop


def test_local_rope_theta_rotates_sliding_layers_only():
    ids, mask = padded_batch()
    rotary = dict(position_embedding_type="rotary", sliding_window=2)

    def outputs(layer_types, **overrides):
        model = tiny_model(cf.CoreformerEncoderModel, "encoder", layer_types=layer_types, **rotary, **overrides)
        with torch.no_grad():
            return model(ids, attention_mask=mask).last_hidden_state

    mixed = ["full", "sliding"]
    same = outputs(mixed)
    assert torch.equal(outputs(mixed, local_rope_theta=10000.0), same)  # = rope_theta: the same tables
    assert not torch.allclose(outputs(mixed, local_rope_theta=10.0), same)
    assert torch.equal(outputs(["full", "full"], local_rope_theta=10.0), outputs(["full", "full"]))  # no sliding layer
    with pytest.raises(ValueError, match="local_rope_theta"):
        tiny_config("encoder", local_rope_theta=0.0)


def test_mean_pooling_averages_the_real_tokens():
    model = tiny_model(cf.CoreformerEncoderForSequenceClassification, "encoder", classifier_pooling="mean")
    ids, mask = padded_batch()
    with torch.no_grad():
        states = model.model(ids, attention_mask=mask).last_hidden_state
        pooled = torch.stack([states[row, mask[row].bool()].mean(0) for row in range(len(ids))])
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, model.classifier(pooled))
    with pytest.raises(ValueError, match="classifier_pooling"):
        tiny_config("encoder", classifier_pooling="max")
    with pytest.raises(ValueError, match="last eos"):
        tiny_config("seq2seq", classifier_pooling="mean")


@pytest.mark.parametrize(
    "head",
    [
        cf.CoreformerEncoderForSequenceClassification,
        cf.CoreformerEncoderForTokenClassification,
        cf.CoreformerEncoderForQuestionAnswering,
        cf.CoreformerEncoderForMultipleChoice,
        cf.CoreformerDecoderForSequenceClassification,
        cf.CoreformerSeq2SeqForSequenceClassification,
    ],
)
def test_classifier_transform_puts_a_head_transform_in_front_of_every_classifier(head):
    family = {"Encoder": "encoder", "Decoder": "decoder", "Seq2Seq": "seq2seq"}
    family = next(value for key, value in family.items() if key in head.__name__)
    plain = tiny_model(head, family, num_labels=2)
    model = tiny_model(head, family, num_labels=2, classifier_transform=True, head_transform_bias=False)
    added = set(model.state_dict()) - set(plain.state_dict())
    assert added == {"head_transform.dense.weight", "head_transform.norm.weight", "head_transform.norm.bias"}
    ids, mask = padded_batch()
    ids[:, 0] = 1
    ids[torch.arange(len(ids)), mask.sum(1) - 1] = 2  # an eos in every row, where the seq2seq classifier pools
    inputs = {"input_ids": ids, "attention_mask": mask}
    if head is cf.CoreformerEncoderForMultipleChoice:
        inputs = {key: value[None] for key, value in inputs.items()}
    with torch.no_grad():
        model.head_transform.norm.weight.zero_()  # the transform now hands the classifier zeros, whatever the input
        model.head_transform.norm.bias.zero_()
        outputs = model(**inputs)
    if head is cf.CoreformerEncoderForQuestionAnswering:
        assert torch.equal(outputs.start_logits, model.qa_outputs.bias[0].expand_as(outputs.start_logits))
    elif head is cf.CoreformerEncoderForTokenClassification:
        assert torch.equal(outputs.logits, model.classifier.bias.expand_as(outputs.logits))
    else:  # pooled heads: the same logits for every row
        assert torch.equal(outputs.logits, outputs.logits[:1].expand_as(outputs.logits))


# ---------------------------------------------------------------------------------------------------------------------
# convert_from_hf: every ModernBERT head equals transformers' model
# ---------------------------------------------------------------------------------------------------------------------

MODERNBERT_HEADS = [
    "ModernBertModel",
    "ModernBertForMaskedLM",
    "ModernBertForSequenceClassification",
    "ModernBertForTokenClassification",
    "ModernBertForQuestionAnswering",
    "ModernBertForMultipleChoice",
]
SOURCE_VARIANTS = {
    # ModernBERT-base's choices: no biases but the decoder's, mean pooling, global every third layer.
    "base-like": dict(classifier_pooling="mean"),
    # every bias on, cls pooling, global every other layer, untied decoder with no bias, 1 theta for both kinds
    "biases": dict(
        norm_bias=True,
        attention_bias=True,
        mlp_bias=True,
        classifier_bias=True,
        decoder_bias=False,
        tie_word_embeddings=False,
        global_attn_every_n_layers=2,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 500.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
    ),
}


def modernbert_config(**overrides) -> transformers.ModernBertConfig:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        local_attention=4,  # 2 tokens on each side: narrower than the batch's rows
        global_attn_every_n_layers=3,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 160000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        },
    )
    fields.update(overrides)
    return transformers.ModernBertConfig(**fields)


def modernbert(name: str, attn_implementation: str = "eager", **overrides) -> transformers.PreTrainedModel:
    """A random tiny ModernBERT head; every weight perturbed (norms, biases) so that nothing sits at its init value."""
    config = modernbert_config(num_labels=2 if name == "ModernBertForQuestionAnswering" else 3, **overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", list(SOURCE_VARIANTS))
@pytest.mark.parametrize("name", MODERNBERT_HEADS)
def test_converted_modernbert_matches_transformers(name, variant, attn_implementation):
    source = modernbert(name, attn_implementation, **SOURCE_VARIANTS[variant])
    converted = convert_from_hf(source)
    assert type(converted).__name__ == name.replace("ModernBert", "CoreformerEncoder")
    ids, mask = padded_batch(length=12)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if name == "ModernBertForMultipleChoice":
        inputs = {key: value[None] for key, value in inputs.items()}  # (B, T) -> (1, B, T): B choices
    with torch.no_grad():
        expected, found = source(**inputs), converted(**inputs)
    real = mask.bool()
    compared = 0
    for key, value in expected.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 2 and value.shape[:2] == real.shape:
            value, other = value[real], found[key][real]  # per-token outputs: real tokens only
        else:
            other = found[key]
        torch.testing.assert_close(other, value, rtol=0, atol=1e-5)
        compared += 1
    assert compared


def test_converted_modernbert_keeps_its_layer_pattern_and_thetas():
    converted = convert_from_hf(modernbert("ModernBertModel", num_hidden_layers=5))
    config = converted.config
    assert config.layer_types == ["full", "sliding", "sliding", "full", "sliding"]  # global every third layer
    assert (config.sliding_window, config.rope_theta, config.local_rope_theta) == (2, 160000.0, 10.0)
    assert not config.first_layer_attention_norm and not config.norm_bias and config.classifier_transform


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        (dict(classifier_activation="silu"), "classifier_activation='silu'"),
        (
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "rope_theta": 10.0, "factor": 2.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                }
            ),
            "rope_type='linear'",
        ),
    ],
)
def test_unsupported_modernbert_option_raises_naming_it(overrides, option):
    with pytest.raises(ValueError, match=option.replace("[", r"\[").replace("(", r"\(")) as raised:
        convert_from_hf(modernbert("ModernBertModel", **overrides))
    assert "ModernBERT" in str(raised.value)
