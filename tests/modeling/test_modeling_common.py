"""What transformers' common model tests expect of every head of every family (BERT/GPT-2/BART conventions)."""

import inspect

import pytest
import torch
import transformers
from tiny import EOS, VOCAB, padded_batch, tiny_config, tiny_model
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

import coreformer as cf
from coreformer.families import FAMILIES


def _inputs(family: str, batch: int = 3, length: int = 10, head=None) -> dict:
    ids, mask = padded_batch(batch, length, left=family == "decoder")
    if head is cf.CoreformerSeq2SeqForSequenceClassification:
        ids[:, -1] = EOS  # pooled at the last eos; decoder inputs default to input_ids shifted right
        return dict(input_ids=ids, attention_mask=torch.ones_like(mask))
    if family == "seq2seq":
        decoder_ids, decoder_mask = padded_batch(batch, 6, seed=1)
        return dict(
            input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask
        )
    return dict(input_ids=ids, attention_mask=mask)


# (family, head class, labels for a batch of 3, expected logits shape for length 10 / decoder length 6)
HEADS = [
    ("encoder", cf.CoreformerEncoderModel, None, None),
    ("encoder", cf.CoreformerEncoderForMaskedLM, lambda ids: ids, (3, 10, VOCAB)),
    ("encoder", cf.CoreformerEncoderForSequenceClassification, lambda ids: torch.tensor([0, 1, 1]), (3, 2)),
    ("encoder", cf.CoreformerEncoderForTokenClassification, lambda ids: ids % 2, (3, 10, 2)),
    ("decoder", cf.CoreformerDecoderModel, None, None),
    ("decoder", cf.CoreformerDecoderForCausalLM, lambda ids: ids, (3, 10, VOCAB)),
    ("decoder", cf.CoreformerDecoderForSequenceClassification, lambda ids: torch.tensor([0, 1, 1]), (3, 2)),
    ("decoder", cf.CoreformerDecoderForTokenClassification, lambda ids: ids % 2, (3, 10, 2)),
    ("seq2seq", cf.CoreformerSeq2SeqModel, None, None),
    ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, lambda ids: ids[:, :6], (3, 6, VOCAB)),
    ("seq2seq", cf.CoreformerSeq2SeqForSequenceClassification, lambda ids: torch.tensor([0, 1, 1]), (3, 2)),
]
HEAD_IDS = [head.__name__ for _, head, _, _ in HEADS]


@pytest.mark.parametrize(("family", "head", "make_labels", "shape"), HEADS, ids=HEAD_IDS)
def test_head_returns_logits_and_a_finite_loss(family, head, make_labels, shape):
    model = tiny_model(head, family)
    inputs = _inputs(family, head=head)
    if make_labels is None:
        output = model(**inputs)
        assert output.last_hidden_state.shape[-1] == 32
        return
    output = model(**inputs, labels=make_labels(inputs["input_ids"]))
    assert output.logits.shape == shape
    assert torch.isfinite(output.loss) and output.loss.dim() == 0
    output.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lm_head" not in n or "bias" in n)


@pytest.mark.parametrize(("family", "head", "make_labels", "shape"), HEADS, ids=HEAD_IDS)
def test_inputs_embeds_give_the_same_output_as_input_ids(family, head, make_labels, shape):
    model = tiny_model(head, family)
    inputs = _inputs(family, head=head)
    embeddings = model.get_input_embeddings()
    with torch.no_grad():
        from_ids = model(**inputs)
        from_embeds = dict(inputs, inputs_embeds=embeddings(inputs.pop("input_ids")))
        if "decoder_input_ids" in from_embeds:
            from_embeds["decoder_inputs_embeds"] = embeddings(from_embeds.pop("decoder_input_ids"))
        if head is cf.CoreformerSeq2SeqForSequenceClassification:
            with pytest.raises(ValueError, match="pass input_ids"):
                model(**from_embeds)
            return
        # The decoder classifier then pools the last position, which left padding (used here) keeps real.
        output = model(**from_embeds)
    first = "logits" if make_labels else "last_hidden_state"
    torch.testing.assert_close(getattr(output, first), getattr(from_ids, first), atol=1e-5, rtol=0)


def test_multiple_choice_scores_every_choice():
    model = tiny_model(cf.CoreformerEncoderForMultipleChoice, "encoder")
    ids = torch.randint(3, VOCAB, (2, 3, 7))
    output = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 2]))
    assert output.logits.shape == (2, 3) and torch.isfinite(output.loss)
    with pytest.raises(ValueError, match="num_choices"):
        model(input_ids=ids[:, 0])


def test_question_answering_gives_start_and_end_logits():
    model = tiny_model(cf.CoreformerEncoderForQuestionAnswering, "encoder")
    ids, mask = padded_batch()
    output = model(
        ids, attention_mask=mask, start_positions=torch.tensor([1, 2, 3]), end_positions=torch.tensor([2, 4, 5])
    )
    assert output.start_logits.shape == output.end_logits.shape == (3, 10)
    assert torch.isfinite(output.loss)


def test_decoder_classifier_pools_the_last_real_token_under_left_and_right_padding():
    model = tiny_model(cf.CoreformerDecoderForSequenceClassification, "decoder")
    ids = torch.randint(3, VOCAB, (1, 5))
    pad = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        alone = model(ids).logits
        left = model(torch.cat([pad, ids], 1), attention_mask=torch.cat([pad, torch.ones_like(ids)], 1)).logits
        right = model(torch.cat([ids, pad], 1), attention_mask=torch.cat([torch.ones_like(ids), pad], 1)).logits
    # Left padding shifts learned positions, so only right padding must match exactly; left must still be finite.
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=0)
    assert torch.isfinite(left).all()


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_decoder_classifier_pools_by_the_attention_mask_when_given_embeddings(training):
    # Without input_ids only the mask says where a row ends (in training the padded stack leaves zeros there).
    model = tiny_model(cf.CoreformerDecoderForSequenceClassification, "decoder").train(training)
    ids, mask = padded_batch()
    embeds = model.model.decoder.embed_tokens(ids)
    with torch.no_grad():
        batched = model(inputs_embeds=embeds, attention_mask=mask).logits
        for row in range(ids.shape[0]):
            length = int(mask[row].sum())
            alone = model(inputs_embeds=embeds[row : row + 1, :length]).logits
            torch.testing.assert_close(batched[row : row + 1], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("family", "head", "make_labels", "shape"), HEADS, ids=HEAD_IDS)
def test_return_dict_false_returns_a_tuple(family, head, make_labels, shape):
    model = tiny_model(head, family)
    with torch.no_grad():
        as_tuple = model(**_inputs(family, head=head), return_dict=False)
        as_output = model(**_inputs(family, head=head))
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], as_output.to_tuple()[0])


def test_hidden_states_and_attentions_have_one_entry_per_layer(family):
    head = {"encoder": cf.CoreformerEncoderModel, "decoder": cf.CoreformerDecoderModel}.get(
        family, cf.CoreformerSeq2SeqModel
    )
    model = tiny_model(head, family, attn_implementation="eager")
    with torch.no_grad():
        output = model(**_inputs(family), output_hidden_states=True, output_attentions=True)
    if family == "seq2seq":
        assert len(output.encoder_hidden_states) == len(output.decoder_hidden_states) == 3
        assert len(output.encoder_attentions) == len(output.decoder_attentions) == len(output.cross_attentions) == 2
        assert output.cross_attentions[0].shape == (3, 4, 6, 10)
        torch.testing.assert_close(output.decoder_hidden_states[-1], output.last_hidden_state)
        return
    assert len(output.hidden_states) == 3 and len(output.attentions) == 2
    torch.testing.assert_close(output.hidden_states[-1], output.last_hidden_state)
    assert output.attentions[0].shape == (3, 4, 10, 10)


@pytest.mark.parametrize(
    ("family", "head"),
    [
        ("encoder", cf.CoreformerEncoderForMaskedLM),
        ("decoder", cf.CoreformerDecoderForCausalLM),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration),
    ],
)
def test_language_model_head_is_tied_and_resizes(family, head):
    model = tiny_model(head, family)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    model.resize_token_embeddings(VOCAB + 13)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.config.vocab_size == VOCAB + 13 and model.lm_head.out_features == VOCAB + 13
    ids = torch.full((1, 4), VOCAB + 5)
    inputs = dict(input_ids=ids, labels=ids)
    assert model(**inputs).logits.shape[-1] == VOCAB + 13
    if family == "seq2seq":
        assert model.model.encoder.embed_tokens is model.model.decoder.embed_tokens is model.model.shared

    untied = tiny_model(head, family, tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.get_input_embeddings().weight


@pytest.mark.parametrize(
    ("family", "head"),
    [
        ("encoder", cf.CoreformerEncoderForMaskedLM),
        ("decoder", cf.CoreformerDecoderForCausalLM),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration),
    ],
)
def test_a_few_training_steps_reduce_the_loss(family, head):
    model = tiny_model(head, family).train()
    inputs = _inputs(family, batch=4, length=12)
    labels = inputs["decoder_input_ids"] if family == "seq2seq" else inputs["input_ids"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    losses = []
    for _ in range(20):
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize(
    ("family", "head"),
    [
        ("encoder", cf.CoreformerEncoderForMaskedLM),
        ("decoder", cf.CoreformerDecoderForCausalLM),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration),
    ],
)
def test_gradient_checkpointing_gives_the_same_gradients(family, head):
    inputs = _inputs(family)
    labels = inputs["decoder_input_ids"] if family == "seq2seq" else inputs["input_ids"]
    gradients = []
    for checkpointing in (False, True):
        model = tiny_model(head, family, seed=3).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert all(block.gradient_checkpointing for block in model.modules() if isinstance(block, cf.layers.Block))
        model(**inputs, labels=labels).loss.backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys()
    for name in gradients[0]:
        torch.testing.assert_close(gradients[1][name], gradients[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_bad_inputs_get_one_clear_error(family):
    head = {"encoder": cf.CoreformerEncoderModel, "decoder": cf.CoreformerDecoderModel}.get(
        family, cf.CoreformerSeq2SeqModel
    )
    model = tiny_model(head, family)
    inputs = _inputs(family)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(**dict(inputs, input_ids=inputs["input_ids"] + VOCAB))
    too_long = torch.randint(3, VOCAB, (1, 65))
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        model(**dict(inputs, input_ids=too_long, attention_mask=None))
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        stack = model.encoder if family != "decoder" else model.decoder
        stack(
            input_ids=inputs["input_ids"],
            inputs_embeds=torch.zeros(3, 10, 32),
            **({"encoder_hidden_states": torch.zeros(3, 10, 32)} if family == "seq2seq" else {}),
        )
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(**dict(inputs, attention_mask=inputs["attention_mask"][:, :-1]))


def test_rotary_positions_are_recomputed_after_loading(tmp_path):
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder", position_embedding_type="rotary")
    model.save_pretrained(tmp_path)
    reloaded = cf.CoreformerDecoderForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(reloaded.model.decoder.rotary_emb.inv_freq, model.model.decoder.rotary_emb.inv_freq)
    ids = torch.randint(3, VOCAB, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_config_is_validated_with_the_field_and_the_fix():
    undivided = tiny_config("encoder", hidden_size=30)  # constructs and saves, as BertConfig does
    with pytest.raises(ValueError, match="`hidden_size` .* divisible by `num_attention_heads`"):
        cf.CoreformerEncoderModel(undivided)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config("decoder", num_key_value_heads=3)
    with pytest.raises(ValueError, match="position_embedding_type"):
        tiny_config("decoder", position_embedding_type="alibi")
    with pytest.raises(ValueError, match="rotary .* even"):
        tiny_config("decoder", position_embedding_type="rotary", hidden_size=36, num_attention_heads=4)
    with pytest.raises(ValueError, match="`pad_token_id`"):
        tiny_config("encoder", pad_token_id=VOCAB)
    with pytest.raises(ValueError, match="`decoder_layers` must be a positive integer"):
        tiny_config("seq2seq", decoder_layers=0)
    seq2seq = tiny_config("seq2seq", encoder_layers=3, decoder_layers=1)
    assert seq2seq.num_hidden_layers == 3 and seq2seq.get_text_config(decoder=True).num_hidden_layers == 1


def test_unpadded_causal_batch_takes_sdpa_is_causal_path_without_a_mask(monkeypatch):
    # One mask per forward, and none at all when sdpa's is_causal flag says everything: an unpadded causal batch.
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder")
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    ids, mask = padded_batch(batch=2, length=8)
    with torch.no_grad():
        model(ids[:1], attention_mask=mask[:1], use_cache=False)  # row 0 has no padding
        assert seen and all(attn_mask is None and is_causal for attn_mask, is_causal in seen)
        seen.clear()
        model(ids, attention_mask=mask, use_cache=False)  # row 1 is padded: a mask is needed
        assert seen and all(attn_mask is not None and not is_causal for attn_mask, is_causal in seen)


# Every registered class: the base models (each family's first entry) and their heads.
REGISTERED_HEADS = [getattr(cf, head.class_name) for family in FAMILIES.values() for head in family.heads]


@pytest.mark.parametrize("head", REGISTERED_HEADS, ids=lambda head: head.__name__)
def test_head_forward_types_its_kwargs_as_transformers_kwargs(head):
    # What transformers' in-library BERT and BART models and heads declare, and what its tools read from the
    # signature (its common tests decide from it whether a model can output attentions).
    reference = inspect.signature(transformers.BertForSequenceClassification.forward).parameters["kwargs"]
    kwargs = inspect.signature(head.forward).parameters["kwargs"]
    assert kwargs.kind is inspect.Parameter.VAR_KEYWORD
    assert kwargs.annotation == reference.annotation == Unpack[TransformersKwargs]
