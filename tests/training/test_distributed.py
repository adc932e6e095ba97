"""Scaling out pretraining (coreformer.training.engine, training/pretrain.py under `accelerate launch`): FSDP2 on 2 CPU
processes for every family equals 1 process with each rank holding a shard, sharded DCP checkpoints that survive a
SIGKILL mid-save and resume exactly, on the same number of processes or on 4 (DCP reshards), the consolidated folder
loads and generates, two "machines" on this one equal one process, every run records the engine that ran, and an
engine asked for but not set up is refused. (DDP on one machine: test_pretraining.py.)

Every run trains with the optimizer of its family's default preset: Muon for the decoder and seq2seq, whose FSDP2 runs
gather each matrix to an owner rank (optimizers.ShardedMuon), so the decoder's killed, resumed and resharded runs carry
sharded Muon momentum through DCP; AdamW for the encoder and ELECTRA.

Every launch of the module starts at once in one fixture (the 2 cores are shared; the runs are tiny: hidden 32,
2 layers, vocab 384, blocks of 32, 12 steps) on its own free port, with the tokenizers trained once here, so that the
1-process references can run in this process meanwhile. The run killed mid-save and its resume are real
`accelerate launch`es, each launcher its own process group, killed at the end whatever happened; the other runs'
ranks are forked as that launch would start them (ranks.py), since what they check is what the ranks compute.
"""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from accelerate.utils import DistributedType
from conftest import free_port
from ranks import Processes, launch_ranks
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM, AutoTokenizer

from coreformer.training.checkpoints import find_latest_checkpoint
from coreformer.training.data import iter_texts
from coreformer.training.engine import (
    DATA_PARALLEL,
    DEEPSPEED,
    FSDP,
    SINGLE,
    AccelerateEngine,
    CpuFsdp2Engine,
    requested_engine,
    resolve_engine,
)
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.inputs import load_dataset_splits
from coreformer.training.pretraining.run import PretrainingArguments, resolve_arguments
from coreformer.training.pretraining.run_folder import check_checkpoint_engine
from coreformer.training.tokenizer_training import train_tokenizer
from coreformer_settings.base import PretrainingError
from coreformer_settings.registries import FAMILY_NAMES

# One worker runs the whole module under `pytest -n 2 --dist loadgroup` (make test): the `runs` fixture once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed")]

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "training" / "pretrain.py"
ACCELERATE_CONFIGS = REPO / "training" / "configs" / "accelerate"
ACCELERATE = Path(sys.executable).with_name("accelerate")
# run name -> (family, settings beyond the family's tiny run). The decoder and seq2seq accumulate 2 micro-batches of
# 4 on each rank (FSDP reduce-scatters each into the sharded gradients); their 1-process references accumulate 4 of 4,
# and the decoder's step-6 checkpoint resumes on 4 ranks x 1 micro-batch of 4: the same 16 examples per step.
RUNS = {
    "encoder": ("encoder", {}),
    "decoder": ("decoder", {"batch_size": 4, "grad_accum": 2}),
    "seq2seq": ("seq2seq", {"batch_size": 4, "grad_accum": 2}),
    "electra": ("encoder", {"objective": "electra"}),
}
AUTO_CLASSES = {
    "encoder": AutoModelForMaskedLM,
    "decoder": AutoModelForCausalLM,
    "seq2seq": AutoModelForSeq2SeqLM,
    "electra": AutoModel,  # the discriminator's encoder; generator/ holds the masked LM
}
STEPS = 12
# 2 processes reduce-scatter (FSDP) or all-reduce (DDP) what 1 process sums in another order; Adam turns the last-bit
# differences into loss differences of ~1e-6 over 12 steps.
LOSS_TOLERANCE = 1e-4
BF16_TOLERANCE = 0.01  # bf16 keeps 8 bits of mantissa; measured 6e-4 on losses near 6 over 12 steps
# The final weights against 1 process, by the run's optimizer. Muon's Newton-Schulz rounds its input to bf16 and
# amplifies small singular directions (slope 3.4445 at zero per iteration): the last-bit differences of another
# reduction order come out of 12 steps as ~1e-3 on the weights (DDP with torch's own Muon: 1.2e-3; FSDP2 2.2e-3,
# seq2seq with dropout 4.2e-3; 0 where the ranks' gradients are the same bits: test_optimizers.py), while the losses
# stay within LOSS_TOLERANCE.
WEIGHT_TOLERANCE = {"adamw": 1e-4, "muon": 1e-2}


def tiny_settings(family: str, **overrides) -> dict:
    model = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    # seq2seq with dropout: its masks follow the global batch number, whatever the engine
    model.update(hidden_dropout=0.1 if family == "seq2seq" else 0.0, attention_dropout=0.0)
    model.update(dict(encoder_layers=2, decoder_layers=2) if family == "seq2seq" else dict(num_hidden_layers=2))
    settings = dict(family=family, model=model, max_documents=12, vocab_size=384, block_size=32, batch_size=8)
    settings.update(max_steps=STEPS, lr=3e-3, warmup_steps=3, eval_every=6, eval_batches=4, save_every=6)
    settings.update(report_to="none", preset="tiny-test", optimizer=resolve_arguments(family=family).optimizer)
    settings.update(overrides)
    return settings


def cli_flags(settings: dict) -> list[str]:
    flags = []
    for key, value in settings.items():
        if key not in ("model", "family", "preset") and value is not None:
            flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def train_losses(metrics: dict) -> list[float]:
    return [record["loss"] for record in metrics["history"]["train"]]


def run_optimizer(folder: Path) -> str:
    return json.loads((folder / "run_config.json").read_text())["optimizer"]


# A launched script that reports, per rank, how FSDP holds each parameter and, on a resume, the rows of each Muon
# momentum buffer it loaded, and (with a marker path) stops forever in the middle of step 12's sharded save: shards
# written, trainer_state.json and the rename not.
CHILD = textwrap.dedent(
    """
    import json, pathlib, runpy, sys, time
    import torch
    from coreformer.training import engine

    report, marker, script = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    setup, save_state = engine.CpuFsdp2Engine.setup, engine.CpuFsdp2Engine.save_state
    load_state = engine.CpuFsdp2Engine.load_state

    def reporting_setup(self, accelerator, model, *args):
        model, optimizer, scheduler = setup(self, accelerator, model, *args)
        held = {
            name: [str(p.placements), p.to_local().numel(), list(p.shape)] for name, p in model.named_parameters()
        }
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        held["tied"] = output is not None and output.weight is model.get_input_embeddings().weight
        (report / f"rank{accelerator.process_index}.json").write_text(json.dumps(held))
        return model, optimizer, scheduler

    def stopping_save_state(self, accelerator, model, optimizer, scheduler, folder):
        save_state(self, accelerator, model, optimizer, scheduler, folder)
        if marker != "-" and folder.name == ".tmp-step-12":
            accelerator.wait_for_everyone()
            pathlib.Path(marker).write_text("saving step 12")
            time.sleep(600)  # the test kills the launcher's process group here

    def reporting_load_state(self, accelerator, model, optimizer, scheduler, folder):
        load_state(self, accelerator, model, optimizer, scheduler, folder)
        muon = getattr(optimizer.optimizer, "muon", None)
        if muon is not None:
            names = {id(p): name for name, p in model.named_parameters()}
            rows = {names[id(p)]: state["momentum_buffer"].to_local().clone() for p, state in muon.state.items()}
            torch.save(rows, report / f"momentum-rank{accelerator.process_index}.pt")

    engine.CpuFsdp2Engine.setup = reporting_setup
    engine.CpuFsdp2Engine.save_state = stopping_save_state
    engine.CpuFsdp2Engine.load_state = reporting_load_state
    sys.argv = [script] + sys.argv[4:]
    runpy.run_path(script, run_name="__main__")
    """
)


class Launches:
    """`accelerate launch` commands started in their own process groups; `finish` waits, `close` kills."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.children = tmp, {}
        (tmp / "child.py").write_text(CHILD)
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_MODULES_CACHE": str(tmp / "modules"),
            "ACCELERATE_USE_CPU": "1",
        }

    def start(
        self, name: str, settings: dict, launcher: list[str], *, marker: str = "-", forked: bool = True, **extra
    ) -> Path:
        """Start pretrain.py (through CHILD) as `accelerate launch` with `launcher` flags would: its ranks forked
        (ranks.py) or, with `forked=False`, the launch itself; returns the output folder."""
        # a file per run: a family's runs start one after another, and the ranks of the run before may still be
        # reading a shared file while the next start rewrites it (they would read it empty)
        config = self.tmp / f"{name}-config.json"
        config.write_text(json.dumps({"family": settings["family"], "model": settings["model"]}))
        output_dir, report, log = self.tmp / name, self.tmp / f"{name}-shards", self.tmp / f"{name}.log"
        report.mkdir(exist_ok=True)
        launcher = [*launcher, "--dynamo_backend", "no"]
        script = [str(self.tmp / "child.py"), str(report), marker, str(PRETRAIN), "--config", str(config)]
        script += cli_flags({**settings, **extra, "output_dir": str(output_dir)})
        log.write_text("")
        if forked:
            self.children[name] = launch_ranks(launcher, script, self.env, self.tmp, log)
        else:
            self.children[name] = subprocess.Popen(
                [str(ACCELERATE), "launch", *launcher, *script],
                env=self.env,
                cwd=self.tmp,
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return output_dir

    def finish(self, name: str, timeout: float = 600) -> int:
        return self.children[name].wait(timeout=timeout)  # Popen.wait and Processes.wait alike

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def metrics(self, name: str) -> dict:
        assert self.finish(name) == 0, self.log(name)[-4000:]
        return json.loads((self.tmp / name / "metrics.json").read_text())

    def shards(self, name: str) -> list[dict]:
        return [json.loads((self.tmp / f"{name}-shards" / f"rank{rank}.json").read_text()) for rank in (0, 1)]

    def kill(self, name: str) -> None:
        """SIGKILL the launcher and every process under it: torchrun starts each rank in a session of its own, so
        the launcher's process group alone would leave the ranks waiting on each other forever."""
        child = self.children[name]
        if isinstance(child, Processes):
            child.kill()
        elif child.poll() is None:
            ranks = psutil.Process(child.pid).children(recursive=True)
            os.killpg(child.pid, signal.SIGKILL)
            for rank in ranks:
                with contextlib.suppress(psutil.NoSuchProcess):
                    rank.kill()
            child.wait(timeout=60)
            psutil.wait_procs(ranks, timeout=60)

    def close(self) -> None:
        for name in self.children:
            self.kill(name)


def fsdp_launcher(port: int, config: str = "fsdp.yaml") -> list[str]:
    return ["--config_file", str(ACCELERATE_CONFIGS / config), "--num_processes", "2", "--mixed_precision", "no"] + [
        "--main_process_port",
        str(port),
    ]


def machine_launcher(port: int, rank: int) -> list[str]:
    """Machine `rank` of two, one DDP process each, meeting at 127.0.0.1:`port` (the README's multi-node lines)."""
    flags = ["--multi_gpu", "--num_processes", "2", "--num_machines", "2", "--mixed_precision", "no"]
    return flags + ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--machine_rank", str(rank)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of the module: per family FSDP on 2 processes and the 1-process reference (--grad-accum 2); the
    decoder also in bf16, as DDP on two "machines", and FSDP killed in its step-12 save then resumed from step 6 on 2
    processes and, from a copy of that checkpoint, on 4."""
    tmp = tmp_path_factory.mktemp("distributed")
    launches = Launches(tmp)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as the children: one thread
    try:
        settings, tokenizers = {}, {}
        for family in FAMILY_NAMES:
            tokenizers[family] = tmp / f"tokenizer-{family}"
            args = PretrainingArguments(**tiny_settings(family), output_dir=str(tmp / "unused"))
            tokenizer = train_tokenizer(family, iter_texts(load_dataset_splits(args)["train"]), args.vocab_size)
            tokenizer.save_pretrained(tokenizers[family])
        for name, (family, extra) in RUNS.items():
            settings[name] = tiny_settings(family, tokenizer=str(tokenizers[family]), **extra)
            launches.start(f"fsdp-{name}", settings[name], fsdp_launcher(free_port()))
        decoder = settings["decoder"]
        bf16 = fsdp_launcher(free_port())
        bf16[bf16.index("--mixed_precision") + 1] = "bf16"
        launches.start("fsdp-bf16", {**decoder, "mixed_precision": "bf16"}, bf16)
        # the launch itself, killed with every process under it, and resumed by another
        launches.start("killed", decoder, fsdp_launcher(free_port()), marker=str(tmp / "marker"), forked=False)
        port = free_port()
        for rank in (0, 1):
            launches.start(f"machine-{rank}", decoder, machine_launcher(port, rank))
        one = {
            name: run_pretraining(
                PretrainingArguments(
                    **{**settings[name], "grad_accum": 2 * settings[name].get("grad_accum", 1)},
                    output_dir=str(tmp / name),
                )
            )
            for name in RUNS
        }
        deadline = time.monotonic() + 600
        while not (tmp / "marker").exists() and launches.children["killed"].poll() is None:
            assert time.monotonic() < deadline, "the killed run never reached its step-12 save"
            time.sleep(0.1)
        assert (tmp / "marker").exists(), launches.log("killed")[-4000:]
        launches.kill("killed")
        killed_state = {
            "latest": find_latest_checkpoint(tmp / "killed"),
            "temporary": sorted(p.name for p in (tmp / "killed" / "checkpoints").iterdir()),
            "final": (tmp / "killed" / "config.json").exists(),
        }
        saved_by_two = tmp / "saved-by-two" / "step-6"  # a copy the resumed run's pruning cannot remove
        shutil.copytree(tmp / "killed" / "checkpoints" / "step-6", saved_by_two)
        launches.start("killed", decoder, fsdp_launcher(free_port()), resume_from_checkpoint="latest", forked=False)
        four = fsdp_launcher(free_port())
        four[four.index("--num_processes") + 1] = "4"
        launches.start("four", decoder, four, grad_accum=1, resume_from_checkpoint=str(saved_by_two))
        yield SimpleNamespace(tmp=tmp, launches=launches, one=one, killed_state=killed_state, saved_by_two=saved_by_two)
    finally:
        launches.close()
        torch.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2 on CPU processes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", RUNS)
def test_fsdp2_on_two_processes_matches_one_process_per_step(runs, family):
    fsdp, one = runs.launches.metrics(f"fsdp-{family}"), runs.one[family]
    expected = {"encoder": "adamw", "decoder": "muon", "seq2seq": "muon"}[RUNS[family][0]]  # the default presets'
    assert run_optimizer(runs.tmp / f"fsdp-{family}") == run_optimizer(runs.tmp / family) == expected
    assert fsdp["examples_per_step"] == one["examples_per_step"] == 16
    assert [r["tokens"] for r in fsdp["history"]["train"]] == [r["tokens"] for r in one["history"]["train"]]
    losses, reference = train_losses(fsdp), train_losses(one)
    assert len(losses) == STEPS and max(abs(a - b) for a, b in zip(losses, reference)) <= LOSS_TOLERANCE
    for mine, theirs in zip(fsdp["history"]["eval"], one["history"]["eval"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=LOSS_TOLERANCE)
    assert fsdp["final_eval_loss"] < fsdp["initial_eval_loss"]


@pytest.mark.parametrize("family", RUNS)
def test_fsdp2_each_rank_holds_half_of_every_parameter(runs, family):
    runs.launches.metrics(f"fsdp-{family}")
    ranks = runs.launches.shards(f"fsdp-{family}")
    # the LM head's weight IS the sharded token embedding (one parameter, sharded once); ELECTRA's discriminator
    # has no LM head
    assert ranks[0].pop("tied") == ranks[1].pop("tied") == (family != "electra")
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) > 10
    held, everything = 0, 0
    for name, (placements, local, shape) in ranks[0].items():
        assert placements == ranks[1][name][0] == "(Shard(dim=0),)", name
        rows, total = shape[0], math.prod(shape)
        # rows split as torch.chunk splits them: rank 0 the first ceil(rows / 2), rank 1 the rest
        assert (local, ranks[1][name][1]) == (math.ceil(rows / 2) * total // rows, total - local), name
        held, everything = held + local, everything + total
    assert 0.5 <= held / everything < 0.51  # a 1-row classifier is rank 0's alone


@pytest.mark.parametrize("family", RUNS)
def test_runs_record_the_engine_that_ran_in_metrics_and_the_log(runs, family):
    fsdp = runs.launches.metrics(f"fsdp-{family}")
    assert fsdp["engine"] == {
        "distributed_type": "FSDP",
        "world_size": 2,
        "num_nodes": 1,
        "sharding": "FSDP2 full shard",
        "mixed_precision": "no",
        "backend": "gloo",
        "set_up_by": "coreformer",
        "checkpoint_format": "dcp",
        "requested": {"engine": "FSDP", "mixed_precision": "no"},
    }
    assert (
        "engine: FSDP (FSDP2 full shard, set up by coreformer's fully_shard inside Accelerate), 2 process(es) on 1 node"
        in (runs.launches.log(f"fsdp-{family}"))
    )
    bf16 = runs.launches.metrics("fsdp-bf16")["engine"]
    assert bf16["requested"] == {"engine": "FSDP", "mixed_precision": "bf16"}
    single = runs.one[family]["engine"]
    assert single["requested"] == {"engine": "single process", "mixed_precision": None}
    assert (single["distributed_type"], single["sharding"], single["world_size"], single["num_nodes"]) == (
        "NO",
        "none",
        1,
        1,
    )


def test_two_machines_record_data_parallel_and_their_nodes(runs):
    machines = runs.launches.metrics("machine-0")
    assert (machines["engine"]["distributed_type"], machines["engine"]["sharding"]) == ("MULTI_CPU", "DDP")
    assert machines["num_nodes"] == machines["engine"]["num_nodes"] == 2
    assert runs.launches.finish("machine-1") == 0, runs.launches.log("machine-1")[-4000:]


# ---------------------------------------------------------------------------------------------------------------------
# Sharded checkpoints, exact resume, the consolidated folder
# ---------------------------------------------------------------------------------------------------------------------


def test_sigkill_during_a_sharded_save_then_resume_gives_the_uninterrupted_losses(runs):
    killed = runs.killed_state
    assert killed["latest"].name == "step-6" and not killed["final"]
    assert killed["temporary"] == [".tmp-step-12", "step-6"]  # step 12's shards written, never renamed
    resumed, uninterrupted = runs.launches.metrics("killed"), runs.launches.metrics("fsdp-decoder")
    assert resumed["resumed_from"].endswith("checkpoints/step-6")
    assert train_losses(resumed) == train_losses(uninterrupted)  # exact, not approximate
    assert resumed["history"]["eval"] == uninterrupted["history"]["eval"]
    final, reference = (
        load_file(runs.tmp / "killed" / "model.safetensors"),
        load_file(runs.tmp / "fsdp-decoder" / "model.safetensors"),
    )
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)
    checkpoint = runs.tmp / "killed" / "checkpoints" / "step-12"
    assert (checkpoint / "dcp" / ".metadata").is_file()
    assert sorted(p.name for p in (checkpoint / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_a_dcp_checkpoint_of_2_processes_resumes_on_4_to_the_uninterrupted_losses(runs):
    four, uninterrupted = runs.launches.metrics("four"), runs.launches.metrics("fsdp-decoder")
    assert four["engine"]["world_size"] == 4 and four["resumed_from"] == str(runs.saved_by_two)
    assert four["examples_per_step"] == uninterrupted["examples_per_step"] == 16
    losses, reference = train_losses(four), train_losses(uninterrupted)
    assert len(losses) == len(reference) == STEPS
    assert losses[:6] == reference[:6]  # the history the checkpoint carries
    assert max(abs(a - b) for a, b in zip(losses[6:], reference[6:])) <= LOSS_TOLERANCE  # trained on 4 processes
    assert "resumed from" in runs.launches.log("four")
    # Muon's momentum, saved as 2 halves of each matrix, is read back as 4 quarters of the same bits
    saved = runs.tmp / "saved-by-two.pt"
    dcp_to_torch_save(runs.saved_by_two / "dcp", saved)
    states = torch.load(saved)["optimizer"]["state"]
    momentum = {name: state["momentum_buffer"] for name, state in states.items() if "momentum_buffer" in state}
    quarters = [torch.load(runs.tmp / "four-shards" / f"momentum-rank{rank}.pt") for rank in range(4)]
    assert len(momentum) == 12 and all(
        quarters[0][name].shape[0] == len(buffer) // 4 for name, buffer in momentum.items()
    )
    assert all(torch.equal(torch.cat([quarter[name] for quarter in quarters]), momentum[name]) for name in momentum)


@pytest.mark.parametrize("family", RUNS)
def test_consolidated_fsdp2_folder_loads_with_auto_classes_and_matches_one_process(runs, family):
    runs.launches.metrics(f"fsdp-{family}")
    folder = runs.tmp / f"fsdp-{family}"
    assert json.loads((folder / "config.json").read_text())["architectures"][0].startswith("Coreformer")
    model = AUTO_CLASSES[family].from_pretrained(folder).eval()
    if family == "electra":  # the generator, saved beside the discriminator's encoder, ties E P to its lm_head
        generator = AutoModelForMaskedLM.from_pretrained(folder / "generator")
        assert generator.get_output_embeddings().weight is generator.get_input_embeddings().weight
    else:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied after loading
    reference = AUTO_CLASSES[family].from_pretrained(runs.tmp / family).eval()
    tolerance = WEIGHT_TOLERANCE[run_optimizer(folder)]
    for (name, mine), (_, theirs) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.allclose(mine, theirs, atol=tolerance), name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if family in ("encoder", "electra"):
        return
    prompt = tokenizer("def read(path):", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape[-1] > (0 if family == "seq2seq" else prompt["input_ids"].shape[-1])


# ---------------------------------------------------------------------------------------------------------------------
# Multi-node
# ---------------------------------------------------------------------------------------------------------------------


def test_two_machines_of_one_process_equal_one_process_with_two_micro_batches(runs):
    two_machines, one = runs.launches.metrics("machine-0"), runs.one["decoder"]
    assert two_machines["examples_per_step"] == one["examples_per_step"] == 16
    losses, reference = train_losses(two_machines), train_losses(one)
    assert len(losses) == STEPS and max(abs(a - b) for a, b in zip(losses, reference)) <= LOSS_TOLERANCE
    for mine, theirs in zip(two_machines["history"]["eval"], one["history"]["eval"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=LOSS_TOLERANCE)


# ---------------------------------------------------------------------------------------------------------------------
# The requested engine, and refusals
# ---------------------------------------------------------------------------------------------------------------------


def fake_accelerator(kind: str, processes: int = 2) -> SimpleNamespace:
    """What resolve_engine reads of an Accelerator: its distributed type, process count and backend."""
    return SimpleNamespace(
        distributed_type=DistributedType(kind),
        num_processes=processes,
        state=SimpleNamespace(backend="gloo" if processes > 1 else None),
    )


FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def test_the_request_is_read_from_what_accelerate_launch_passes():
    assert requested_engine({}).engine == SINGLE
    assert requested_engine({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).engine == DATA_PARALLEL
    assert requested_engine({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).num_nodes == 2
    fsdp = requested_engine({**FSDP_ENV, "FSDP_RESHARD_AFTER_FORWARD": "false", "ACCELERATE_MIXED_PRECISION": "bf16"})
    assert (fsdp.engine, fsdp.fsdp_version, fsdp.reshard_after_forward, fsdp.mixed_precision) == (
        FSDP,
        2,
        False,
        "bf16",
    )
    assert not requested_engine({**FSDP_ENV, "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}).reshard_after_forward
    deepspeed = requested_engine({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})
    assert (deepspeed.engine, deepspeed.zero_stage) == (DEEPSPEED, 2)


def test_fsdp2_asked_on_cpu_processes_is_taken_over_and_what_accelerate_set_up_is_kept():
    engine = resolve_engine(fake_accelerator("MULTI_CPU"), requested_engine(FSDP_ENV), "bf16")
    assert isinstance(engine, CpuFsdp2Engine)
    assert (engine.distributed_type, engine.sharding, engine.mixed_precision) == ("FSDP", "FSDP2 full shard", "bf16")
    ddp = resolve_engine(fake_accelerator("MULTI_CPU"), requested_engine({"WORLD_SIZE": "2"}), "no")
    assert isinstance(ddp, AccelerateEngine) and ddp.sharding == "DDP"


@pytest.mark.parametrize(
    "environ, kind, processes, precision, message",
    [
        ({**FSDP_ENV, "FSDP_VERSION": "1"}, "MULTI_CPU", 2, "no", "version 1, which Accelerate does not set up on CPU"),
        ({**FSDP_ENV, "WORLD_SIZE": "1"}, "NO", 1, "no", "set up a single process"),
        ({**FSDP_ENV, "FSDP_OFFLOAD_PARAMS": "true"}, "MULTI_CPU", 2, "no", "fsdp_offload_params: true"),
        ({**FSDP_ENV, "FSDP_ACTIVATION_CHECKPOINTING": "true"}, "MULTI_CPU", 2, "no", "--gradient-checkpointing"),
        (FSDP_ENV, "MULTI_CPU", 2, "fp16", "pass --mixed-precision bf16 or no"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2"}, "MULTI_CPU", 2, "no", "asked for DeepSpeed, but"),
    ],
    ids=["fsdp1-on-cpu", "fsdp-one-process", "offload", "activation-checkpointing", "fp16", "deepspeed-on-cpu"],
)
def test_an_engine_asked_for_but_not_set_up_is_refused(environ, kind, processes, precision, message):
    with pytest.raises(PretrainingError, match=message):
        resolve_engine(fake_accelerator(kind, processes), requested_engine(environ), precision)


def test_fsdp_config_launched_on_one_process_is_refused_in_one_line(tmp_path):
    settings = tiny_settings("decoder", max_steps=2)
    launches = Launches(tmp_path)
    del launches.env["ACCELERATE_USE_CPU"]  # forgotten: Accelerate sets up one plain process, not a process group
    try:
        launcher = ["--config_file", str(ACCELERATE_CONFIGS / "fsdp.yaml"), "--num_processes", "1"]
        launcher += ["--main_process_port", str(free_port())]
        output_dir = launches.start("one", settings, launcher, forked=False)
        assert launches.finish("one", timeout=300) != 0
    finally:
        launches.close()
    log = launches.log("one")
    assert "pretrain.py: error: The launcher asked for FSDP, but Accelerate set up a single process" in log
    assert not output_dir.exists()


def test_a_dcp_checkpoint_resumed_by_one_process_is_refused_naming_both_process_counts(runs, tmp_path):
    settings = tiny_settings("decoder", tokenizer=str(runs.tmp / "tokenizer-decoder"), grad_accum=2)
    output_dir = tmp_path / "out"
    args = PretrainingArguments(**settings, output_dir=str(output_dir), resume_from_checkpoint=str(runs.saved_by_two))
    message = (
        r"holds dcp state \(written by a FSDP2 full shard run\); this run is NO \(none\) and reads accelerate "
        r"checkpoints \(saved by 2 process\(es\), this run has 1\)\. Resume with the launcher config the run was "
        r"started with \(FSDP2 shards of DCP checkpoints load on any number of processes from 2\)\."
    )
    with pytest.raises(PretrainingError, match=message):
        run_pretraining(args)
    assert not output_dir.exists()


def test_fsdp2_in_bf16_over_gloo_trains_and_stays_near_fp32(runs):
    # FSDP's MixedPrecisionPolicy: bf16 parameters in forward and backward, gradients reduce-scattered in fp32.
    bf16, fp32 = runs.launches.metrics("fsdp-bf16"), runs.launches.metrics("fsdp-decoder")
    assert (bf16["engine"]["mixed_precision"], bf16["engine"]["sharding"]) == ("bf16", "FSDP2 full shard")
    difference = max(abs(a - b) for a, b in zip(train_losses(bf16), train_losses(fp32)))
    assert 0 < difference < BF16_TOLERANCE, difference
    assert bf16["final_eval_loss"] < bf16["initial_eval_loss"]


def test_a_checkpoint_from_before_engines_were_recorded_is_read_as_accelerates(tmp_path):
    fsdp = resolve_engine(fake_accelerator("MULTI_CPU"), requested_engine(FSDP_ENV), "no")
    ddp = resolve_engine(fake_accelerator("MULTI_CPU"), requested_engine({"WORLD_SIZE": "2"}), "no")
    check_checkpoint_engine(tmp_path, {"step": 10}, ddp)
    with pytest.raises(PretrainingError, match=r"holds accelerate state \(written by a DDP or single-process run\)"):
        check_checkpoint_engine(tmp_path, {"step": 10}, fsdp)
