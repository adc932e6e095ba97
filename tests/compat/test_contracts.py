"""The contracts every supported transformers release must keep, in their shortest form: each family trains a step
with transformers' Trainer and with coreformer's pretraining loop, saves and reloads to the same outputs, and takes
its cache under either keyword (`cache` from 5.24, `past_key_values` before) with the output carrying it under the
name the running release reads.

Marked `compat`, with the other contract tests of the suite (generation with every cache, conversion and export
parity, PEFT LoRA, remote code without coreformer, folders travelling between releases): `make test-compat
TRANSFORMERS=X` runs exactly those on release X.
"""

import copy
import warnings

import datasets
import pytest
import torch
from tiny import EOS, padded_batch, tiny_config
from transformers import AutoModel, Trainer, TrainingArguments

import coreformer as cf
from coreformer.compat import CACHE_KEYWORD, output_cache

pytestmark = pytest.mark.compat

HEADS = {
    "encoder": cf.CoreformerEncoderForMaskedLM,
    "decoder": cf.CoreformerDecoderForCausalLM,
    "seq2seq": cf.CoreformerSeq2SeqForConditionalGeneration,
}


def _rows(family: str) -> datasets.Dataset:
    ids, mask = padded_batch(batch=4, length=10)
    if family == "seq2seq":
        ids[:, -1] = EOS
    labels = ids.masked_fill(mask == 0, -100)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels})


@pytest.mark.parametrize("family", list(HEADS))
def test_each_family_trains_a_step_with_the_trainer(family, tmp_path):
    torch.manual_seed(0)
    model = HEADS[family](tiny_config(family))
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    arguments = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, report_to="none",
        save_strategy="no", use_cpu=True, logging_steps=1,
    )  # fmt: skip
    result = Trainer(model=model, args=arguments, train_dataset=_rows(family)).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    moved = [name for name, parameter in model.named_parameters() if not torch.equal(parameter, before[name])]
    assert len(moved) == len(before), sorted(set(before) - set(moved))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(HEADS))
def test_each_family_trains_with_the_pretraining_loop_and_reloads(family, tmp_path):
    from test_pretraining import AUTO_CLASSES, tiny_args

    from coreformer.training.pretraining import run_pretraining

    metrics = run_pretraining(tiny_args(family, tmp_path, max_steps=4, eval_every=2, eval_batches=1))
    losses = [record["loss"] for record in metrics["history"]["train"]]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    model = AUTO_CLASSES[family].from_pretrained(tmp_path)
    assert type(model).__name__ == HEADS[family].__name__


@pytest.mark.parametrize("family", list(HEADS))
def test_a_saved_folder_reloads_to_the_same_outputs(family, tmp_path):
    torch.manual_seed(0)
    model = HEADS[family](tiny_config(family)).eval()
    ids, mask = padded_batch(length=8)
    model.save_pretrained(tmp_path)
    reloaded = HEADS[family].from_pretrained(tmp_path).eval()
    base = AutoModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
        hidden = model.base_model(ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(base(ids, attention_mask=mask).last_hidden_state, hidden)


def _tokens(family: str, start: int, stop: int) -> dict[str, torch.Tensor]:
    """Inputs for target positions [start, stop): a decoder's own tokens, or a seq2seq model's whole source with
    those decoder tokens."""
    ids, _ = padded_batch(length=8)
    if family == "decoder":
        return {"input_ids": ids[:, start:stop]}
    return {"input_ids": ids, "decoder_input_ids": ids.flip(-1)[:, start:stop]}


@pytest.mark.parametrize("family", ["decoder", "seq2seq"])
def test_the_cache_is_taken_under_either_name_and_returned_under_the_releases(family):
    torch.manual_seed(0)
    model = HEADS[family](tiny_config(family)).eval()
    steps = {}
    with torch.no_grad():
        for name in ("cache", "past_key_values"):  # a prefill of its own for each name: a cache grows in place
            prefill = model(**_tokens(family, 0, 6), use_cache=True)
            assert CACHE_KEYWORD in prefill.keys()
            steps[name] = model(**_tokens(family, 6, 7), use_cache=True, **{name: output_cache(prefill)}).logits
        full = model(**_tokens(family, 0, 7)).logits[:, -1:]
        cache = output_cache(prefill)
    torch.testing.assert_close(steps["cache"], steps["past_key_values"], atol=0, rtol=0)
    torch.testing.assert_close(steps["cache"], full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="Pass the cache once"):
        model(**_tokens(family, 7, 8), cache=cache, past_key_values=cache)


def _deprecation_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(warning.message) for warning in caught if "`past_key_values` is deprecated" in str(warning.message)]


@pytest.mark.parametrize("family", ["decoder", "seq2seq"])
def test_the_old_cache_name_warns_exactly_where_the_release_deprecated_it(family):
    torch.manual_seed(0)
    model = HEADS[family](tiny_config(family)).eval()
    with torch.no_grad():
        cache = output_cache(model(**_tokens(family, 0, 6), use_cache=True))
        old_name = _deprecation_warnings(lambda: model(**_tokens(family, 6, 7), past_key_values=copy.deepcopy(cache)))
        new_name = _deprecation_warnings(lambda: model(**_tokens(family, 6, 7), cache=copy.deepcopy(cache)))
        generated = _deprecation_warnings(lambda: model.generate(**_tokens(family, 0, 6), max_new_tokens=3))
    assert bool(old_name) == (CACHE_KEYWORD == "cache"), old_name  # as transformers' own models, from 5.24
    assert new_name == [] and generated == []  # nothing inside the package, nor generate(), uses the old name
