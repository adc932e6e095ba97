"""How many threads each process of a run gives torch: what the machine can give it, decided once at the start and
said on the engine line.

    choose_threads(requested, environ) -> ThreadChoice    the flag, the environment, or what the machine can give
    ThreadChoice.apply()                                  torch.set_num_threads, and the words for the engine line

torch's default is one thread per core whatever else runs: beside one busy process on 2 cores, its 2 threads wait on
each other (benchmarks/results/threads.md). In order:

    --threads N              the run's flag
    OMP_NUM_THREADS          the environment, as torch itself reads it (torchrun sets 1 per process)
    otherwise                the cores this process may run on (its CPU affinity), shared among this node's processes
                             (LOCAL_WORLD_SIZE), less the cores other processes keep busy right now (/proc/stat over
                             a quarter second, this process's own time left out; not the load average, in which a run
                             that just ended lingers for a minute); at least 1
"""

import os
import time
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    """The threads chosen, and why, in words for the engine line."""

    threads: int
    reason: str

    def apply(self) -> str:
        """Give torch the threads; the engine line's words ("2 threads (...)")."""
        import torch

        torch.set_num_threads(self.threads)
        return f"{self.threads} thread{'s' if self.threads > 1 else ''} ({self.reason})"


def available_cores() -> int:
    """The cores this process may run on: its affinity where the system says (Linux), else every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class CpuTimes(typing.NamedTuple):
    """Clock ticks since boot: every core's together, their idle ones, and this process's (user + system)."""

    total: int
    idle: int
    own: int


def cpu_times() -> CpuTimes:
    """/proc/stat's first line and /proc/self/stat (Linux); OSError elsewhere."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]  # user nice system idle iowait irq ...
    with open("/proc/self/stat") as own:
        mine = own.read().rsplit(")", 1)[1].split()  # after the command name: state ppid ... utime (12th) stime
    return CpuTimes(sum(fields), fields[3] + fields[4], int(mine[11]) + int(mine[12]))


def others_busy(before: CpuTimes, after: CpuTimes, cores: int) -> float:
    """Cores other processes kept busy between two samples: the machine's busy ticks less this process's own."""
    elapsed = after.total - before.total  # ticks over every core
    if elapsed <= 0:
        return 0.0
    busy = elapsed - (after.idle - before.idle) - (after.own - before.own)
    return max(0.0, busy / elapsed * cores)


def busy_cores(interval: float = 0.25) -> float:
    """Cores kept busy by other processes over the next `interval` seconds; 0 where the system does not say."""
    try:
        before = cpu_times()
        time.sleep(interval)
        return others_busy(before, cpu_times(), os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def choose_threads(
    requested: int | None,
    environ: typing.Mapping[str, str] = os.environ,
    *,
    cores: int | None = None,
    load: float | None = None,
) -> ThreadChoice:
    """The threads of this process: `requested` (--threads), else OMP_NUM_THREADS, else the cores this process may use
    (`cores`, default `available_cores`) shared among the node's processes, less those busy (`load`, default
    `busy_cores`, to the nearest core)."""
    if requested is not None:
        return ThreadChoice(requested, "--threads")
    if environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return ThreadChoice(max(1, int(environ["OMP_NUM_THREADS"])), "OMP_NUM_THREADS")
    cores = available_cores() if cores is None else cores
    load = busy_cores() if load is None else load
    processes = max(1, int(environ.get("LOCAL_WORLD_SIZE", 1)))
    share = max(1, cores // processes)
    busy = min(round(load), cores - 1)
    threads = max(1, min(share, cores - busy))
    reason = f"of {cores} core{'s' if cores > 1 else ''}"
    if processes > 1:
        reason += f" shared by {processes} processes"
    if busy:
        reason += f", {load:.1f} busy with other work"
    return ThreadChoice(threads, f"{reason}; --threads N or OMP_NUM_THREADS to choose")
