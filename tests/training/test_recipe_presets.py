"""The recipe presets (training/configs/{family}-tiny-modern.yaml and -tiny-faithful.yaml): each builds and trains a
few steps, and exports to the native architecture its file names (the same logits), or is refused where its file
says no native architecture holds it."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

from coreformer.export import to_native
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.run import resolve_arguments
from coreformer_settings.pretraining import RECIPE_PRESETS

AUTO = {"encoder": AutoModelForMaskedLM, "decoder": AutoModelForCausalLM, "seq2seq": AutoModelForSeq2SeqLM}
NATIVE = {  # (family, preset) -> the transformers class its model exports to; None: refused
    ("encoder", "tiny-modern"): "ModernBertForMaskedLM",
    ("encoder", "tiny-faithful"): "BertForMaskedLM",
    ("decoder", "tiny-modern"): "LlamaForCausalLM",
    ("decoder", "tiny-faithful"): "GPT2LMHeadModel",
    ("seq2seq", "tiny-modern"): None,
    ("seq2seq", "tiny-faithful"): "BartForConditionalGeneration",
}
QUICK = dict(  # the preset's model and optimisation, on a small tokenizer and a few batches
    vocab_size=384,
    max_documents=8,
    block_size=32,
    batch_size=4,
    max_steps=4,
    warmup_steps=1,
    eval_every=0,
    eval_batches=1,
    save_every=0,
    zero_shot_pairs=8,
    report_to="none",
)


def test_every_recipe_preset_is_named_in_the_table():
    assert {preset for _, preset in NATIVE} == set(RECIPE_PRESETS) and len(NATIVE) == 3 * len(RECIPE_PRESETS)


@pytest.mark.slow
@pytest.mark.parametrize("family, preset", list(NATIVE), ids=lambda value: value)
def test_recipe_preset_trains_a_few_steps_and_exports_where_its_file_says(tmp_path, family, preset):
    args = resolve_arguments(family=family, preset=preset, overrides=dict(QUICK, output_dir=str(tmp_path)))
    metrics = run_pretraining(args)
    losses = [record["loss"] for record in metrics["history"]["train"]]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert metrics["preset"] == preset and metrics["zero_shot"]["minimal_pairs"]["pairs"] > 0
    model = AUTO[family].from_pretrained(tmp_path).eval()
    native_class = NATIVE[family, preset]
    if native_class is None:
        with pytest.raises(ValueError, match="cannot export .* differs in: "):
            to_native(model)
        return
    native = to_native(model)
    assert type(native).__name__ == native_class
    ids = torch.randint(4, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if family == "seq2seq":
        inputs["decoder_input_ids"] = ids[:, :6]
    with torch.no_grad():
        torch.testing.assert_close(native(**inputs).logits, model(**inputs).logits, atol=1e-4, rtol=1e-4)
