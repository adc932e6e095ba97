"""Each run's torch threads: the flag, then OMP_NUM_THREADS, then what the machine can give the process (its cores
shared by the node's processes, less those other processes keep busy), said on the engine line."""

import subprocess
import sys
import time

import pytest
import torch

from coreformer.training.engine import requested_engine
from coreformer.training.threads import CpuTimes, busy_cores, choose_threads, others_busy


def test_the_flag_then_the_environment_decide_before_the_machine():
    assert choose_threads(3, {"OMP_NUM_THREADS": "1"}, cores=2, load=0.0).threads == 3
    chosen = choose_threads(None, {"OMP_NUM_THREADS": "1"}, cores=8, load=0.0)
    assert (chosen.threads, chosen.reason) == (1, "OMP_NUM_THREADS")


@pytest.mark.parametrize(
    ("cores", "load", "processes", "threads"),
    [
        (2, 0.0, 1, 2),  # a quiet machine: every core
        (2, 1.0, 1, 1),  # beside one busy process: the core it leaves
        (2, 0.4, 1, 2),  # a little background work is not a core
        (2, 5.0, 1, 1),  # an overloaded machine still gets one thread
        (8, 0.0, 2, 4),  # two processes of one node share the cores
        (8, 6.0, 2, 2),  # ... and what other work leaves of them
    ],
)
def test_without_either_the_cores_left_to_this_process(cores, load, processes, threads):
    chosen = choose_threads(None, {"LOCAL_WORLD_SIZE": str(processes)}, cores=cores, load=load)
    assert chosen.threads == threads
    assert "--threads N or OMP_NUM_THREADS to choose" in chosen.reason


def test_the_runs_own_time_is_not_counted_as_other_work():
    before = CpuTimes(total=1000, idle=600, own=0)
    # over 200 ticks of 2 cores: 100 idle, 100 busy of which this process's own 60 -> 40 ticks others, 0.4 cores
    assert others_busy(before, CpuTimes(total=1200, idle=700, own=60), cores=2) == pytest.approx(0.4)
    assert others_busy(before, CpuTimes(total=1200, idle=700, own=100), cores=2) == 0.0
    assert others_busy(before, before, cores=2) == 0.0  # no time passed


@pytest.mark.skipif(sys.platform != "linux", reason="busy_cores reads /proc, which Linux has")
def test_a_busy_process_beside_the_run_is_counted():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        assert busy_cores() >= 0.6  # one process spinning: about a core
    finally:
        busy.kill()
        busy.wait()


def test_the_engine_line_says_the_threads():
    from coreformer.training.engine import Engine

    engine = Engine("NO", 1, 1, "none", "no", None, "accelerate", requested_engine({}))
    threads = torch.get_num_threads()
    try:
        line = engine.line(choose_threads(None, {}, cores=2, load=1.0).apply())
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert line.endswith(", 1 thread (of 2 cores, 1.0 busy with other work; --threads N or OMP_NUM_THREADS to choose)")
