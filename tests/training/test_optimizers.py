"""The optimizer and schedule settings (coreformer.training.optimizers): Muon takes exactly the blocks' linear
weights, every optimizer setting and --max-grad-norm reach what they configure, warmup-stable-decay gives its rates at
chosen steps, each optimizer and schedule resumes exactly, Muon steps FSDP2's row shards bit for bit as torch's Muon
steps whole matrices (each gathered to an owner rank chosen from the shapes alone), and Muon on flattened partitions
(DeepSpeed ZeRO, FSDP1) or a resume with another optimizer is one clear refusal."""

import os
import re
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import coreformer as cf
from coreformer.training.optimizers import (
    MuonWithAdamW,
    ShardedMuon,
    build_optimizer,
    build_schedule,
    check_run_optimizer,
    muon_owners,
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


def test_muon_on_flattened_partitions_and_a_resume_with_another_optimizer_are_refused():
    muon = PretrainingArguments(family="decoder", optimizer="muon")
    for sharding in ("DeepSpeed ZeRO-3", "DeepSpeed ZeRO-2", "FSDP1 FULL_SHARD"):
        with pytest.raises(PretrainingError, match=rf"shards them \({sharding}\) into flattened partitions; pass"):
            check_run_optimizer(muon, types.SimpleNamespace(sharding=sharding), None)
    for sharding in ("none", "DDP", "FSDP2 full shard", "FSDP2 shard grad-op"):  # whole matrices, or rows gathered
        check_run_optimizer(muon, types.SimpleNamespace(sharding=sharding), None)
    saved = {"args": {"optimizer": "adamw"}}
    with pytest.raises(PretrainingError, match="trained with --optimizer adamw, this run asks for muon"):
        check_run_optimizer(muon, types.SimpleNamespace(sharding="none"), saved)
    with pytest.raises(PretrainingError, match="trained with --optimizer adamw"):  # before the setting: AdamW
        check_run_optimizer(muon, types.SimpleNamespace(sharding="none"), {"args": {}})


def test_muon_owners_spread_the_newton_schulz_work_and_are_the_same_on_every_rank():
    # the tiny decoder's 2 blocks: q, k, v, o (32 x 32), gate and up (64 x 32), down (32 x 64)
    shapes = [(32, 32)] * 4 + [(64, 32), (64, 32), (32, 64)]
    shapes = shapes * 2
    owners = muon_owners(shapes, 2)
    assert owners == muon_owners(list(shapes), 2)  # a function of the shapes alone: no message between ranks
    work = [
        sum(sorted(s)[0] ** 2 * (2 * sorted(s)[1] + sorted(s)[0]) for s, o in zip(shapes, owners) if o == r)
        for r in (0, 1)
    ]
    assert work[0] == work[1]  # 6 wide and 8 square matrices split evenly
    assert muon_owners([(5, 3), (8, 4), (1, 6), (6, 16), (16, 6)], 3) == [2, 2, 2, 0, 1]  # the largest first
    assert muon_owners([(8, 8)], 4) == [0]


def test_sharded_muon_on_whole_tensors_is_torch_muon():
    # One process and DDP: the step is torch's own, bit for bit.
    torch.manual_seed(0)
    weights = [torch.randn(shape) for shape in ((6, 4), (4, 10))]
    whole = [torch.nn.Parameter(w.clone()) for w in weights]
    mine = [torch.nn.Parameter(w.clone()) for w in weights]
    reference, sharded = torch.optim.Muon(whole, lr=0.02), ShardedMuon(mine, lr=0.02)
    for _ in range(2):
        for p, q in zip(whole, mine):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        reference.step()
        sharded.step()
    assert all(torch.equal(p, q) for p, q in zip(whole, mine))


# Each rank steps FSDP2-like row shards (uneven, one rank holding none of a 1-row matrix) and, beside them, torch's
# Muon on the whole matrices with the same gradients; rank 0 writes what it finds.
SHARDED_STEP = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
from coreformer.training.optimizers import ShardedMuon

rank, world, rendezvous, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
shapes = [(5, 3), (8, 4), (1, 6), (6, 16), (16, 6)]
weights = [torch.randn(shape) for shape in shapes]
steps = [[torch.randn(shape) for shape in shapes] for _ in range(3)]
whole = [torch.nn.Parameter(w.clone()) for w in weights]
sharded = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in weights]
settings = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
reference, mine = torch.optim.Muon(whole, **settings), ShardedMuon(sharded, **settings)
for grads in steps:
    for p, q, g in zip(whole, sharded, grads):
        p.grad, q.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
    reference.step()
    mine.step()
buffers = [mine.state[q]["momentum_buffer"] for q in sharded]
found = {
    "weights": [torch.equal(q.full_tensor(), p.detach()) for p, q in zip(whole, sharded)],
    "momentum": [torch.equal(b.full_tensor(), reference.state[p]["momentum_buffer"]) for p, b in zip(whole, buffers)],
    "placements": sorted({str(b.placements) for b in buffers}),
    "local_rows": [b.to_local().shape[0] for b in buffers],
}
dist.destroy_process_group()
if rank == 0:
    open(out, "w").write(json.dumps(found))
"""


@pytest.mark.slow  # 3 forked processes: ~9 s
def test_sharded_muon_on_three_processes_steps_row_shards_bit_for_bit_as_torch_muon(tmp_path):
    import json

    from ranks import fork_python

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    world, out, log = 3, tmp_path / "found.json", tmp_path / "ranks.log"
    ranks = [
        fork_python(
            ["-c", SHARDED_STEP, str(rank), str(world), str(tmp_path / "rendezvous"), str(out)], env, tmp_path, log
        )
        for rank in range(world)
    ]
    try:
        assert [rank.wait(timeout=120) for rank in ranks] == [0] * world, log.read_text()[-3000:]
    finally:
        for rank in ranks:
            rank.kill()
    found = json.loads(out.read_text())
    assert found["weights"] == found["momentum"] == [True] * 5  # the bits of one process, 3 steps in
    assert found["placements"] == ["(Shard(dim=0),)"]  # the momentum is sharded as its parameter: DCP reshards it
    assert found["local_rows"] == [2, 3, 1, 2, 6]  # rank 0's rows: torch.chunk's split of 5, 8, 1, 6 and 16


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
