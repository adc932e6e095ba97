"""Packed pretraining (--packing packed): every objective trains on rows of whole documents kept apart by restarting
position_ids; a packed row gives each document exactly what it gets alone (outputs and loss, fp32); a packed run
resumes exactly; what cannot pack is refused in one line.

Tiny as in test_pretraining.py (hidden 32, 2 layers, tokenizers of 384 trained on 12 documents, rows of 32).
"""

import datasets
import pytest
import torch
from safetensors.torch import load_file
from test_pretraining import args_from, tiny_settings

from coreformer.training.data import best_fit_rows, load_embedded_corpus, pack_windows
from coreformer.training.families import head_class
from coreformer.training.objectives import OBJECTIVES
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.inputs import build_model_config, input_token_count
from coreformer.training.tokenizer_training import train_tokenizer
from coreformer_settings.base import PretrainingError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the whole file

datasets.disable_progress_bars()

FAMILY_OF = {"masked-lm": "encoder", "electra": "encoder", "causal-lm": "decoder", "denoising": "seq2seq"}
AUTO_CLASS = {"encoder": "AutoModelForMaskedLM", "decoder": "AutoModelForCausalLM", "seq2seq": "AutoModelForSeq2SeqLM"}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Lines of 12 standard-library files, in runs of 1 to 6 lines: documents of many lengths."""
    lines = [line for text in load_embedded_corpus(max_documents=12)["train"]["text"] for line in text.splitlines()]
    lines = [line for line in lines if line.strip()]
    return ["\n".join(lines[start : start + 1 + start % 6]) for start in range(0, 600, 7)]


@pytest.fixture(scope="module")
def tokenizers(texts) -> dict:
    return {family: train_tokenizer(family, iter(texts), 384) for family in ("encoder", "decoder", "seq2seq")}


def packed_batch(objective: str, tokenizer, texts: list[str], rows: int = 4, **overrides):
    """(run arguments, a collated batch of `objective` on `texts`): the `rows - 1` packed examples holding the most
    documents and the shortest one, so that every batch has a padded tail whatever files the interpreter ships."""
    args = args_from(tiny_settings(FAMILY_OF[objective], objective=objective, packing="packed", **overrides), "unused")
    spec = OBJECTIVES[objective]
    examples = spec.examples(datasets.Dataset.from_dict({"text": texts}), tokenizer, args)
    by_documents = sorted(range(len(examples)), key=lambda index: -len(examples[index]["lengths"]))
    shortest = min(by_documents[rows - 1 :], key=lambda index: len(examples[index]["input_ids"]))
    chosen = sorted([*by_documents[: rows - 1], shortest])
    width = max(len(examples[index]["input_ids"]) for index in chosen)
    assert len(examples[shortest]["input_ids"]) < width, "the shortest packed row leaves room for padding"
    return args, spec.collator(tokenizer, args)([examples[index] for index in chosen])


def documents(position_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every document of a packed (B, T) batch, read from its restarting positions; checked to
    be packed (more documents than rows)."""
    spans = []
    for row, positions in enumerate(position_ids):
        starts = [*(positions == 0).nonzero().flatten().tolist(), len(positions)]
        spans += [(row, start, stop) for start, stop in zip(starts[:-1], starts[1:])]
    assert len(spans) > len(position_ids), "several documents share a row"
    return spans


def tiny_model(args, tokenizer):
    torch.manual_seed(0)
    family = args.family
    return head_class(family, AUTO_CLASS[family])(build_model_config(args, tokenizer)).eval()


# ---------------------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------------------


def test_best_fit_keeps_every_window_whole_and_fills_rows_longest_first():
    lengths = [5, 3, 6, 2, 8, 1, 4]
    rows = best_fit_rows(lengths, 8)
    assert sorted(index for row in rows for index in row) == list(range(len(lengths)))
    assert all(sum(lengths[index] for index in row) <= 8 for row in rows)
    assert rows == [[4], [2, 3], [0, 1], [6, 5]]  # 8 | 6+2 | 5+3 | 4+1: four rows, the fewest that hold 29 ids
    with pytest.raises(ValueError, match="A window of 9 ids does not fit a row of 8"):
        best_fit_rows([9], 8)
    packed = pack_windows(datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths]}), 8)
    assert packed["lengths"] == [[8], [6, 2], [5, 3], [4, 1]]
    assert [len(ids) for ids in packed["input_ids"]] == [8, 8, 8, 5]


@pytest.mark.parametrize("objective", list(FAMILY_OF))
def test_packed_rows_hold_several_documents_no_mask_and_a_tail_outside_the_counts(objective, tokenizers, texts):
    tokenizer = tokenizers[FAMILY_OF[objective]]
    args, batch = packed_batch(objective, tokenizer, texts)
    assert "attention_mask" not in batch
    spans = documents(batch["position_ids"])
    pad = tokenizer.pad_token_id
    real = int((batch["input_ids"] != pad).sum())
    assert input_token_count(batch, pad) == real
    if objective == "denoising":  # every row ends in a padded tail on both sides
        assert real < batch["input_ids"].numel()
    if (
        objective == "causal-lm"
    ):  # each document's first label is -100: the last token of the one before teaches nothing
        assert all(batch["labels"][row, start] == -100 for row, start, _ in spans)
    if objective == "denoising":  # both sides count their documents alike; each decoder document starts at eos
        assert len(documents(batch["decoder_position_ids"])) == len(spans)
        starts = [batch["decoder_input_ids"][row, start] for row, start, _ in documents(batch["decoder_position_ids"])]
        assert set(torch.stack(starts).tolist()) <= {tokenizer.eos_token_id, pad}


# ---------------------------------------------------------------------------------------------------------------------
# A packed row gives each document what it gets alone
# ---------------------------------------------------------------------------------------------------------------------


def _alone(model, batch: dict, span: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss) of one encoder or decoder document of a packed batch, as a padded collator gives it."""
    row, start, stop = span
    ids = batch["input_ids"][row : row + 1, start:stop]
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=batch["labels"][row : row + 1, start:stop])
    return out.logits[0], out.loss


@pytest.mark.parametrize("objective", ["masked-lm", "causal-lm"])
def test_each_document_of_a_packed_row_gets_its_unpacked_logits_and_loss(objective, tokenizers, texts):
    tokenizer = tokenizers[FAMILY_OF[objective]]
    args, batch = packed_batch(objective, tokenizer, texts)
    model = tiny_model(args, tokenizer)
    with torch.no_grad():
        packed = model(**batch)
        total, weight = 0.0, 0
        for span in documents(batch["position_ids"]):
            row, start, stop = span
            labels = batch["labels"][row, start:stop]
            counted = int((labels[1:] if objective == "causal-lm" else labels).ne(-100).sum())
            if labels.ne(-100).sum() == 0 and batch["input_ids"][row, start] == tokenizer.pad_token_id:
                continue  # the row's padded tail: no label, no real token
            logits, loss = _alone(model, batch, span)
            torch.testing.assert_close(packed.logits[row, start:stop], logits, rtol=1e-5, atol=1e-5)
            if counted:
                total, weight = total + float(loss) * counted, weight + counted
    assert weight == OBJECTIVES[objective].label_count(batch)
    assert float(packed.loss) == pytest.approx(total / weight, rel=1e-5)


def test_each_denoising_pair_of_a_packed_row_gets_its_unpacked_logits_and_loss(tokenizers, texts):
    tokenizer = tokenizers["seq2seq"]
    args, batch = packed_batch("denoising", tokenizer, texts)
    model = tiny_model(args, tokenizer)
    pairs = zip(documents(batch["position_ids"]), documents(batch["decoder_position_ids"]), strict=True)
    with torch.no_grad():
        packed = model(**batch)
        total, weight = 0.0, 0
        for (row, start, stop), (_, first, last) in pairs:
            labels = batch["labels"][row : row + 1, first:last]
            if labels.ne(-100).sum() == 0:
                continue  # the rows' tails, paired with each other
            source = batch["input_ids"][row : row + 1, start:stop]
            alone = model(
                input_ids=source,
                attention_mask=torch.ones_like(source),
                decoder_input_ids=batch["decoder_input_ids"][row : row + 1, first:last],
                labels=labels,
            )
            torch.testing.assert_close(packed.logits[row, first:last], alone.logits[0], rtol=1e-5, atol=1e-5)
            counted = int(labels.ne(-100).sum())
            total, weight = total + float(alone.loss) * counted, weight + counted
    assert float(packed.loss) == pytest.approx(total / weight, rel=1e-5)


def test_electra_hands_packed_rows_to_generator_and_discriminator_alike(tokenizers, texts):
    tokenizer = tokenizers["encoder"]
    args, batch = packed_batch("electra", tokenizer, texts)
    torch.manual_seed(0)
    model = OBJECTIVES["electra"].build_model(build_model_config(args, tokenizer), args).eval()
    with torch.no_grad():
        torch.manual_seed(1)
        outputs = model(**batch)
        hidden = model.generator.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        for row, start, stop in documents(batch["position_ids"]):
            if batch["input_ids"][row, start] == tokenizer.pad_token_id:
                continue
            corrupted = outputs["corrupted"][row : row + 1, start:stop]
            mask = torch.ones_like(corrupted)
            alone = model.discriminator(input_ids=corrupted, attention_mask=mask).logits.squeeze(-1)[0]
            torch.testing.assert_close(outputs["discriminator_logits"][row, start:stop], alone, rtol=1e-5, atol=1e-5)
            masked = batch["input_ids"][row : row + 1, start:stop]
            generator = model.generator.model(input_ids=masked, attention_mask=mask).last_hidden_state[0]
            torch.testing.assert_close(hidden.last_hidden_state[row, start:stop], generator, rtol=1e-5, atol=1e-5)
        # The replaced-token loss counts real tokens only: the padded tails are no input. (Reseeded: the generator
        # samples the same replacements as in the forward above.)
        torch.manual_seed(1)
        terms = OBJECTIVES["electra"].loss_terms(model, batch, 1, input_token_count(batch, tokenizer.pad_token_id))
        real = batch["input_ids"] != tokenizer.pad_token_id
    originals = (outputs["corrupted"] == outputs["original"])[real]
    assert (~real).any() and float(terms["rtd_base_rate"]) == pytest.approx(float(originals.float().mean()), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("objective", list(FAMILY_OF))
def test_each_objective_trains_on_packed_rows(objective, tmp_path):
    settings = tiny_settings(FAMILY_OF[objective], objective=objective, packing="packed", max_steps=8)
    metrics = run_pretraining(args_from({**settings, "eval_every": 8, "zero_shot_pairs": 0}, tmp_path))
    losses = [record["loss"] for record in metrics["history"]["eval"]]
    assert losses[-1] < losses[0]
    assert metrics["tokens_seen"] <= 8 * settings["batch_size"] * settings["block_size"] + 8 * settings["batch_size"]


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["denoising", "masked-lm"])
def test_a_packed_run_resumes_exactly(objective, tmp_path):
    # Dropout and gradient accumulation on: the packed rows, per-document corruption and dropout must come back.
    settings = tiny_settings(
        FAMILY_OF[objective], objective=objective, packing="packed", model=dict(hidden_dropout=0.1)
    )
    settings.update(max_steps=6, save_every=3, eval_every=3, grad_accum=2, batch_size=4, zero_shot_pairs=0)
    whole = run_pretraining(args_from(settings, tmp_path / "whole"))
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-3"
    resumed = run_pretraining(args_from(settings, tmp_path / "resumed", resume_from_checkpoint=str(checkpoint)))
    assert resumed["resumed_from"] == str(checkpoint)
    assert resumed["history"] == whole["history"]  # every step's loss and held-out loss, exactly
    final, reference = (load_file(tmp_path / run / "model.safetensors") for run in ("resumed", "whole"))
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[name], reference[name]) for name in reference)


# ---------------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------------


def test_what_cannot_pack_is_refused_in_one_line(tokenizers):
    lowrank = tiny_settings("encoder", packing="packed", model=dict(layer_types=["lowrank", "full"], lowrank_k=16))
    with pytest.raises(
        PretrainingError, match=r"^--packing packed .* 'lowrank' layers cannot .* pass --packing padded"
    ):
        build_model_config(args_from(lowrank, "unused"), tokenizers["encoder"])
    build_model_config(args_from({**lowrank, "packing": "padded"}, "unused"), tokenizers["encoder"])
    with pytest.raises(
        PretrainingError, match=r"^--packing concatenated: the masked-lm objective builds padded, packed"
    ):
        args_from(tiny_settings("encoder", packing="concatenated"), "unused")
    tokenizer = tokenizers["decoder"]
    saved = tokenizer.pad_token
    tokenizer.pad_token = tokenizer.eos_token  # as GPT-2 users set it
    try:
        with pytest.raises(PretrainingError, match=r"^--packing packed fills rows with the pad token.*'</s>'"):
            build_model_config(args_from(tiny_settings("decoder", packing="packed"), "unused"), tokenizer)
        build_model_config(args_from(tiny_settings("decoder"), "unused"), tokenizer)  # concatenated needs no pad
    finally:
        tokenizer.pad_token = saved
