"""Timing, memory and the machine, shared by the benchmarks: what runs where, how fast the device multiplies,
interleaved repeats so that machine noise hits every compared run alike, and the peak memory of one call.

    synchronize(device)                      wait for the work queued on a CUDA device (a no-op on CPU)
    interleaved(runs, repeats, device)       {name: [seconds, ...]}: each callable timed in turn, A B A B ...
    cpu_name(), device_name(device)          the machine as results files name it
    bf16_gemm_peak(size, device) -> FLOP/s   the device's bf16 matmul peak, the limit MFU is measured against
    peak_memory_mib(run) -> MiB              how far one call raises the process's resident memory (Linux)
    LIBC, M_MMAP_THRESHOLD                   glibc, to map large allocations one by one while that is measured
"""

import ctypes
import ctypes.util
import gc
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

# glibc, for the memory measurement: mallopt(M_MMAP_THRESHOLD) and malloc_trim. None where the C library is not glibc.
_LIBC_NAME = ctypes.util.find_library("c")
LIBC = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME and hasattr(ctypes.CDLL(_LIBC_NAME), "mallopt") else None
M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`: CUDA kernels run asynchronously, so reading the clock before this would
    time the launches, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(runs: dict[str, Callable[[], None]], repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Time each callable `repeats` times, alternating between them, after one warm-up call each."""
    for run in runs.values():
        run()
    synchronize(device)
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    return platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA, else the CPU's model name and torch's thread count."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"{cpu_name()}, {torch.get_num_threads()} threads"


def bf16_gemm_peak(size: int, device: torch.device, repeats: int = 5) -> float:
    """The device's bf16 matmul FLOP/s: the best of `repeats` (size x size) @ (size x size) products."""
    a, b = (torch.randn(size, size, dtype=torch.bfloat16, device=device) for _ in range(2))
    a @ b
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_memory_mib(run: Callable[[], None]) -> float:
    """MiB the process's resident memory rose above its level before `run` (its second call: the first allocates
    what stays, such as optimizer state and caches), read from Linux's high-water mark. Set up by
    `memory_of_benchmark` so that large allocations are mapped and unmapped one by one (glibc keeps nothing freed),
    so the mark follows the tensors alive at once: a count of bytes, not of time, and so unaffected by load."""
    run()
    gc.collect()
    LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    baseline = process_memory_kib("VmRSS")
    run()
    return (process_memory_kib("VmHWM") - baseline) / 1024


def process_memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)
