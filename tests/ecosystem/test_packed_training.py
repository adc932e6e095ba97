"""Packed training as the ecosystem builds it: transformers' DataCollatorWithFlattening and TRL's SFTTrainer
(padding_free=True, packing=True with the "bfd" strategy) on tiny coreformer models give every document the loss it
gets in unpacked training.

    collator        DataCollatorWithFlattening, plain (restarting position_ids), with return_flash_attn_kwargs
                    (cu_seq_lens / max_length) and with return_seq_idx, for the decoder (causal LM) and the encoder
                    (masked LM): logits, loss and gradients of the flattened row == those of the padded batch
    TRL             SFTTrainer's own batches: each document's loss sum, found by its tokens, == its sum unpacked;
                    one SGD step gives the same loss and weights as the unpacked step

Seq2seq takes packed rows by `position_ids` and `decoder_position_ids` (tests/modeling/test_packing.py); the
flattening collator gives no decoder positions, so it does not apply there.
"""

import datasets
import pytest
import torch
from tiny import VOCAB, tiny_model
from transformers import DataCollatorWithFlattening
from trl import SFTConfig, SFTTrainer

import coreformer as cf
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the whole file

ATOL = 1e-5
LENGTHS = (6, 11, 4, 8)
FLATTENING = {
    "positions": {},
    "flash-kwargs": {"return_flash_attn_kwargs": True},
    "flash-kwargs-only": {"return_flash_attn_kwargs": True, "return_position_ids": False},
    "seq-idx": {"return_seq_idx": True},
}
HEADS = {"decoder": cf.CoreformerDecoderForCausalLM, "encoder": cf.CoreformerEncoderForMaskedLM}


def _examples(family: str) -> list[dict[str, list[int]]]:
    """Documents of LENGTHS; the encoder's carry masked-LM labels (-100 on unmasked tokens and on the first one,
    which DataCollatorWithFlattening overwrites with its separator)."""
    generator = torch.Generator().manual_seed(0)
    examples = []
    for length in LENGTHS:
        ids = torch.randint(3, VOCAB, (length,), generator=generator)
        if family == "decoder":
            examples.append({"input_ids": ids.tolist()})
            continue
        labels = ids.masked_fill(torch.rand(length, generator=generator) > 0.4, -100)
        labels[0] = -100
        examples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return examples


def _padded(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(example["input_ids"]) for example in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, example in enumerate(examples):
        length = len(example["input_ids"])
        ids[row, :length] = torch.tensor(example["input_ids"])
        mask[row, :length] = 1
        labels[row, :length] = torch.tensor(example.get("labels", example["input_ids"]))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _outputs_and_gradients(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    output = model(**batch)
    output.loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.logits, output.loss.detach(), gradients


@pytest.mark.parametrize("described_by", list(FLATTENING))
@pytest.mark.parametrize("family", list(HEADS))
def test_data_collator_with_flattening_trains_as_the_padded_batch(family, described_by):
    model = tiny_model(HEADS[family], family)
    examples = _examples(family)
    flat = DataCollatorWithFlattening(**FLATTENING[described_by])(examples)
    assert "attention_mask" not in flat and flat["input_ids"].shape == (1, sum(LENGTHS))
    padded = _padded(examples)
    padded_logits, padded_loss, padded_gradients = _outputs_and_gradients(model, padded)
    flat_logits, flat_loss, flat_gradients = _outputs_and_gradients(model, flat)

    torch.testing.assert_close(flat_logits[0], padded_logits[padded["attention_mask"].bool()], atol=ATOL, rtol=0)
    torch.testing.assert_close(flat_loss, padded_loss, atol=ATOL, rtol=0)
    assert flat_gradients.keys() == padded_gradients.keys()
    for name, gradient in padded_gradients.items():
        torch.testing.assert_close(flat_gradients[name], gradient, atol=ATOL, rtol=0, msg=name)


def test_the_flattened_row_is_not_one_long_document():
    """The check above can fail: the same row read as one document (a position count that does not restart) gives
    other logits."""
    model = tiny_model(HEADS["decoder"], "decoder")
    flat = DataCollatorWithFlattening()(_examples("decoder"))
    as_one = model(input_ids=flat["input_ids"]).logits
    packed = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).logits
    second_document = slice(LENGTHS[0], LENGTHS[0] + LENGTHS[1])
    assert (as_one[0, second_document] - packed[0, second_document]).abs().max() > 1e-3


def test_a_flattened_seq2seq_batch_without_decoder_positions_is_refused_in_one_line():
    """DataCollatorWithFlattening packs the encoder side only (no decoder_position_ids): cross-attention could not
    pair the documents, so the model says so rather than let every target read every source."""
    model = tiny_model(cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq")
    examples = [{"input_ids": [5, 6, 7, 8], "labels": [9, 10, 2]}, {"input_ids": [11, 12, 13], "labels": [14, 2]}]
    with pytest.raises(ValueError, match="pack both sides the same way") as error:
        model(**DataCollatorWithFlattening()(examples))
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------------------------------
# TRL's SFTTrainer
# ---------------------------------------------------------------------------------------------------------------------

TEXTS = [
    "def add(a, b): return a + b",
    "import os",
    "class Point: x = 0; y = 0",
    "for item in items: print(item)",
    "while True: break",
    "with open(path) as handle: text = handle.read()",
    "return sorted(values, key=len, reverse=True)",
    "x = [i * i for i in range(10) if i % 2]",
]
SFT = {  # what SFTTrainer is asked for: unpacked (padded rows), padding-free, packed by best-fit decreasing
    "unpacked": dict(max_length=64),
    "padding-free": dict(padding_free=True, max_length=None),  # TRL: no truncation without packing
    "packed-bfd": dict(packing=True, packing_strategy="bfd", max_length=64),
}


@pytest.fixture(scope="module")
def sft_parts():
    """A tiny decoder, its tokenizer (byte-level BPE trained on TEXTS) and the texts as a dataset."""
    tokenizer = train_tokenizer("decoder", TEXTS * 4, 300)
    config = cf.CoreformerDecoderConfig(
        **token_config_kwargs(tokenizer, "decoder"),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return config, tokenizer, datasets.Dataset.from_dict({"text": TEXTS})


def _sft_trainer(parts, how: str, output_dir) -> SFTTrainer:
    config, tokenizer, dataset = parts
    torch.manual_seed(0)
    model = cf.CoreformerDecoderForCausalLM(config)
    args = SFTConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=len(TEXTS),  # every document (or every packed row) in the one batch
        max_steps=1,
        optim="sgd",  # a plain step, so equal gradients give equal weights
        learning_rate=0.5,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,  # TRL's default is bf16: the comparison is in fp32
        dataloader_num_workers=0,
        **SFT[how],
    )
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


def _document_loss_sums(model, batch: dict[str, torch.Tensor]) -> dict[tuple[int, ...], float]:
    """Each document of a batch (its token ids) -> the sum of its next-token losses. Documents are the real tokens of
    a padded row (attention_mask), or the runs of a flattened row whose position ids restart at 0."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        logits = model(**inputs).logits  # (B, T, V)
    labels = batch["labels"]
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none"
    )  # (B, T - 1): the loss of predicting token t + 1 at t
    sums = {}
    for row, ids in enumerate(batch["input_ids"]):
        if "attention_mask" in batch:
            spans = [(0, int(batch["attention_mask"][row].sum()))]
        else:
            starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist()
            spans = list(zip(starts, [*starts[1:], len(ids)]))
        for start, end in spans:
            sums[tuple(ids[start:end].tolist())] = float(losses[row, start : end - 1].sum())
    return sums


@pytest.mark.slow
def test_sft_trainer_padding_free_and_bfd_packing_give_each_document_its_unpacked_loss(sft_parts, tmp_path):
    trainers = {how: _sft_trainer(sft_parts, how, tmp_path / how) for how in SFT}
    batches = {how: next(iter(trainer.get_train_dataloader())) for how, trainer in trainers.items()}
    assert "attention_mask" in batches["unpacked"] and batches["unpacked"]["input_ids"].shape[0] == len(TEXTS)
    for how in ("padding-free", "packed-bfd"):  # one flattened row, described every way TRL describes it
        assert "attention_mask" not in batches[how] and batches[how]["input_ids"].shape[0] == 1
        assert {"position_ids", "cu_seq_lens_q", "seq_idx"} <= batches[how].keys()

    unpacked = _document_loss_sums(trainers["unpacked"].model, batches["unpacked"])
    assert len(unpacked) == len(TEXTS)
    for how in ("padding-free", "packed-bfd"):
        packed = _document_loss_sums(trainers[how].model, batches[how])
        assert packed.keys() == unpacked.keys(), how  # the same documents, none cut or merged
        for document, loss in unpacked.items():
            assert packed[document] == pytest.approx(loss, abs=1e-4), how


@pytest.mark.slow
def test_one_sft_step_packed_or_padding_free_moves_the_weights_as_the_unpacked_step(sft_parts, tmp_path):
    results = {}
    for how in SFT:
        trainer = _sft_trainer(sft_parts, how, tmp_path / how)
        trainer.train()
        loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
        results[how] = loss, {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    loss, weights = results["unpacked"]
    for how in ("padding-free", "packed-bfd"):
        assert results[how][0] == pytest.approx(loss, abs=1e-5), how
        for name, weight in weights.items():
            torch.testing.assert_close(results[how][1][name], weight, atol=1e-5, rtol=0, msg=f"{how}: {name}")
