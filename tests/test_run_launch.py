"""The tests' launch helpers: conftest.run_launch reaches every process of a launch when it has to stop one, and
ranks.py starts the processes a launch starts, with the environment the launch gives them, and stops them all when one
fails."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import descendants, free_port
from ranks import launch_ranks

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
# What a rank sees, written where the test reads it; it imports nothing heavy, so the real launch costs little.
WRITE_ENVIRONMENT = """
import json, os, pathlib, sys
pathlib.Path(sys.argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
"""
# torchrun's own bookkeeping, which a launch without its agent has no use for: the agent's error file and signals, and
# whether the rendezvous store is the agent's (there, rank 0 hosts it).
AGENT_ONLY = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE"}

# A launcher whose worker runs in a session of its own, as torch's elastic agent starts its workers.
LAUNCHER = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
    "time.sleep(120)"
)


def test_descendants_finds_a_worker_that_left_the_launchers_session():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER])
    try:
        deadline = time.monotonic() + 30
        while len(found := descendants(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert found[0] == launcher.pid and len(found) == 2
        assert os.getsid(found[1]) != os.getsid(launcher.pid)  # out of reach of a kill by session
    finally:
        for pid in reversed(descendants(launcher.pid)):
            os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher",
    [
        ["--config_file", str(REPO / "training" / "configs" / "accelerate" / "fsdp.yaml"), "--num_processes", "2"],
        ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "bf16"],
    ],
    ids=["fsdp-config", "ddp-flags"],
)
def test_forked_ranks_get_the_environment_accelerate_launch_gives_its_ranks(launcher, tmp_path):
    script = tmp_path / "write_environment.py"
    script.write_text(WRITE_ENVIRONMENT)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    launcher = [*launcher, "--main_process_port", str(free_port())]
    seen = {}
    for way in ("launched", "forked"):
        (tmp_path / way).mkdir()
        if way == "launched":
            command = [str(ACCELERATE), "launch", *launcher, str(script), str(tmp_path / way)]
            result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stderr[-3000:]
        else:
            ranks = launch_ranks(launcher, [str(script), str(tmp_path / way)], env, tmp_path, tmp_path / "log")
            assert ranks.wait(timeout=120) == 0, (tmp_path / "log").read_text()[-3000:]
        seen[way] = [json.loads((tmp_path / way / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for launched, forked in zip(seen["launched"], seen["forked"]):
        assert {key: value for key, value in launched.items() if key not in AGENT_ONLY} == {
            key: value for key, value in forked.items() if key not in AGENT_ONLY
        }
    assert seen["forked"][1]["RANK"] == "1" and seen["forked"][1]["ACCELERATE_USE_CPU"] == "1"


def test_forked_ranks_stop_together_when_one_fails_and_the_failure_is_the_exit_code(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(120)\n")
    launcher = ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    ranks = launch_ranks(launcher, [str(script)], dict(os.environ), tmp_path, tmp_path / "log")
    assert ranks.wait(timeout=60) == 3
    assert all(process.exitcode is not None for process in ranks.processes)  # rank 0 did not sleep on
