"""ELECTRA pretraining (coreformer.training.objectives.electra): the replaced-token labels and the joint loss by hand,
a generator a quarter as wide sharing the discriminator's token embeddings, 2 processes == 1 process with
--grad-accum 2, a run killed during a save resumes bit-identically, bf16, and the saved discriminator loads with
AutoModelForSequenceClassification and fine-tunes with the fine-tuning run.

Runs are the tiny ones of test_pretraining.py (hidden 32, 2 layers, 12 documents, blocks of 32), on one thread.
"""

import json
import math

import pytest
import torch
from ranks import fork_python
from test_pretraining import (
    KILLED_CHILD,
    PRETRAIN,
    args_from,
    assert_same_steps,
    child_env,
    cli_flags,
    tiny_settings,
    train_losses,
    two_processes_and_one,
    weights,
)
from tiny import tiny_electra
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import coreformer as cf
from coreformer.training.checkpoints import find_latest_checkpoint
from coreformer.training.finetuning import run_finetuning
from coreformer.training.finetuning.arguments import FinetuningArguments
from coreformer.training.flops import head_parameters
from coreformer.training.objectives import OBJECTIVES
from coreformer.training.objectives.electra import (
    electra_loss,
    electra_loss_terms,
    generator_config,
    replaced_token_labels,
)
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.run import PretrainingArguments
from coreformer.training.reports import held_out_numbers
from coreformer_settings.objectives import objective_settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the whole file


def electra_settings(**overrides) -> dict:
    return tiny_settings("encoder", objective="electra", **overrides)


# ---------------------------------------------------------------------------------------------------------------------
# The objective by hand
# ---------------------------------------------------------------------------------------------------------------------


def test_replaced_token_labels_mark_changed_tokens_and_a_sampled_original_is_not_replaced():
    original = torch.tensor([[5, 6, 7, 8, 0], [9, 9, 9, 9, 9]])
    corrupted = torch.tensor([[5, 11, 7, 8, 0], [9, 9, 12, 9, 13]])  # row 0 position 2: masked, sampled back as 7
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    labels = replaced_token_labels(original, corrupted, mask)
    assert labels.tolist() == [[0, 1, 0, 0, -100], [0, 0, 1, 0, 1]]


def test_discriminator_targets_follow_the_generators_samples_including_the_original_token():
    model, _ = tiny_electra()
    # Every generator logit but token 7's is pushed down: each masked position is filled with 7.
    with torch.no_grad():
        model.generator.lm_head.bias.fill_(-1e4)
        model.generator.lm_head.bias[7] = 1e4
    input_ids = torch.tensor([[2, 4, 9, 4, 3], [2, 10, 4, 11, 3]])  # 4 = [MASK]
    labels = torch.tensor([[-100, 7, -100, 12, -100], [-100, -100, 7, -100, -100]])  # originals at the masks
    outputs = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
    assert outputs["corrupted"].tolist() == [[2, 7, 9, 7, 3], [2, 10, 7, 11, 3]]
    assert outputs["original"].tolist() == [[2, 7, 9, 12, 3], [2, 10, 7, 11, 3]]
    targets = replaced_token_labels(outputs["original"], outputs["corrupted"], torch.ones_like(input_ids))
    assert targets.tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 0, 0]]  # only 12 -> 7 is a replacement
    assert outputs["discriminator_logits"].shape == (2, 5)


def test_replacements_come_from_sample_replacements_which_a_probe_may_swap():
    model, _ = tiny_electra()
    input_ids = torch.tensor([[2, 4, 9, 4, 3]])  # 4 = [MASK]
    labels = torch.tensor([[-100, 7, -100, 12, -100]])
    seen = []

    def draw_token_13(probabilities):  # (M, V) -> (M,)
        seen.append(probabilities)
        return torch.full((len(probabilities),), 13)

    model.sample_replacements = draw_token_13  # benchmarks/electra_rtd_probe.py's unigram / uniform controls
    outputs = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
    assert outputs["corrupted"].tolist() == [[2, 13, 9, 13, 3]]
    (probabilities,) = seen
    assert probabilities.shape == (2, 40) and torch.allclose(probabilities.sum(-1), torch.ones(2))


class FixedVocabulary:
    """What the masked-LM collator reads of a tokenizer: 40 ids, 0-4 special ([PAD] 0, [MASK] 4)."""

    mask_token_id, pad_token_id, all_special_ids = 4, 0, [0, 1, 2, 3, 4]
    model_input_names = ["input_ids", "attention_mask"]

    def __len__(self) -> int:
        return 40


def random_rows(generator: torch.Generator, rows: int = 16, length: int = 32) -> torch.Tensor:
    """(rows, length) ordinary tokens drawn uniformly: no context predicts a masked one."""
    return torch.randint(5, 40, (rows, length), generator=generator)


def test_generator_input_masks_85_percent_of_the_selected_tokens_and_leaves_the_rest_as_the_papers_code():
    _, args = tiny_electra()
    collator = OBJECTIVES["electra"].collator(FixedVocabulary(), args)
    ids = random_rows(torch.Generator().manual_seed(0), rows=64, length=64)
    batch = collator([{"input_ids": row.tolist()} for row in ids])
    selected = batch["labels"] != -100
    masked, kept = selected & (batch["input_ids"] == 4), selected & (batch["input_ids"] == ids)
    assert torch.equal(batch["labels"][selected], ids[selected])
    assert bool((masked | kept)[selected].all())  # none replaced at random: the generator draws the replacements
    assert float(masked.sum() / selected.sum()) == pytest.approx(0.85, abs=0.05)  # ~600 selected of 4,096


@pytest.mark.slow
def test_generator_learns_to_read_a_selected_token_left_visible():
    """The held-out evaluation masks as BERT does (10% of the selected tokens stay visible): a generator trained on
    [MASK] alone never learns the token it sees there and scores no better than a uniform guess."""
    model, args = tiny_electra()
    args.objective_settings = objective_settings("electra", {"mlm_probability": 0.5})  # more visible selections
    electra, draw = OBJECTIVES["electra"], torch.Generator().manual_seed(0)
    collator = electra.collator(FixedVocabulary(), args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):  # fresh random rows each step: nothing to memorise, only the visible token to read
        batch = collator([{"input_ids": row.tolist()} for row in random_rows(draw)])
        loss = electra.loss(model, batch, (batch["labels"] != -100).sum(), batch["attention_mask"].sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    rows = random_rows(torch.Generator().manual_seed(1))
    selected = torch.rand(rows.shape, generator=torch.Generator().manual_seed(2)) < 0.15
    labels = torch.where(selected, rows, -100)  # selected, left as they are
    with torch.no_grad():
        outputs = model(input_ids=rows, attention_mask=torch.ones_like(rows), labels=labels)
    visible_loss = torch.nn.functional.cross_entropy(outputs["generator_logits"], rows[selected])
    assert float(visible_loss) < math.log(35) - 1.0  # a uniform guess over the 35 ordinary tokens: log 35


def test_loss_is_the_generators_mlm_mean_plus_50_times_the_discriminators_token_mean():
    model, _ = tiny_electra()
    input_ids = torch.tensor([[2, 4, 9, 4, 3, 0], [2, 10, 4, 11, 12, 3]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, 7, -100, 12, -100, -100], [-100, -100, 7, -100, -100, -100]])
    torch.manual_seed(3)
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    loss = electra_loss(outputs, labels, attention_mask, label_tokens=3, input_tokens=11, rtd_weight=50.0)

    logits = outputs["generator_logits"]  # (3, V): the masked positions only
    assert logits.shape[0] == 3
    mlm = torch.nn.functional.cross_entropy(logits, labels[labels != -100])  # mean of 3
    real = attention_mask.bool()
    replaced = (outputs["corrupted"] != outputs["original"]).float()
    rtd = torch.nn.functional.binary_cross_entropy_with_logits(outputs["discriminator_logits"][real], replaced[real])
    torch.testing.assert_close(loss, mlm + 50 * rtd)
    # Counts of a larger step scale each part by its own share: half the tokens -> half of each mean
    halved = electra_loss(outputs, labels, attention_mask, label_tokens=6, input_tokens=22, rtd_weight=50.0)
    torch.testing.assert_close(halved, loss / 2)


def test_generator_is_a_quarter_as_wide_and_reads_the_discriminators_token_embeddings():
    model, _ = tiny_electra()
    assert model.generator.config.hidden_size == 8 and model.generator.config.num_attention_heads == 1
    assert model.generator.config.num_hidden_layers == 2
    names = {name for name, _ in model.named_parameters()}
    assert not any(name.startswith("generator.") and "embed_tokens" in name for name in names)
    assert "discriminator.model.encoder.embed_tokens.weight" in names
    ids = torch.tensor([[2, 5, 4, 3]])
    outputs = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([[-100, -100, 6, -100]]))
    loss = outputs["generator_logits"][0, 6]  # the one mask, at position 2
    loss.backward()  # the generator's logits reach the shared embeddings through the projection
    assert model.discriminator.model.encoder.embed_tokens.weight.grad.abs().sum() > 0
    assert model.embedding_projection.weight.grad.abs().sum() > 0
    config = cf.CoreformerEncoderConfig(hidden_size=384, num_attention_heads=12, intermediate_size=1536)
    third = generator_config(config, 1 / 3)
    assert (third.hidden_size, third.num_attention_heads, third.intermediate_size) == (128, 4, 512)


def test_generator_reads_the_discriminators_position_and_token_type_embeddings_through_the_projection():
    # The paper shares token AND position embeddings; the generator once kept its own position table.
    model, _ = tiny_electra()
    names = {name for name, _ in model.named_parameters()}
    tables = ("embed_tokens", "embed_positions", "token_type_embeddings")
    assert not any(name.startswith("generator.") and name.split(".")[-2] in tables for name in names)
    assert {f"discriminator.model.encoder.{table}.weight" for table in tables} <= names
    ids = torch.tensor([[2, 5, 4, 3]])
    outputs = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([[-100, -100, 6, -100]]))
    stack, projection = model.generator.model.encoder, model.embedding_projection.weight  # (H_g, H)
    discriminator = model.discriminator.model.encoder
    torch.testing.assert_close(stack.embed_positions.weight, discriminator.embed_positions.weight @ projection.T)
    torch.testing.assert_close(
        stack.token_type_embeddings.weight, discriminator.token_type_embeddings.weight @ projection.T
    )
    outputs["generator_logits"][0, 6].backward()  # the one mask, at position 2
    assert discriminator.embed_positions.weight.grad[:4].abs().sum() > 0  # the generator's positions are these
    assert discriminator.token_type_embeddings.weight.grad[0].abs().sum() > 0


def test_loss_terms_report_generator_accuracy_replaced_share_and_the_rtd_base_rate_by_hand():
    original = torch.tensor([[2, 7, 9, 12, 3, 0]])
    labels = torch.tensor([[-100, 7, -100, 12, -100, -100]])  # 2 masks
    corrupted = torch.tensor([[2, 7, 9, 8, 3, 0]])  # mask 1 sampled back as 7 (original), mask 2 replaced by 8
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0]])  # 5 real tokens: 4 original, 1 replaced
    generator_logits = torch.zeros(2, 20)  # at the two masks, positions 1 and 3
    generator_logits[0, 7] = generator_logits[1, 5] = 9.0  # likeliest: 7 at mask 1 (right), 5 at mask 2
    discriminator_logits = torch.tensor([[-3.0, 2.0, -3.0, 2.0, -3.0, 5.0]])  # says "replaced" at 1 and 3
    outputs = dict(
        generator_logits=generator_logits,
        original=original,
        corrupted=corrupted,
        discriminator_logits=discriminator_logits,
    )
    terms = electra_loss_terms(outputs, labels, attention_mask, label_tokens=2, input_tokens=5, rtd_weight=50.0)
    assert terms["generator_accuracy"].item() == pytest.approx(1 / 2)
    assert terms["replaced_share"].item() == pytest.approx(1 / 2)
    assert terms["rtd_base_rate"].item() == pytest.approx(4 / 5)
    assert terms["rtd_accuracy"].item() == pytest.approx(4 / 5)  # right at 0, 2, 3, 4; wrong at 1 (a sampled original)
    assert not any(terms[name].requires_grad for name in ("rtd_base_rate", "generator_accuracy", "replaced_share"))


@pytest.mark.parametrize("objective", ["masked-lm", "electra"])
def test_training_flops_match_torchs_flop_counter_on_a_forward_and_backward(objective):
    from torch.utils.flop_counter import FlopCounterMode

    config = cf.CoreformerEncoderConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64,
    )  # fmt: skip
    args = PretrainingArguments(family="encoder", objective=objective, output_dir="unused")
    torch.manual_seed(0)
    model = OBJECTIVES[objective].build_model(config, args)
    model.set_attn_implementation("eager")  # attention as matmuls the counter sees
    batch, length = 3, 16
    input_ids = torch.randint(5, 96, (batch, length))
    labels = torch.full_like(input_ids, -100)
    labels[:, ::4] = input_ids[:, ::4]
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
    with FlopCounterMode(display=False) as counter:
        OBJECTIVES[objective].loss(model, inputs, int((labels != -100).sum()), batch * length).backward()
    label_share = (labels != -100).float().mean().item()  # the vocabulary head projects the labelled quarter only
    per_token, per_step = OBJECTIVES[objective].training_flops(model, length, label_share=label_share)
    counted = per_token * batch * length + per_step

    # The counter sees matrix products only; our count adds 6 FLOPs per bias per token it runs on (the additions):
    # the vocabulary head (transform and projection) runs on the labelled tokens only.
    def biases(module):
        return sum(m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)

    head = model if objective == "masked-lm" else model.generator  # ELECTRA: the generator's head, at the masks
    head_biases = sum(biases(m) for m in (head.lm_head_transform, head.lm_head) if m is not None)
    additions = 6 * batch * length * (biases(model) - head_biases + label_share * head_biases)
    assert counted - additions == counter.get_total_flops()
    assert (per_step > 0) == (objective == "electra")  # the projection of the shared tables, once per step


def test_each_objective_counts_its_head_on_the_tokens_it_runs_on():
    # Masked LM's fused loss runs its (V, H) vocabulary head on the masked share only (label_share: the masking
    # probability), and so does ELECTRA's generator with its (V, H / 4) head; ELECTRA's discriminator has a one-logit
    # head at every token; the embedding lookup is not a matmul and is not counted.
    config = cf.CoreformerEncoderConfig(
        vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512
    )
    flops, full, heads = {}, {}, {}
    for name in ("masked-lm", "electra"):
        args = PretrainingArguments(
            family="encoder", objective=name, output_dir="unused", objective_settings={"mlm_probability": 0.15}
        )
        objective = OBJECTIVES[name]
        model = objective.build_model(config, args)
        assert objective.label_share(args) == 0.15
        flops[name] = objective.training_flops(model, 128, label_share=objective.label_share(args))[0]
        full[name] = objective.training_flops(model, 128)[0]
        heads[name] = head_parameters(model if name == "masked-lm" else model.generator)
    assert OBJECTIVES["causal-lm"].label_share(args) == 1.0
    for name in ("masked-lm", "electra"):  # the head (transform and vocabulary product), forward and backward
        assert full[name] - flops[name] == pytest.approx(0.85 * 6 * heads[name])
    # ELECTRA's generator is extra work beside an encoder as large as masked LM's: more per token, at a quarter the
    # width; what the paper claims is fewer tokens for the same downstream accuracy, which the benchmark measures.
    assert flops["masked-lm"] < flops["electra"] < 1.25 * flops["masked-lm"]


# ---------------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def electra_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("electra")
    settings = electra_settings(save_every=10, sample_prompt="import ")
    return output_dir, settings, run_pretraining(args_from(settings, output_dir))


def test_electra_run_lowers_its_held_out_loss_and_saves_an_encoder_and_its_generator(electra_run):
    output_dir, _, metrics = electra_run
    evals = [record["loss"] for record in metrics["history"]["eval"]]
    assert evals[-1] < evals[0] - 1.0, evals
    assert metrics["objective"].startswith("replaced-token detection")
    config = json.loads((output_dir / "config.json").read_text())
    assert config["architectures"] == ["CoreformerEncoderModel"] and config["hidden_size"] == 32
    encoder = AutoModel.from_pretrained(output_dir)
    assert type(encoder) is cf.CoreformerEncoderModel
    assert metrics["num_parameters"] == sum(p.numel() for p in encoder.parameters()) < metrics["trained_parameters"]
    checkpoint = weights(output_dir)
    assert all(not name.startswith(("generator", "discriminator")) for name in checkpoint)
    generator = AutoModelForMaskedLM.from_pretrained(output_dir / "generator")
    assert type(generator) is cf.CoreformerEncoderForMaskedLM and generator.config.hidden_size == 8
    shared = checkpoint["encoder.embed_tokens.weight"]  # (V, 32), the discriminator's
    generator_embeddings = generator.get_input_embeddings().weight  # (V, 8) = E P
    assert generator_embeddings.shape == (shared.shape[0], 8)
    assert torch.equal(generator.lm_head.weight, generator_embeddings)  # tied, as a masked LM's are
    card = (output_dir / "README.md").read_text()
    assert "replaced-token detection" in card and "AutoModel" in card
    final = metrics["history"]["eval"][-1]
    assert final["loss"] == pytest.approx(final["mlm_loss"] + 50 * final["rtd_loss"], rel=1e-6)
    assert 0.5 < final["rtd_accuracy"] <= 1.0  # most tokens are original: even "none replaced" is right on those
    assert 0.5 < final["rtd_base_rate"] < 1.0 and 0.0 <= final["generator_accuracy"] <= 1.0
    assert 0.0 < final["replaced_share"] <= 1.0
    assert f"rtd accuracy {final['rtd_accuracy']:.4f}" in card and "perplexity" not in card.split("---")[1]
    assert metrics["sample"].startswith("import [MASK] -> ")


def test_saved_discriminator_keeps_its_rtd_head_and_the_encoders_weights(electra_run):
    output_dir, _, _ = electra_run
    discriminator = AutoModelForTokenClassification.from_pretrained(output_dir / "discriminator")
    assert type(discriminator) is cf.CoreformerEncoderForTokenClassification and discriminator.config.num_labels == 1
    encoder = weights(output_dir)
    saved = weights(output_dir / "discriminator")
    assert {name.removeprefix("model.") for name in saved if name.startswith("model.")} == set(encoder)
    assert all(torch.equal(saved[f"model.{name}"], encoder[name]) for name in encoder)  # the same encoder
    assert any(name.startswith("classifier.") for name in saved)  # and the one-logit head the encoder lacks


@pytest.mark.slow
def test_saved_discriminator_fine_tunes_for_sequence_classification(electra_run, tmp_path):
    output_dir, _, _ = electra_run
    args = FinetuningArguments(
        task="sequence-classification", model=str(output_dir), output_dir=str(tmp_path / "cls"), max_steps=4,
        batch_size=8, max_train_examples=32, max_eval_examples=12, max_length=32, lr=3e-3, seed=0,
    )  # fmt: skip
    metrics = run_finetuning(args)
    assert math.isfinite(metrics["eval_accuracy"]) and metrics["train_steps"] == 4
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls")
    assert type(model) is cf.CoreformerEncoderForSequenceClassification and model.config.num_labels == 2
    pretrained = weights(output_dir)["encoder.layers.0.self_attn.q_proj.weight"]
    fresh = AutoModelForSequenceClassification.from_pretrained(output_dir, num_labels=2)
    assert torch.equal(fresh.model.encoder.layers[0].self_attn.q_proj.weight, pretrained)  # the encoder is loaded


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one state per process, with its precision: start and leave it unset."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_electra_in_bf16_trains_with_finite_losses(tmp_path, fresh_accelerator_state):
    settings = electra_settings(max_steps=6, eval_every=3, mixed_precision="bf16")
    metrics = run_pretraining(args_from(settings, tmp_path / "bf16"))
    assert metrics["mixed_precision"] == "bf16"
    assert all(math.isfinite(loss) for loss in train_losses(metrics)) and len(train_losses(metrics)) == 6


@pytest.mark.slow
def test_electra_two_processes_match_one_process_with_grad_accum_2(tmp_path):
    # Dropout and the generator's samples both follow the global batch number, not the process.
    settings = electra_settings(model=dict(hidden_dropout=0.1), max_steps=8, eval_every=4, warmup_steps=2)
    two_metrics, one = two_processes_and_one(settings, tmp_path, forked=True)  # the launch: test_pretraining's
    assert_same_steps(two_metrics, one, steps=8)


@pytest.mark.slow
def test_electra_killed_during_a_save_resumes_bit_identically(electra_run, tmp_path):
    # One tokenizer for both runs, read from the fixture's run rather than trained again.
    tokenizer = str(electra_run[0])
    settings = electra_settings(model=dict(hidden_dropout=0.1), save_every=10, keep_last=3, tokenizer=tokenizer)
    config = tmp_path / "electra-tiny-test.json"
    config.write_text(json.dumps({"family": "encoder", "model": settings["model"]}))
    killed, marker = tmp_path / "killed", tmp_path / "marker"
    child = fork_python(
        ["-c", KILLED_CHILD, str(marker), str(PRETRAIN), "--config", str(config)]
        + cli_flags({**settings, "output_dir": str(killed)}),
        child_env(tmp_path),
        tmp_path,
        tmp_path / "child.log",
    )
    uninterrupted = run_pretraining(args_from(settings, tmp_path / "uninterrupted"))
    child.kill_at_marker(marker)
    assert find_latest_checkpoint(killed) == killed / "checkpoints" / "step-10"

    resumed = run_pretraining(args_from(settings, killed, resume_from_checkpoint="latest"))
    assert train_losses(resumed) == train_losses(uninterrupted)  # exact
    assert resumed["history"]["eval"] == uninterrupted["history"]["eval"]
    for folder in ("", "generator"):
        final, reference = weights(killed / folder), weights(tmp_path / "uninterrupted" / folder)
        assert final.keys() == reference.keys()
        assert all(torch.equal(final[name], reference[name]) for name in reference)


def test_the_log_reports_electras_parts_not_a_perplexity_of_its_combined_loss():
    # exp(L_MLM + 50 L_RTD) is no perplexity: the step and done lines print the objective's own held-out numbers.
    result = {"loss": 26.4, "perplexity": math.exp(26.4), "mlm_loss": 5.8, "rtd_loss": 0.41}
    result.update(rtd_accuracy=0.857, rtd_base_rate=0.857)
    electra = held_out_numbers(result, OBJECTIVES["electra"].metrics_beside_loss)
    assert electra == "mlm loss 5.8000, rtd loss 0.4100, rtd accuracy 0.8570, rtd base rate 0.8570"
    masked = held_out_numbers(result, OBJECTIVES["masked-lm"].metrics_beside_loss)
    assert masked.startswith("perplexity ")
