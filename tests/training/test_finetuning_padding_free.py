"""Fine-tuning with --padding-free: a training batch laid end to end in one row trains exactly as the padded batch.

Token classification (encoder and decoder): a flattened batch gives every token the logits of its padded row and the
same loss, and a 4-step run with the flag logs the same losses and ends at the same metrics and predictions as the
run without it (fp32). Causal LM: with the flag each document of a block gets the loss it gets alone. The tasks that
cannot take flattened rows refuse the flag in one line naming the task and the fix.
"""

import json
from pathlib import Path

import pytest
import torch
from tiny import EOS, VOCAB, tiny_model

import coreformer as cf
from coreformer.training.finetuning import run_finetuning
from coreformer.training.finetuning.arguments import FinetuningArguments
from coreformer.training.finetuning.data import embedded_dataset
from coreformer.training.tasks import TASKS
from coreformer.training.tasks.base import FlatteningCollator
from coreformer.training.tasks.causal_lm import SeparateDocumentsCollator
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer
from coreformer_settings.base import FinetuningError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the whole file

ATOL = 1e-5
LENGTHS = (5, 9, 3)
TOKEN_CLASSIFIERS = {
    "encoder": cf.CoreformerEncoderForTokenClassification,
    "decoder": cf.CoreformerDecoderForTokenClassification,
}
BASES = {
    "encoder": (cf.CoreformerEncoderConfig, cf.CoreformerEncoderForMaskedLM),
    "decoder": (cf.CoreformerDecoderConfig, cf.CoreformerDecoderForCausalLM),
}
TINY_RUN = dict(max_steps=4, batch_size=8, eval_batch_size=8, max_train_examples=32, max_eval_examples=12, lr=3e-3)
TINY_RUN.update(max_length=64, logging_steps=1, seed=0, save_every=0)


def _examples(seed: int = 0) -> list[dict[str, list[int]]]:
    """Token-classification features of LENGTHS tokens: ids, a label per token, -100 on a few (sub-words)."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for length in LENGTHS:
        ids = torch.randint(3, VOCAB, (length,), generator=generator)
        labels = torch.randint(0, 3, (length,), generator=generator)
        labels[1::4] = -100
        examples.append({"input_ids": ids.tolist(), "attention_mask": [1] * length, "labels": labels.tolist()})
    return examples


def _padded(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(example["input_ids"]) for example in examples)

    def pad(key: str, value: int) -> torch.Tensor:
        return torch.tensor([example[key] + [value] * (width - len(example[key])) for example in examples])

    return {"input_ids": pad("input_ids", 0), "attention_mask": pad("attention_mask", 0), "labels": pad("labels", -100)}


@pytest.mark.parametrize("family", list(TOKEN_CLASSIFIERS))
def test_a_flattened_token_classification_batch_gives_the_padded_batchs_logits_loss_and_gradients(family):
    model = tiny_model(TOKEN_CLASSIFIERS[family], family, num_labels=3)
    examples = _examples()
    flat = FlatteningCollator()(examples)
    assert set(flat) == {"input_ids", "labels", "position_ids"}  # no attention mask, no padding
    assert flat["input_ids"].shape == (1, sum(LENGTHS))
    assert flat["position_ids"][0].tolist() == [i for length in LENGTHS for i in range(length)]
    assert flat["labels"][0].tolist() == [label for example in examples for label in example["labels"]]  # unshifted

    padded = _padded(examples)
    padded_out, flat_out = model(**padded), model(**flat)
    real = padded["attention_mask"].bool()
    torch.testing.assert_close(flat_out.logits[0], padded_out.logits[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(flat_out.loss, padded_out.loss, atol=ATOL, rtol=0)
    grads = []
    for loss in (padded_out.loss, flat_out.loss):
        model.zero_grad()
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=ATOL, rtol=0, msg=name)


def test_separate_documents_give_each_document_of_a_causal_lm_block_its_loss_alone():
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder")
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(3, VOCAB, (length - 1,), generator=generator) for length in LENGTHS]
    documents = [torch.cat([document, torch.tensor([EOS])]) for document in documents]  # each ends with eos
    block = torch.cat(documents)
    batch = SeparateDocumentsCollator(eos_token_id=EOS)([{"input_ids": block.tolist()}])
    assert batch["labels"][0].tolist().count(-100) == len(LENGTHS)  # each document's first token
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]  # (T, V)
    token_losses = torch.nn.functional.cross_entropy(logits[:-1], batch["labels"][0, 1:], reduction="none")
    start = 0
    for document in documents:
        alone = model(input_ids=document[None], labels=document[None])
        length = len(document)
        packed_sum = token_losses[start : start + length - 1].sum()  # the predictions made inside the document
        torch.testing.assert_close(packed_sum, alone.loss * (length - 1), atol=ATOL, rtol=0)
        start += length


def _token_classification_base(root: Path, family: str) -> Path:
    """A saved tiny base model with a tokenizer trained on the embedded token-classification words."""
    texts = [" ".join(row["tokens"]) for row in embedded_dataset("token-classification")["train"]]
    tokenizer = train_tokenizer(family, texts, 300, model_max_length=96)
    config_class, head = BASES[family]
    config = config_class(
        **token_config_kwargs(tokenizer, family),
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=98,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    head(config).save_pretrained(root / family)
    tokenizer.save_pretrained(root / family)
    return root / family


def _run(base: Path, output_dir: Path, **overrides) -> tuple[dict, list[float], list[str]]:
    values = {**TINY_RUN, **overrides, "task": "token-classification", "model": str(base)}
    metrics = run_finetuning(FinetuningArguments.resolve({**values, "output_dir": str(output_dir)}))
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    predictions = (output_dir / "eval_predictions.jsonl").read_text().splitlines()
    return metrics, losses, predictions


@pytest.mark.slow
@pytest.mark.parametrize("family", list(BASES))
def test_padding_free_token_classification_trains_as_the_padded_run(family, tmp_path, monkeypatch):
    base = _token_classification_base(tmp_path, family)
    padded, padded_losses, padded_rows = _run(base, tmp_path / "padded")
    shapes, flatten = [], FlatteningCollator.__call__

    def recording(self, features):
        batch = flatten(self, features)
        shapes.append((len(features), tuple(batch["input_ids"].shape), "attention_mask" in batch))
        return batch

    monkeypatch.setattr(FlatteningCollator, "__call__", recording)
    flat, flat_losses, flat_rows = _run(base, tmp_path / "flat", padding_free=True)
    assert len(shapes) >= TINY_RUN["max_steps"]  # the training batches, each one row without a mask
    assert all(count == TINY_RUN["batch_size"] and shape[0] == 1 and not mask for count, shape, mask in shapes)
    assert len(flat_losses) == TINY_RUN["max_steps"]
    assert flat_losses == pytest.approx(padded_losses, abs=1e-4)
    assert flat_rows == padded_rows  # the same predicted tags for every validation example
    for key, value in padded.items():
        if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second")):
            assert flat[key] == pytest.approx(value, abs=1e-4), key
    config = json.loads((tmp_path / "flat" / "run_config.json").read_text())
    assert config["padding_free"] is True


@pytest.mark.slow
def test_a_padding_free_causal_lm_run_trains_on_blocks_whose_documents_restart(tmp_path, monkeypatch):
    base = _token_classification_base(tmp_path, "decoder")  # a decoder with a byte-level tokenizer
    batches, collate = [], SeparateDocumentsCollator.__call__

    def recording(self, examples):
        batch = collate(self, examples)
        batches.append(batch)
        return batch

    monkeypatch.setattr(SeparateDocumentsCollator, "__call__", recording)
    values = {**TINY_RUN, "max_steps": 2, "task": "causal-lm", "model": str(base), "padding_free": True}
    metrics = run_finetuning(FinetuningArguments.resolve({**values, "output_dir": str(tmp_path / "clm")}))
    assert len(batches) >= 2 and all("attention_mask" not in batch for batch in batches)
    restarts = [int((batch["position_ids"][:, 1:] == 0).sum()) for batch in batches]
    assert all(count > 0 for count in restarts)  # documents end inside the blocks, and their positions restart
    for batch in batches:
        assert (batch["labels"][batch["position_ids"] == 0] == -100).all()
    assert metrics["eval_perplexity"] > 1


REFUSING = [name for name, task in TASKS.items() if task.padding_free_refusal is not None]


def test_the_tasks_that_allow_padding_free_are_token_classification_and_causal_lm():
    assert sorted(name for name in TASKS if name not in REFUSING) == ["causal-lm", "token-classification"]


@pytest.mark.parametrize("task", REFUSING)
def test_a_task_that_cannot_flatten_its_batches_refuses_padding_free_in_one_line(task):
    with pytest.raises(FinetuningError) as error:
        FinetuningArguments.resolve({"task": task, "model": "folder", "padding_free": True})
    message = str(error.value)
    assert message.startswith(f"--padding-free: {task} ") and "drop --padding-free" in message
    assert "\n" not in message
