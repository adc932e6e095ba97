"""The optimizer and schedule settings (coreformer.training.optimizers): Muon takes exactly the blocks' linear
weights, every optimizer setting and --max-grad-norm reach what they configure, warmup-stable-decay gives its rates at
chosen steps, each optimizer and schedule resumes exactly, and Muon on sharded weights or a resume with another
optimizer is one clear refusal."""

import re
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import coreformer as cf
from coreformer.training.optimizers import (
    MuonWithAdamW,
    build_optimizer,
    build_schedule,
    check_run_optimizer,
    muon_parameters,
    wsd_steps,
)
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.run import PretrainingArguments
from coreformer_settings.base import PretrainingError

HIDDEN_MATRIX = re.compile(r"(^|\.)layers\.\d+\.(self_attn|cross_attn|mlp)\.\w+_proj\.weight$")


def tiny_model(family: str) -> torch.nn.Module:
    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=64)
    if family == "seq2seq":
        return cf.CoreformerSeq2SeqForConditionalGeneration(
            cf.CoreformerSeq2SeqConfig(encoder_layers=2, decoder_layers=2, **common)
        )
    if family == "encoder":
        return cf.CoreformerEncoderForMaskedLM(cf.CoreformerEncoderConfig(num_hidden_layers=2, **common))
    return cf.CoreformerDecoderForCausalLM(
        cf.CoreformerDecoderConfig(num_hidden_layers=2, tie_word_embeddings=False, gated_mlp=True, **common)
    )


@pytest.mark.parametrize("family", ["encoder", "decoder", "seq2seq"])
def test_muon_takes_exactly_the_hidden_matrices_and_adamw_the_rest(family):
    model = tiny_model(family)
    muon, rest = muon_parameters(model)
    names = [name for name, _ in model.named_parameters()]
    assert muon == [name for name in names if HIDDEN_MATRIX.search(name)]
    assert muon and set(muon).isdisjoint(rest) and sorted(muon + rest) == sorted(names)
    assert not [name for name in muon if "embed" in name or "lm_head" in name or "norm" in name]
    args = PretrainingArguments(family=family, optimizer="muon", lr=1e-3, muon_lr=0.02)
    optimizer = build_optimizer(model, args, torch.device("cpu"))
    assert isinstance(optimizer, MuonWithAdamW)
    assert [p for group in optimizer.muon.param_groups for p in group["params"]] == [
        dict(model.named_parameters())[name] for name in muon
    ]
    assert {group["lr"] for group in optimizer.muon.param_groups} == {0.02}
    assert {group["lr"] for group in optimizer.adamw.param_groups} == {1e-3}


def test_every_optimizer_setting_reaches_the_optimizers_it_builds():
    # A setting that parses but is never read fails silently: each one must show in the groups it configures.
    adamw = dict(lr=2e-3, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6)
    muon = dict(muon_lr=0.03, muon_momentum=0.9, muon_ns_steps=3, muon_adjust_lr="match_rms_adamw")
    model = tiny_model("decoder")
    for optimizer in ("adamw", "muon"):
        args = PretrainingArguments(family="decoder", optimizer=optimizer, **adamw, **muon)
        built = build_optimizer(model, args, torch.device("cpu"))
        groups = built.adamw.param_groups if optimizer == "muon" else built.param_groups
        assert {(group["lr"], group["betas"], group["eps"]) for group in groups} == {(2e-3, (0.8, 0.99), 1e-6)}
        decay = {parameter.ndim >= 2: group["weight_decay"] for group in groups for parameter in group["params"]}
        assert decay == {True: 0.05, False: 0.0}  # matrices and embeddings decay; biases and norm gains do not
    (group,) = built.muon.param_groups
    assert (group["lr"], group["momentum"], group["ns_steps"]) == (0.03, 0.9, 3)
    assert (group["adjust_lr_fn"], group["weight_decay"]) == ("match_rms_adamw", 0.05)


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0])
def test_max_grad_norm_clips_every_step_and_zero_turns_clipping_off(tmp_path, monkeypatch, max_grad_norm):
    from accelerate import Accelerator

    norms, clip = [], Accelerator.clip_grad_norm_

    def recorded(self, parameters, max_norm, *args, **kwargs):
        norms.append(max_norm)
        return clip(self, parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(Accelerator, "clip_grad_norm_", recorded)
    settings = {**tiny_settings(), "max_grad_norm": max_grad_norm, "max_steps": 3, "save_every": 0}
    run_pretraining(PretrainingArguments(**settings, output_dir=str(tmp_path / "run")))
    assert norms == ([max_grad_norm] * 3 if max_grad_norm else [])  # once per optimizer step (grad_accum 2)


def schedule_rates(**settings) -> list[float]:
    """The multiplier of the peak rate before each step 0..max_steps-1."""
    args = PretrainingArguments(family="decoder", **settings)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = build_schedule(optimizer, args)
    rates = []
    for _ in range(args.max_steps):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    return rates


def test_wsd_warms_up_holds_then_decays_over_the_last_fraction():
    assert wsd_steps(2, 10, 0.3) == (2, 5, 3)
    rates = schedule_rates(lr_scheduler_type="wsd", warmup_steps=2, max_steps=10, decay_fraction=0.3)
    assert rates == pytest.approx([0.0, 0.5, 1, 1, 1, 1, 1, 1, 2 / 3, 1 / 3])
    sqrt = schedule_rates(
        lr_scheduler_type="wsd", warmup_steps=2, max_steps=10, decay_fraction=0.3, decay_shape="1-sqrt"
    )
    assert sqrt[:8] == rates[:8] and sqrt[8:] == pytest.approx([1 - (1 / 3) ** 0.5, 1 - (2 / 3) ** 0.5])
    cosine = schedule_rates(warmup_steps=2, max_steps=10)  # the default: decays from the end of warmup on
    assert cosine[:3] == pytest.approx([0.0, 0.5, 1.0]) and 0 < cosine[-1] < cosine[3] < 1


def test_wsd_keeps_the_decay_when_warmup_would_overlap_it():
    assert wsd_steps(100, 10, 0.2) == (8, 0, 2)  # the decay takes its share, the warmup what is left
    assert wsd_steps(0, 10, 0.0) == (0, 10, 0)


def tiny_settings(**overrides) -> dict:
    model = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    model.update(num_hidden_layers=2, hidden_dropout=0.1, attention_dropout=0.0)
    settings = dict(family="decoder", model=model, max_documents=8, vocab_size=320, block_size=32, batch_size=4)
    settings.update(max_steps=6, lr=3e-3, warmup_steps=2, eval_every=3, eval_batches=2, save_every=3, keep_last=2)
    settings.update(report_to="none", preset="tiny-test", grad_accum=2, decay_fraction=0.5)
    return {**settings, **overrides}


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer, schedule", [("adamw", "wsd"), ("muon", "cosine"), ("muon", "wsd")], ids=lambda value: value
)
def test_each_optimizer_and_schedule_resumes_exactly(tmp_path, optimizer, schedule):
    # Gradient accumulation, clipping and dropout on: the optimizer's state and the schedule must come back exactly.
    settings = tiny_settings(optimizer=optimizer, lr_scheduler_type=schedule)
    uninterrupted = run_pretraining(PretrainingArguments(**settings, output_dir=str(tmp_path / "whole")))
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-3"
    resumed = run_pretraining(
        PretrainingArguments(**settings, output_dir=str(tmp_path / "resumed"), resume_from_checkpoint=str(checkpoint))
    )
    assert resumed["resumed_from"] == str(checkpoint)
    assert resumed["history"] == uninterrupted["history"]  # losses and rates of every step, exactly
    lrs = [record["lr"] for record in resumed["history"]["train"]]
    assert lrs[0] == 0.0 and max(lrs) == 3e-3
    final, reference = (load_file(Path(tmp_path, run, "model.safetensors")) for run in ("resumed", "whole"))
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[name], reference[name]) for name in reference)


def test_muon_on_sharded_weights_and_a_resume_with_another_optimizer_are_refused():
    muon = PretrainingArguments(family="decoder", optimizer="muon")
    for sharding in ("FSDP2 full shard", "DeepSpeed ZeRO-3"):
        with pytest.raises(PretrainingError, match=rf"shards them \({sharding}\); pass --optimizer adamw"):
            check_run_optimizer(muon, types.SimpleNamespace(sharding=sharding), None)
    check_run_optimizer(muon, types.SimpleNamespace(sharding="DDP"), None)
    saved = {"args": {"optimizer": "adamw"}}
    with pytest.raises(PretrainingError, match="trained with --optimizer adamw, this run asks for muon"):
        check_run_optimizer(muon, types.SimpleNamespace(sharding="none"), saved)
    with pytest.raises(PretrainingError, match="trained with --optimizer adamw"):  # before the setting: AdamW
        check_run_optimizer(muon, types.SimpleNamespace(sharding="none"), {"args": {}})


def test_muon_refuses_dtensor_shards_built_under_it(tmp_path):
    # The optimizer itself refuses DTensor parameters (FSDP2's shards), whatever engine built them.
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = tiny_model("decoder")
        mesh = init_device_mesh("cpu", (1,))
        layer = model.get_submodule("model.decoder.layers.0.self_attn.q_proj")
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        args = PretrainingArguments(family="decoder", optimizer="muon")
        with pytest.raises(PretrainingError, match=r"shards them \(FSDP2 DTensors\)"):
            build_optimizer(model, args, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(optimizer="sgd"), "`optimizer` must be one of adamw, muon"),
        (dict(lr_scheduler_type="linear"), "`lr_scheduler_type` must be one of cosine, wsd"),
        (dict(decay_fraction=1.5), r"`decay_fraction` must be in \[0, 1\]"),
        (dict(muon_momentum=1.0), r"`muon_momentum` must be in \[0, 1\)"),
        (dict(muon_ns_steps=0), "muon_ns_steps"),
    ],
)
def test_bad_optimizer_settings_are_refused(setting, message):
    with pytest.raises(PretrainingError, match=message):
        PretrainingArguments(family="decoder", **setting)
