"""The processes of an `accelerate launch`, started without the launcher: for the multi-process tests whose check is
what the ranks compute (FSDP2 against one process, a DCP checkpoint resharded), not the launch itself.

Each rank of a real launch is a fresh interpreter that spends about 8 CPU-seconds importing torch, transformers and
coreformer before its tiny run, and the launcher about 3 more; on the suite's 2 cores that was most of what these
tests cost. Here the ranks are forked from one server per test process that imported the training code once
(multiprocessing's forkserver), and each rank gets the environment the launch would give it: Accelerate's own launcher
code reads the same flags and config file (`prepare_multi_gpu_env`), and the variables torchrun adds per rank are set
as torchrun sets them, with rank 0 hosting the rendezvous store instead of an agent. The tests that check the launch
(its refusals, a SIGKILL of the whole process tree, the README's commands) still run `accelerate launch`.

    ranks = launch_ranks(["--config_file", "fsdp.yaml", "--num_processes", "2"], [script, *flags], env, cwd, log)
    assert ranks.wait(timeout=600) == 0
"""

import multiprocessing
import os
import runpy
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env

# What a rank of pretrain.py or finetune.py imports, imported once in the server the ranks are forked from.
PRELOAD = ["coreformer.training.pretraining", "coreformer.training.finetuning", "coreformer_commands"]
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


def _run_rank(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """A rank: `python ARGV...` in `cwd` with `env`, its output appended to `log` (runs in the forked process)."""
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read by torch when it is imported, which the server did
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    output = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(output, 1)
    os.dup2(output, 2)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


class Ranks:
    """The forked processes of one launch; like a launcher, it fails as soon as one rank fails and stops the rest."""

    def __init__(self, processes: list[multiprocessing.Process]) -> None:
        self.processes = processes

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
                raise TimeoutError(f"the ranks ran past {timeout:g} s")
            time.sleep(0.05)
        return code

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join(timeout=60)


def launch_ranks(launcher: list[str], argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> Ranks:
    """Start the processes of `accelerate launch LAUNCHER ARGV...`, each writing to `log`."""
    processes = [
        _FORKSERVER.Process(target=_run_rank, args=(argv, rank_env, str(cwd), str(log)))
        for rank_env in rank_environments(launcher, env)
    ]
    for process in processes:
        process.start()
    return Ranks(processes)
