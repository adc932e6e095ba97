"""Fine-tuning checkpoints and resume (coreformer.training.finetuning and its checkpoints.py, training/finetune.py).

A fine-tune SIGKILLed in the middle of a checkpoint save (after an earlier checkpoint is complete) leaves that earlier
checkpoint as the latest and the interrupted one hidden; `--resume-from-checkpoint latest` then continues through
Trainer's own resume to the same per-step losses, final weights and metrics as a run never interrupted, bit for bit,
with 1 process, with 2 DDP processes (whose output folder, staged by both and swapped in by the main one, is
complete) and with 2 FSDP2 processes (gloo; FSDP2 also equals 1 process with 2 accumulated
micro-batches, shards every parameter, and leaves a folder that loads with its Auto class). Resume problems get
pretraining's messages; Ctrl-C's hint is true; the metrics before training are reported beside the ones after; an
engine asked for but not run is refused.

The model is tiny (hidden 32, 2 layers) WITH dropout, so the restored RNG states matter; 16 training examples at
batch 4 make 6 steps cross an epoch boundary, so the restored data order matters too.
"""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ctrl_c_as_in_a_terminal, descendants, free_port, interrupt_at_marker
from ranks import fork_python, launch_ranks
from safetensors.torch import load_file
from test_finetuning import _texts
from transformers import AutoModelForSequenceClassification, set_seed

import coreformer as cf
from coreformer.training.checkpoints import CHECKPOINTS_DIR, list_checkpoints
from coreformer.training.finetuning import evaluate_folder, run_finetuning
from coreformer.training.finetuning import trainer as finetuning_trainer
from coreformer.training.finetuning.arguments import FinetuningArguments
from coreformer.training.finetuning.checkpoints import RUN_RECORD
from coreformer.training.finetuning.trainer import run_engine
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer
from coreformer_settings.base import FinetuningError

REPO = Path(__file__).resolve().parents[2]
FINETUNE = REPO / "training" / "finetune.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
RUN = dict(task="sequence-classification", max_steps=6, batch_size=4, eval_batch_size=8, max_train_examples=16)
RUN.update(max_eval_examples=8, max_length=48, lr=3e-3, logging_steps=1, seed=0, save_every=2, save_total_limit=2)
NOT_COMPARED = ("_runtime", "_per_second", "_time")  # wall-clock numbers
# One worker runs the whole file: its module fixtures (the uninterrupted and the killed run) are built once, not once
# per xdist worker.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.xdist_group("finetuning_resume"),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A saved tiny encoder (masked LM head, random weights) with dropout 0.1 and its trained tokenizer."""
    tokenizer = train_tokenizer("encoder", _texts(), 600, model_max_length=96)
    config = cf.CoreformerEncoderConfig(
        **token_config_kwargs(tokenizer, "encoder"),
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=98,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    folder = tmp_path_factory.mktemp("base") / "encoder"
    torch.manual_seed(0)
    cf.CoreformerEncoderForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def settings(base: Path, output_dir: Path, **overrides) -> FinetuningArguments:
    return FinetuningArguments(model=str(base), output_dir=str(output_dir), **{**RUN, **overrides})


def flags(base: Path, output_dir: Path, **overrides) -> list[str]:
    given = {**RUN, "model": str(base), "output_dir": str(output_dir), **overrides}
    return [part for key, value in given.items() for part in ("--" + key.replace("_", "-"), str(value))]


def child_env(tmp_path: Path) -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }


def step_losses(folder: Path) -> list[tuple[int, float]]:
    """(step, training loss) of every optimizer step, as Trainer logged them (logging_steps 1)."""
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [(entry["step"], entry["loss"]) for entry in history if "loss" in entry]


def results(folder: Path) -> dict[str, float]:
    """all_results.json without wall-clock numbers and `train_loss`, which Trainer averages over the steps of the
    last `train()` call only (steps 3-6 of a run resumed at step 2); every step's loss is compared instead."""
    values = json.loads((folder / "all_results.json").read_text())
    return {key: value for key, value in values.items() if not key.endswith(NOT_COMPARED) and key != "train_loss"}


def assert_same_run(resumed: Path, uninterrupted: Path) -> None:
    """Same per-step losses, metrics (before and after training) and final weights, bit for bit."""
    assert step_losses(resumed) == step_losses(uninterrupted)
    assert len(step_losses(resumed)) == RUN["max_steps"]
    assert results(resumed) == results(uninterrupted)
    weights, reference = load_file(resumed / "model.safetensors"), load_file(uninterrupted / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name


@pytest.fixture(scope="module")
def uninterrupted(base, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("uninterrupted") / "out"
    run_finetuning(settings(base, folder))
    return folder


# A finetune.py run whose save of checkpoint-4 stops half-way (model and optimizer written, RNG states and
# trainer_state.json not yet) for the test to SIGKILL it there.
KILLED_WHILE_SAVING = """
import pathlib, runpy, sys, time
import transformers

marker, script = pathlib.Path(sys.argv[1]), sys.argv[2]
original = transformers.Trainer._save_rng_state

def _save_rng_state(self, output_dir):
    if self.state.global_step == 4:
        if self.is_world_process_zero():
            marker.write_text("saving checkpoint 4")
        time.sleep(300)  # the test kills us here
    return original(self, output_dir)

transformers.Trainer._save_rng_state = _save_rng_state
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def kill_while_saving(command: list[str], tmp_path: Path, **env: str) -> None:
    """Run `command` (a launch of finetune.py under a wrapper that stops in the middle of saving checkpoint-4) and
    SIGKILL it and every process it started once it is there, as a machine that loses power would."""
    marker = tmp_path / "marker"
    child = subprocess.Popen(
        command,
        env={**child_env(tmp_path), **env},
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    launch = descendants(child.pid)  # the launcher, then every process under it
    workers = launch[1:]
    for pid in launch:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, stderr = child.communicate(timeout=60)
    assert marker.exists(), stderr[-3000:]
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def assert_killed_while_saving(folder: Path) -> None:
    """checkpoint-2 complete and the latest; checkpoint-4 only as Trainer's half-written hidden folder; no model."""
    assert [path.name for path in list_checkpoints(folder)] == ["step-2"]
    half = folder / CHECKPOINTS_DIR / ".saving" / "checkpoint-4"
    assert (half / "model.safetensors").is_file() and not (half / "trainer_state.json").exists()
    assert not (folder / "config.json").exists()


@pytest.fixture(scope="module")
def killed(base, tmp_path_factory) -> Path:
    """A 1-process fine-tune SIGKILLed while saving checkpoint-4 (checkpoint-2 complete)."""
    tmp_path = tmp_path_factory.mktemp("killed")
    folder = tmp_path / "out"
    command = ["-c", KILLED_WHILE_SAVING, str(tmp_path / "marker"), str(FINETUNE)] + flags(base, folder)
    fork_python(command, child_env(tmp_path), tmp_path, tmp_path / "child.log").kill_at_marker(tmp_path / "marker")
    return folder


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_as_the_latest(killed):
    assert_killed_while_saving(killed)
    record = json.loads((killed / CHECKPOINTS_DIR / "step-2" / RUN_RECORD).read_text())
    assert record["world_size"] == 1 and record["args"]["max_steps"] == RUN["max_steps"]
    assert set(record["before"]) >= {"before_eval_loss", "before_eval_accuracy"}


def test_resume_problems_are_refused_with_one_clear_message_each(base, killed, uninterrupted, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(killed, folder)
    checkpoint = folder / CHECKPOINTS_DIR / "step-2"
    cases = {
        "changed settings": (
            dict(resume_from_checkpoint="latest", max_steps=8, batch_size=2),
            r"was trained with other settings \(differs in: batch_size, max_steps\); resume with the settings",
        ),
        "another task's checkpoint": (
            dict(resume_from_checkpoint=str(checkpoint), task="multiple-choice", output_dir=str(tmp_path / "mc")),
            r"differs in: task\)",
        ),
        "missing checkpoint": (
            dict(resume_from_checkpoint=str(folder / CHECKPOINTS_DIR / "step-9")),
            r"--resume-from-checkpoint '.*step-9' does not exist\.",
        ),
        "half-written checkpoint": (
            dict(resume_from_checkpoint=str(folder / CHECKPOINTS_DIR / ".saving" / "checkpoint-4")),
            r"is not a complete checkpoint folder \(no trainer_state.json\)",
        ),
        "a run folder without --resume": (
            dict(),
            r"already holds a run\. Pass --overwrite to replace it, or --resume-from-checkpoint latest to continue it",
        ),
    }
    for overrides, message in cases.values():
        with pytest.raises(FinetuningError, match=message):
            run_finetuning(settings(base, overrides.pop("output_dir", folder), **overrides))
    record = json.loads((checkpoint / RUN_RECORD).read_text())
    (checkpoint / RUN_RECORD).write_text(json.dumps({**record, "world_size": 2}))  # as a 2-process run saves it
    with pytest.raises(FinetuningError, match=r"saved by 2 process\(es\) and this run has 1: .* Resume with 2 proc"):
        run_finetuning(settings(base, folder, resume_from_checkpoint="latest"))
    (checkpoint / RUN_RECORD).write_text(json.dumps(record))
    (folder / CHECKPOINTS_DIR / "step-2" / "trainer_state.json").unlink()  # no complete checkpoint left
    with pytest.raises(FinetuningError, match=r"holds a run but no complete checkpoint under checkpoints/\. Pass"):
        run_finetuning(settings(base, folder, resume_from_checkpoint="latest"))
    with pytest.raises(FinetuningError, match=r"is the end of a finished run \(step 6 of 6\), whose model is in"):
        run_finetuning(settings(base, uninterrupted, resume_from_checkpoint="latest"))
    assert not (tmp_path / "mc").exists() and not (folder / "config.json").exists()  # nothing written


def test_a_fine_tune_killed_mid_save_resumes_to_the_same_losses_and_weights(base, killed, uninterrupted):
    run_finetuning(settings(base, killed, resume_from_checkpoint="latest"))
    assert_same_run(killed, uninterrupted)
    # Its checkpoints are kept (the last 2) and its hidden leftover is gone.
    assert [path.name for path in list_checkpoints(killed)] == ["step-4", "step-6"]
    assert sorted(path.name for path in (killed / CHECKPOINTS_DIR).iterdir()) == ["step-4", "step-6"]


def test_metrics_before_training_are_those_of_the_untrained_model(base, uninterrupted, tmp_path):
    values = results(uninterrupted)
    before = {key.removeprefix("before_"): value for key, value in values.items() if key.startswith("before_")}
    assert set(before) == {"eval_loss", "eval_accuracy", "eval_precision", "eval_recall", "eval_f1"}
    # Reference: the untrained model built independently (the same seeded head) and evaluated on the same split.
    config = json.loads((uninterrupted / "config.json").read_text())
    labels = {int(index): name for index, name in config["id2label"].items()}
    set_seed(RUN["seed"])
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=len(labels), id2label=labels, label2id={name: index for index, name in labels.items()}
    )
    model.save_pretrained(tmp_path / "untrained")
    shutil.copy(base / "tokenizer.json", tmp_path / "untrained")
    shutil.copy(base / "tokenizer_config.json", tmp_path / "untrained")
    reference, _ = evaluate_folder(tmp_path / "untrained", settings(base, tmp_path / "unused"))
    assert before == {key: reference[key] for key in before}
    assert before["eval_loss"] != values["eval_loss"]  # and the after numbers are another model's
    eval_results = json.loads((uninterrupted / "eval_results.json").read_text())
    assert eval_results["before_eval_loss"] == values["before_eval_loss"]


def test_the_evaluation_before_training_leaves_training_unchanged(base, uninterrupted, tmp_path, monkeypatch):
    # Reference: the same run with Trainer's evaluation at the start turned off (and so no `before_` metrics).
    original = finetuning_trainer._training_arguments
    monkeypatch.setattr(
        finetuning_trainer, "_training_arguments", lambda args, output_dir, _: original(args, output_dir, False)
    )
    reference = tmp_path / "without"
    run_finetuning(settings(base, reference))
    assert not any(key.startswith("before_") for key in results(reference))
    assert step_losses(uninterrupted) == step_losses(reference)
    assert results(uninterrupted)["eval_loss"] == results(reference)["eval_loss"]


INTERRUPTED_AFTER_A_CHECKPOINT = """
import pathlib, runpy, sys, time
import transformers

marker, script = pathlib.Path(sys.argv[1]), sys.argv[2]
original = transformers.Trainer.training_step

def training_step(self, *args, **kwargs):
    if self.state.global_step == 3:  # checkpoint-2 saved, step 3 done
        marker.write_text("in step 4")
        time.sleep(300)  # the test presses Ctrl-C here
    return original(self, *args, **kwargs)

transformers.Trainer.training_step = training_step
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def test_ctrl_c_after_a_checkpoint_hints_a_resume_that_works(base, uninterrupted, tmp_path):
    folder, marker = tmp_path / "out", tmp_path / "marker"
    command = [sys.executable, "-c", INTERRUPTED_AFTER_A_CHECKPOINT, str(marker), str(FINETUNE)]
    child = subprocess.Popen(
        command + flags(base, folder),
        env=child_env(tmp_path),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    returncode, stderr = interrupt_at_marker(child, marker)
    assert returncode == 130, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    hint = "continue with --resume-from-checkpoint latest (from its checkpoint at step 2)"
    assert last == f"finetune.py: stopped at step 3; {hint}"
    run_finetuning(settings(base, folder, resume_from_checkpoint="latest"))
    assert_same_run(folder, uninterrupted)


def two_processes() -> list[str]:
    """The `accelerate launch` flags of 2 CPU processes (gloo), on a port of their own."""
    launcher = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    return launcher + ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]


@pytest.mark.slow
def test_two_process_fine_tune_killed_mid_save_resumes_to_the_same_losses_and_weights(base, tmp_path):
    env = {**child_env(tmp_path), "ACCELERATE_USE_CPU": "1"}
    wrapper = tmp_path / "killed_while_saving.py"
    wrapper.write_text(KILLED_WHILE_SAVING)

    # Every run's ranks are forked as `accelerate launch` starts them (ranks.py); the FSDP2 fixture below kills a real
    # launch.
    reference, log = tmp_path / "uninterrupted", tmp_path / "launch.log"
    ranks = launch_ranks(two_processes(), [str(FINETUNE)] + flags(base, reference), env, tmp_path, log)
    assert ranks.wait(timeout=300) == 0, log.read_text()[-4000:]
    # Both processes train into one staged folder; only the main one writes and swaps it in, so the folder is
    # complete whichever process finishes last.
    assert {"config.json", "model.safetensors", "README.md", "all_results.json"} <= {
        p.name for p in reference.iterdir()
    }
    assert not list(tmp_path.glob(".uninterrupted.*"))
    AutoModelForSequenceClassification.from_pretrained(reference)  # complete and loadable

    folder = tmp_path / "out"
    script = [str(wrapper), str(tmp_path / "marker"), str(FINETUNE)] + flags(base, folder)
    launch_ranks(two_processes(), script, env, tmp_path, log).kill_at_marker(tmp_path / "marker")
    assert_killed_while_saving(folder)
    assert sorted(path.name for path in (folder / CHECKPOINTS_DIR / "step-2").glob("rng_state*")) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]
    with pytest.raises(FinetuningError, match=r"saved by 2 process\(es\) and this run has 1: Trainer continues"):
        run_finetuning(settings(base, folder, resume_from_checkpoint="latest"))

    resume = [str(FINETUNE)] + flags(base, folder, resume_from_checkpoint="latest")
    ranks = launch_ranks(two_processes(), resume, env, tmp_path, log)
    assert ranks.wait(timeout=300) == 0, log.read_text()[-4000:]
    assert_same_run(folder, reference)


KILLED_IN_THE_FINAL_SAVE = """
import pathlib, runpy, sys, time
import coreformer.training.finetuning

marker, script = pathlib.Path(sys.argv[1]), sys.argv[2]

def save_with_pipeline(*args, **kwargs):  # trained, checkpointed and evaluated; the final folder is being written
    marker.write_text("saving")
    time.sleep(300)  # the test kills us here

coreformer.training.finetuning.save_with_pipeline = save_with_pipeline
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def test_a_rerun_killed_in_its_final_save_keeps_the_previous_model_and_resumes_from_its_own_checkpoints(
    base, uninterrupted, tmp_path
):
    folder = tmp_path / "out"
    shutil.copytree(uninterrupted, folder)
    previous = {name: (folder / name).read_bytes() for name in ("model.safetensors", "config.json", "all_results.json")}
    command = ["-c", KILLED_IN_THE_FINAL_SAVE, str(tmp_path / "marker"), str(FINETUNE)]
    command += flags(base, folder, max_steps=4) + ["--overwrite"]
    fork_python(command, child_env(tmp_path), tmp_path, tmp_path / "child.log").kill_at_marker(tmp_path / "marker")

    # The final model is still the previous run's; the checkpoints are the rerun's (its first save replaced them).
    assert {name: (folder / name).read_bytes() for name in previous} == previous
    assert [path.name for path in list_checkpoints(folder)] == ["step-2", "step-4"]
    last = folder / CHECKPOINTS_DIR / "step-4"
    assert json.loads((last / RUN_RECORD).read_text())["args"]["max_steps"] == 4
    # Its end is not mistaken for a finished run (the final folder there is another run's): resuming writes it.
    run_finetuning(settings(base, folder, max_steps=4, resume_from_checkpoint="latest"))
    assert step_losses(folder) == step_losses(last) and len(step_losses(folder)) == 4
    weights, reference = load_file(folder / "model.safetensors"), load_file(last / "model.safetensors")
    assert all(torch.equal(weights[name], tensor) for name, tensor in reference.items())
    assert not list(tmp_path.glob(".out.*"))  # the killed rerun's staging folder is cleaned up


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2 on CPU processes (engine.py's CpuFsdp2Engine under Trainer: finetuning/checkpoints.py shard_with)
# ---------------------------------------------------------------------------------------------------------------------

ACCELERATE_CONFIGS = REPO / "training" / "configs" / "accelerate"
# 2 FSDP2 processes reduce-scatter what 1 process with 2 accumulated micro-batches sums: the same numbers in another
# order. Measured: per-step losses and final weights identical (difference 0.0); allowed: 1e-6.
FSDP_TOLERANCE = 1e-6

# finetune.py launched through this: each rank reports how FSDP holds every parameter once Trainer's model is sharded,
# and with a marker path the run stops forever in the middle of saving checkpoint-4 (model and DCP shards written,
# RNG states and trainer_state.json not) for the test to SIGKILL it there.
FSDP_CHILD = """
import json, pathlib, runpy, sys, time
import transformers
from coreformer.training.finetuning import checkpoints as trainer_checkpoints

report, marker, script = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
shard_with, save_rng_state = trainer_checkpoints._AtomicCheckpoints.shard_with, transformers.Trainer._save_rng_state

def reporting_shard_with(self, engine):
    shard_with(self, engine)
    held = {name: [str(p.placements), p.to_local().numel(), list(p.shape)] for name, p in self.model.named_parameters()}
    (report / f"rank{self.accelerator.process_index}.json").write_text(json.dumps(held))

def stopping_save_rng_state(self, output_dir):
    if marker != "-" and self.state.global_step == 4:
        if self.is_world_process_zero():
            pathlib.Path(marker).write_text("saving checkpoint 4")
        time.sleep(300)  # the test kills us here
    return save_rng_state(self, output_dir)

trainer_checkpoints._AtomicCheckpoints.shard_with = reporting_shard_with
transformers.Trainer._save_rng_state = stopping_save_rng_state
sys.argv = [script] + sys.argv[4:]
runpy.run_path(script, run_name="__main__")
"""


def fsdp_launcher() -> list[str]:
    """The `accelerate launch` flags of the FSDP config users pass for GPUs, on 2 CPU processes."""
    launcher = ["--config_file", str(ACCELERATE_CONFIGS / "fsdp.yaml"), "--num_processes", "2", "--num_machines", "1"]
    return launcher + ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]


def fsdp_script(child: Path, report: Path, marker: str, arguments: list[str]) -> list[str]:
    """finetune.py with `arguments`, through FSDP_CHILD."""
    return [str(child), str(report), marker, str(FINETUNE)] + arguments


@pytest.fixture(scope="module")
def fsdp(base, tmp_path_factory):
    """On a copy of `base` without dropout (2 processes draw other dropout masks than 1): an uninterrupted 2-process
    FSDP2 fine-tune, one SIGKILLed while saving checkpoint-4 then resumed (`latest`), and the 1-process reference
    with 2 accumulated micro-batches per step. The launches overlap the in-process reference."""
    tmp = tmp_path_factory.mktemp("fsdp")
    plain = tmp / "base"
    shutil.copytree(base, plain)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "hidden_dropout": 0.0, "attention_dropout": 0.0}))
    child = tmp / "fsdp_child.py"
    child.write_text(FSDP_CHILD)
    env = {**child_env(tmp), "ACCELERATE_USE_CPU": "1"}
    for name in ("uninterrupted", "killed"):
        (tmp / f"{name}-shards").mkdir()
    uninterrupted, killed = tmp / "uninterrupted", tmp / "killed"
    # The killed run is a real launch, SIGKILLed with every process under it; the other two runs' ranks are forked
    # as the launch would start them (ranks.py).
    script = fsdp_script(child, tmp / "uninterrupted-shards", "-", flags(plain, uninterrupted))
    running = launch_ranks(fsdp_launcher(), script, env, tmp, tmp / "uninterrupted.log")
    resumed = None
    try:
        marker = str(tmp / "marker")
        command = [str(ACCELERATE), "launch", *fsdp_launcher()]
        kill_while_saving(command + fsdp_script(child, tmp / "killed-shards", marker, flags(plain, killed)), tmp, **env)
        killed_state = {
            "checkpoints": [path.name for path in list_checkpoints(killed)],
            "half": sorted(p.name for p in (killed / CHECKPOINTS_DIR / ".saving" / "checkpoint-4").iterdir()),
            "final": (killed / "config.json").exists(),
        }
        script = fsdp_script(child, tmp / "killed-shards", "-", flags(plain, killed, resume_from_checkpoint="latest"))
        resumed = launch_ranks(fsdp_launcher(), script, env, tmp, tmp / "resumed.log")
        one = tmp / "one"
        run_finetuning(settings(plain, one, grad_accum=2))
        assert resumed.wait(timeout=300) == 0, (tmp / "resumed.log").read_text()[-4000:]
        assert running.wait(timeout=300) == 0, (tmp / "uninterrupted.log").read_text()[-4000:]
    finally:
        for launched in (running, resumed):
            if launched is not None:
                launched.kill()
    shards = [json.loads((tmp / "uninterrupted-shards" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    log = (tmp / "uninterrupted.log").read_text()
    return SimpleNamespace(
        base=plain, uninterrupted=uninterrupted, killed=killed, one=one, state=killed_state, shards=shards, log=log
    )


@pytest.mark.slow
def test_fsdp2_fine_tune_on_two_processes_matches_one_process_with_two_micro_batches(fsdp):
    losses, reference = step_losses(fsdp.uninterrupted), step_losses(fsdp.one)
    assert [step for step, _ in losses] == [step for step, _ in reference] == list(range(1, RUN["max_steps"] + 1))
    assert max(abs(a - b) for (_, a), (_, b) in zip(losses, reference)) <= FSDP_TOLERANCE
    weights, expected = load_file(fsdp.uninterrupted / "model.safetensors"), load_file(fsdp.one / "model.safetensors")
    assert weights.keys() == expected.keys()
    assert all(torch.allclose(weights[name], expected[name], atol=FSDP_TOLERANCE) for name in expected)
    before = results(fsdp.uninterrupted)["before_eval_loss"]
    assert before == pytest.approx(results(fsdp.one)["before_eval_loss"], abs=FSDP_TOLERANCE)


@pytest.mark.slow
def test_fsdp2_fine_tune_shards_every_parameter_across_the_ranks(fsdp):
    ranks = fsdp.shards
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) > 10
    held, everything = 0, 0
    for name, (placements, local, shape) in ranks[0].items():
        assert placements == ranks[1][name][0] == "(Shard(dim=0),)", name
        rows, total = shape[0], math.prod(shape)
        # rows split as torch.chunk splits them: rank 0 the first ceil(rows / 2), rank 1 the rest
        assert (local, ranks[1][name][1]) == (math.ceil(rows / 2) * total // rows, total - local), name
        held, everything = held + local, everything + total
    assert 0.5 <= held / everything < 0.51  # odd row counts leave rank 0 one row more


@pytest.mark.slow
def test_fsdp2_fine_tune_records_the_engine_that_ran(fsdp):
    engine = json.loads((fsdp.uninterrupted / "all_results.json").read_text())["engine"]
    assert engine == {
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
    assert json.loads((fsdp.uninterrupted / "train_results.json").read_text())["engine"] == engine
    line = "engine: FSDP (FSDP2 full shard, set up by coreformer's fully_shard inside Accelerate), 2 process(es) on 1"
    assert line in fsdp.log
    single = json.loads((fsdp.one / "all_results.json").read_text())["engine"]
    assert (single["distributed_type"], single["sharding"], single["world_size"]) == ("NO", "none", 1)


@pytest.mark.slow
def test_fsdp2_final_folder_is_consolidated_and_loads_with_its_auto_class(fsdp):
    folder = fsdp.uninterrupted
    assert json.loads((folder / "config.json").read_text())["architectures"] == [
        "CoreformerEncoderForSequenceClassification"
    ]
    assert not list(folder.rglob("_fsdp*.py"))  # FSDP's class never reaches save_pretrained's code copy
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    saved = load_file(folder / "model.safetensors")
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in saved.items())
    metrics, _ = evaluate_folder(folder, settings(fsdp.base, folder))  # reloaded on 1 process: the same evaluation
    assert metrics["eval_loss"] == pytest.approx(results(folder)["eval_loss"], abs=1e-6)


@pytest.mark.slow
def test_fsdp2_fine_tune_killed_mid_save_resumes_to_the_same_losses_and_weights(fsdp):
    assert fsdp.state["checkpoints"] == ["step-2"] and not fsdp.state["final"]
    assert {"model.safetensors", "dcp"} <= set(fsdp.state["half"]) and "trainer_state.json" not in fsdp.state["half"]
    assert_same_run(fsdp.killed, fsdp.uninterrupted)
    dcp = fsdp.killed / CHECKPOINTS_DIR / "step-6" / "dcp"
    assert (dcp / ".metadata").is_file()
    assert sorted(path.name for path in dcp.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


class FakeTrainer:
    """What run_engine reads of a Trainer: its Accelerator's distributed type, process count and backend."""

    def __init__(self, kind: str, processes: int = 2) -> None:
        from accelerate.utils import DistributedType

        state = SimpleNamespace(backend="gloo" if processes > 1 else None)
        self.accelerator = SimpleNamespace(distributed_type=DistributedType(kind), num_processes=processes, state=state)
        self.sharded = None

    def shard_with(self, engine) -> None:
        self.sharded = engine

    def is_world_process_zero(self) -> bool:
        return False


FSDP_LAUNCH = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    "environ, kind, processes, overrides, message",
    [
        (
            {**FSDP_LAUNCH, "FSDP_VERSION": "1"},
            "MULTI_CPU",
            2,
            {},
            r"version 1, which Accelerate does not set up on CPU",
        ),
        ({**FSDP_LAUNCH, "WORLD_SIZE": "1"}, "NO", 1, {}, r"asked for FSDP, but Accelerate set up a single process"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2"}, "MULTI_CPU", 2, {}, r"asked for DeepSpeed, but"),
        (FSDP_LAUNCH, "MULTI_CPU", 2, {"peft": "lora"}, r"--peft lora under FSDP2 on CPU processes is not supported"),
    ],
    ids=["fsdp1-on-cpu", "fsdp-one-process", "deepspeed-on-cpu", "lora"],
)
def test_an_engine_asked_for_but_not_run_is_refused(
    base, tmp_path, monkeypatch, environ, kind, processes, overrides, message
):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    trainer = FakeTrainer(kind, processes)
    with pytest.raises(FinetuningError, match=message):
        run_engine(trainer, settings(base, tmp_path / "out", **overrides), None)
    assert trainer.sharded is None


def test_fsdp2_on_cpu_processes_shards_and_ddp_stays_ddp(base, tmp_path, monkeypatch):
    for name, value in FSDP_LAUNCH.items():
        monkeypatch.setenv(name, value)
    trainer = FakeTrainer("MULTI_CPU")
    engine = run_engine(trainer, settings(base, tmp_path / "out"), None)
    assert trainer.sharded is engine and (engine.set_up_by, engine.checkpoint_format) == ("coreformer", "dcp")
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    ddp = FakeTrainer("MULTI_CPU")
    assert run_engine(ddp, settings(base, tmp_path / "out"), None).sharding == "DDP" and ddp.sharded is None


def test_a_checkpoint_of_another_engine_is_refused(base, tmp_path, monkeypatch):
    # A DDP launch resuming an FSDP2 checkpoint (DCP shards, no optimizer.pt for Trainer to read), and the reverse.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    args = settings(base, tmp_path / "out", resume_from_checkpoint=str(tmp_path / "out" / "checkpoints" / "step-2"))
    message = r"another engine's checkpoint format \(this run is MULTI_CPU, DDP\) \(differs in: checkpoint format\)"
    with pytest.raises(FinetuningError, match=message):
        run_engine(FakeTrainer("MULTI_CPU"), args, {"engine": {"checkpoint_format": "dcp"}})
    for name, value in FSDP_LAUNCH.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(FinetuningError, match=r"differs in: checkpoint format"):
        run_engine(FakeTrainer("MULTI_CPU"), args, {"engine": {"checkpoint_format": "accelerate"}})
    with pytest.raises(FinetuningError, match=r"differs in: checkpoint format"):  # recorded before engines were
        run_engine(FakeTrainer("MULTI_CPU"), args, {})


def test_seq2seq_evaluation_gathers_generations_without_the_copies_that_fill_the_last_batch(tmp_path, monkeypatch):
    # Seq2SeqTrainer gathers with accelerator.gather, which keeps the copies Accelerate's even_batches adds on every
    # process but the first (2 processes: 8 validation examples came back as 16 prediction rows, DDP and FSDP2);
    # gather_for_metrics drops them. One process here: the gather the trainer calls is what is checked.
    from tiny import tiny_model
    from transformers import Seq2SeqTrainingArguments

    from coreformer.training.finetuning.checkpoints import CheckpointingSeq2SeqTrainer

    model = tiny_model(cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq")
    rows = [{"input_ids": [5 + i, 6, 7, 2], "labels": [8, 9 + i, 2]} for i in range(3)]
    training = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=2, predict_with_generate=True, generation_max_length=4
    )
    trainer = CheckpointingSeq2SeqTrainer(model=model, args=training, data_collator=_pad_rows)
    gathered = []
    original = trainer.accelerator.gather_for_metrics

    def gather_for_metrics(data, *args, **kwargs):
        gathered.append(tuple(data.shape))
        return original(data, *args, **kwargs)

    monkeypatch.setattr(trainer.accelerator, "gather_for_metrics", gather_for_metrics)
    output = trainer.predict(rows)
    assert output.predictions.shape[0] == 3
    # the losses, generations and labels of each of the 2 batches went through gather_for_metrics
    assert len(gathered) == 6, gathered


def _pad_rows(rows: list[dict]) -> dict:
    """input_ids padded with 0 (attention mask beside), labels with -100."""
    longest = {key: max(len(row[key]) for row in rows) for key in ("input_ids", "labels")}
    return {
        "input_ids": torch.tensor(
            [row["input_ids"] + [0] * (longest["input_ids"] - len(row["input_ids"])) for row in rows]
        ),
        "attention_mask": torch.tensor(
            [[1] * len(row["input_ids"]) + [0] * (longest["input_ids"] - len(row["input_ids"])) for row in rows]
        ),
        "labels": torch.tensor([row["labels"] + [-100] * (longest["labels"] - len(row["labels"])) for row in rows]),
    }
