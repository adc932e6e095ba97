"""Test processes forked from one server per test process that imported the training code once (multiprocessing's
forkserver), instead of fresh interpreters: the processes of an `accelerate launch` (`launch_ranks`), for the tests
whose check is what the ranks compute (FSDP2 against one process, a DCP checkpoint resharded), and a single
`python -c CODE ...` or `python SCRIPT ...` (`fork_python`), for the tests whose check is what a run killed or
interrupted (Ctrl-C) leaves on disk and prints, or a fresh Dynamo state.

A fresh interpreter spends about 8 CPU-seconds importing torch, transformers and coreformer before its tiny run (a
launcher about 3 more); on the suite's 2 cores that was most of what these tests cost. Each rank gets the environment
the launch would give it: Accelerate's own launcher code reads the same flags and config file
(`prepare_multi_gpu_env`), and the variables torchrun adds per rank are set as torchrun sets them, with rank 0 hosting
the rendezvous store instead of an agent (tests/test_run_launch.py compares both with a real launch). The tests that
check a launch or a fresh interpreter (its refusals, a SIGKILL of a launcher's process tree, loading without
coreformer imported, the README's commands) still start them.

    ranks = launch_ranks(["--config_file", "fsdp.yaml", "--num_processes", "2"], [script, *flags], env, cwd, log)
    assert ranks.wait(timeout=600) == 0
    child = fork_python(["-c", CODE, *argv], env, cwd, log)
    child.kill_at_marker(marker)  # or: exit_code, stderr = child.interrupt_at_marker(marker)
    pretraining_killed_at_step(arguments, 12, folder)  # a run SIGKILLed before its 13th step
"""

import dataclasses
import json
import multiprocessing
import os
import runpy
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env

# What a rank of pretrain.py or finetune.py imports, imported once in the server the ranks are forked from.
PRELOAD = ["coreformer.training.pretraining", "coreformer.training.finetuning", "coreformer_cli"]
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(PRELOAD)


def rank_environments(launcher: list[str], env: dict[str, str]) -> list[dict[str, str]]:
    """The environment of each process `accelerate launch LAUNCHER script` would start on this machine, with `env` as
    the launcher's own."""
    args = launch_command_parser().parse_args([*launcher, "script.py"])
    with mock.patch.dict(os.environ, env, clear=True):
        args, _, _ = _validate_launch_command(args)
        launch_env = prepare_multi_gpu_env(args)
    per_node, nodes, node = int(args.nproc_per_node), int(getattr(args, "nnodes", 1)), int(args.machine_rank or 0)
    torchrun = {
        "MASTER_ADDR": args.main_process_ip or "127.0.0.1",
        "MASTER_PORT": str(args.main_process_port),
        "WORLD_SIZE": str(per_node * nodes),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(per_node * nodes),
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",  # no agent: rank 0 hosts the store
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    ranks = [node * per_node + local for local in range(per_node)]
    return [
        {**launch_env, **torchrun, "RANK": str(rank), "ROLE_RANK": str(rank), "LOCAL_RANK": str(local)}
        for local, rank in enumerate(ranks)
    ]


def _run_python(args: list[str], env: dict[str, str], cwd: str, log: str, stdout: str) -> None:
    """`python ARGS...` (`-c CODE ...` or `SCRIPT ...`) in `cwd` with `env`, its stderr appended to `log` and its
    stdout to `stdout` (runs in the forked process)."""
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read by torch when it is imported, which the server did
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    # Ctrl-C raises KeyboardInterrupt, as in an interpreter started in a terminal's foreground (the server may have
    # been started with SIGINT ignored, as a CI runner's background jobs are)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.dup2(os.open(stdout, os.O_WRONLY | os.O_APPEND | os.O_CREAT), 1)
    os.dup2(os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT), 2)
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")


class Processes:
    """Forked processes that end together: like a launcher, it fails as soon as one fails and stops the rest."""

    def __init__(self, processes: list[multiprocessing.Process], log: Path) -> None:
        self.processes, self.log = processes, log

    def poll(self) -> int | None:
        codes = [process.exitcode for process in self.processes]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            self.kill()
            return failed[0]
        return None if None in codes else 0

    def wait(self, timeout: float = 600) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"the forked processes ran past {timeout:g} s")
            time.sleep(0.05)
        return code

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join(timeout=60)

    def kill_at_marker(self, marker: Path, timeout: float = 240) -> None:
        """Wait until a process writes `marker` (in the middle of a save, say), then SIGKILL them all."""
        self._wait_for(marker, timeout)
        self.kill()

    def interrupt_at_marker(self, marker: Path, timeout: float = 240) -> tuple[int, str]:
        """Wait until a process writes `marker`, send them all SIGINT (Ctrl-C), and return (the exit code, the
        log)."""
        self._wait_for(marker, timeout)
        for process in self.processes:
            os.kill(process.pid, signal.SIGINT)
        return self.wait(timeout=120), Path(self.log).read_text()

    def _wait_for(self, marker: Path, timeout: float) -> None:
        """Return once `marker` exists; fail (stopping them) with the log's end if the processes ended first."""
        deadline = time.monotonic() + timeout
        while not marker.exists() and self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not marker.exists():
            ended = self.poll() is not None
            self.kill()
            pytest.fail(Path(self.log).read_text()[-3000:] if ended else f"no {marker.name} after {timeout:g} s")


def _start(
    args: list[str], environments: list[dict[str, str]], cwd: Path, log: Path, stdout: Path | None = None
) -> Processes:
    output = (str(log), str(stdout or log))
    processes = [_FORKSERVER.Process(target=_run_python, args=(args, env, str(cwd), *output)) for env in environments]
    for process in processes:
        process.start()
    return Processes(processes, log)


def launch_ranks(launcher: list[str], argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> Processes:
    """Start the processes of `accelerate launch LAUNCHER ARGV...`, each writing to `log`."""
    return _start(argv, rank_environments(launcher, env), cwd, log)


def fork_python(args: list[str], env: dict[str, str], cwd: Path, log: Path, *, stdout: Path | None = None) -> Processes:
    """Start `python ARGS...` (`-c CODE ...` or `SCRIPT ...`) as one process, writing to `log` (its stdout to
    `stdout` where given)."""
    return _start(args, [env], cwd, log, stdout)


# A pretraining run (`coreformer pretrain --config FILE`) that SIGKILLs itself as it is about to take step argv[1] + 1:
# no handler runs, nothing is flushed, as when the machine or the scheduler kills it.
KILLED_AT_STEP = """
import importlib, json, os, signal, sys
import coreformer.training.pretraining.loop as pretraining_loop
import coreformer_cli

step, original = int(sys.argv[1]), pretraining_loop.train_step
for name, value in json.loads(sys.argv[3]).items():  # "module:attribute" -> value, as a test's monkeypatch sets it
    module, attribute = name.split(":")
    setattr(importlib.import_module(module), attribute, value)

def train_step(run, training):
    if training.step == step:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(run, training)

pretraining_loop.train_step = train_step  # where `train` looks it up
coreformer_cli.main(["pretrain", "--config", sys.argv[2]])
"""


def pretraining_killed_at_step(arguments, step: int, folder: Path, patches: dict | None = None) -> None:
    """Run `arguments` (PretrainingArguments) in a forked process with one torch thread, killed (SIGKILL) after `step`
    steps and the checkpoints they saved; fails with the log's end unless the kill is what ended it. `patches`:
    {"module:attribute": value} set in the process before the run (what the test monkeypatches in its own)."""
    config = folder / "killed-run.json"
    config.write_text(json.dumps(dataclasses.asdict(arguments)))
    log = folder / "killed-run.log"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    child = fork_python(
        ["-c", KILLED_AT_STEP, str(step), str(config), json.dumps(patches or {})], environment, folder, log
    )
    assert child.wait(timeout=300) == -signal.SIGKILL, log.read_text()[-3000:]
