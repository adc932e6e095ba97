"""pytest's hooks for the whole run (slow files first, the tests sharing a module fixture on one xdist worker, the
imports frozen out of the garbage collector's sight once collected), the offline Hub, the `family` and `variant`
fixtures with the block options every family supports, the `flex_attention` fixture, and the helpers that start,
watch and stop test processes. The tiny models themselves are in tiny.py.

Nothing here imports torch or coreformer: pytest-xdist's controller loads this file but runs no test, and those
imports would cost it seconds before it starts the workers."""

import gc
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from packaging.version import Version

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor builds its kernels in a pool of processes it starts, each importing torch, in every process that compiles;
# the two xdist workers already keep both cores busy, so each builds its own kernels one after another instead.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402

FAMILIES = ("encoder", "decoder", "seq2seq")

# Block options every family must support: the core is configured, never subclassed.
VARIANTS = {
    "default": {},
    "rotary_rmsnorm_swiglu_gqa": dict(
        position_embedding_type="rotary",
        norm_type="rmsnorm",
        norm_position="pre",
        hidden_act="silu",
        gated_mlp=True,
        num_key_value_heads=2,
        attention_bias=False,
        mlp_bias=False,
    ),
    "sinusoidal_prenorm": dict(position_embedding_type="sinusoidal", norm_position="pre"),
    "no_positions_mqa": dict(position_embedding_type="none", num_key_value_heads=1),
}


# A coreformer encoder shaped like ModernBERT (what convert_from_hf gives and export takes).
MODERNBERT = dict(
    position_embedding_type="rotary",
    norm_position="pre",
    gated_mlp=True,
    attention_bias=False,
    mlp_bias=False,
    norm_bias=False,
    type_vocab_size=0,
    final_norm=True,
    first_layer_attention_norm=False,
    layer_types=["full", "sliding", "sliding", "full"],
    sliding_window=2,
    rope_theta=160000.0,
    local_rope_theta=10.0,
    layer_norm_eps=1e-5,
    lm_head_bias=True,
    head_transform_bias=False,
    classifier_transform=True,
    classifier_dense=False,
    classifier_bias=True,
    num_hidden_layers=4,
)


def pytest_configure(config: pytest.Config) -> None:
    """Stop `--dist loadgroup` where pytest and pytest-xdist ignore the groups together: from pytest 9.2 node ids are
    structured and xdist 3.8 still tags grouped tests by rewriting the old string field (pytest-dev/pytest-xdist#1386).
    The run would go on with every xdist_group dropped and each worker building the multi-process module fixtures
    again, minutes slower with nothing failing."""
    if config.getoption("dist", "no") != "loadgroup" or "PYTEST_XDIST_WORKER" in os.environ:
        return  # plain pytest (xdist may not even be installed), or a worker: the controller checked
    import xdist

    if Version(pytest.__version__) >= Version("9.2") and Version(xdist.__version__) <= Version("3.8.0"):
        raise pytest.UsageError(
            f"--dist loadgroup ignores every xdist_group with pytest {pytest.__version__} and pytest-xdist "
            f"{xdist.__version__} (pytest-dev/pytest-xdist#1386): install the pytest that pyproject.toml pins, "
            'pip install "pytest>=8,<9.2"'
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files that hold slow tests first, each file's tests kept together and in order: under xdist the long runs then
    start at once and the quick tests fill the gaps at the end, instead of one worker running a long test collected
    late alone (test_readme's fine-tuning block, 80 s, once ended a run with the other worker idle). And the tests
    that share a module fixture run on one worker (`group_module_fixture_users`). First of the hooks: xdist's worker
    turns the xdist_group marks into node ids in its own, and a mark added after that groups nothing."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
    group_flex_attention_users(items)
    group_module_fixture_users(items)


def group_flex_attention_users(items: list[pytest.Item]) -> None:
    """Put the tests that ask for the `flex_attention` fixture in one xdist_group: flex_attention compiles a kernel
    per mask and shape in the process that calls it, so on one worker a kernel one test built serves the next."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is not None and "flex_attention" in info.names_closure and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("flex_attention"))


def group_module_fixture_users(items: list[pytest.Item]) -> None:
    """Put the tests that use a module- or session-scoped fixture of their own file in one xdist_group (named after
    the file), so that `--dist loadgroup` builds that fixture once instead of once on each worker: spread over both,
    a file's trained runs or ONNX exports were built twice. Fixtures a test gets without asking (autouse: cheap
    settings such as one thread) group nothing, and a test that names its own group keeps it."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("xdist_group"):
            continue
        module = item.nodeid.split("::", 1)[0]
        unasked = set(info.initialnames) - set(info.argnames)  # autouse and usefixtures
        for name in set(info.names_closure) - unasked:
            definition = info.name2fixturedefs.get(name, [None])[-1]  # the one this test gets
            if definition is not None and definition.scope in ("module", "session") and definition.baseid == module:
                item.add_marker(pytest.mark.xdist_group(module))
                break


def free_port() -> int:
    """A port nothing listens on now: every multi-process test rendezvouses on its own, never on the launchers'
    default 29500, which two tests running at once on the two xdist workers would share (and hang on)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a whole test file (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): runs
    compared bit for bit with child processes (OMP_NUM_THREADS=1) need the same thread count, and one thread is also
    the fastest for tiny shapes on a busy 2-core machine."""
    import torch  # here, not above: the controller starts the workers before any test imports torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(params=list(VARIANTS))
def variant(request) -> dict:
    return VARIANTS[request.param]


@pytest.fixture
def flex_attention(monkeypatch) -> None:
    """Skip where torch's flex_attention cannot build its kernel; asked when the test runs, not at collection (the
    probe compiles a kernel, seconds on CPU, once per process). The test's compiles are static: transformers compiles
    flex_attention once per process with automatic dynamic shapes, and once a new shape or mask has made it recompile
    with dynamic shapes, inductor's CPU flex template fails to build some masks (C++ errors in this torch: the strided
    one), so whether a test passed would depend on the tests its worker ran before it. A static kernel is the same
    whoever built it; the recompile limit is raised and made an error, so a test never falls back to eager silently."""
    import torch
    from tiny import flex_attention_compiles

    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", False)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1000)
    monkeypatch.setattr(torch._dynamo.config, "accumulated_recompile_limit", 10000)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    if not flex_attention_compiles():
        pytest.skip("flex_attention does not compile with this torch build here")


def kill_at_marker(child: subprocess.Popen, marker: Path, timeout: float = 240) -> None:
    """Wait until `child` (started with stderr=PIPE, text=True) writes `marker`, which it does in the middle of a
    save, then SIGKILL it; fail with the child's stderr if it ended first."""
    _wait_for_marker(child, marker, timeout)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    child.stderr.close()


def _wait_for_marker(child: subprocess.Popen, marker: Path, timeout: float) -> None:
    """Return once `marker` exists; fail with the child's stderr if it ended first, or name the marker at `timeout`."""
    deadline = time.monotonic() + timeout
    while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not marker.exists():
        ended = child.poll() is not None
        pytest.fail(child.stderr.read()[-3000:] if ended else f"no {marker.name} after {timeout:g} s")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (read from /proc; only `pid` where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(command name)": state, ppid, ...
        except (OSError, IndexError):
            continue  # a process that ended while the table was read
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def run_launch(command: list[str], *, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)` of a multi-process launch, in a session of its own;
    past `timeout` every Python process of the launch prints its stack (faulthandler, on SIGABRT) and the test fails
    with them: a hung launch says where each process waits. torch's elastic agent starts each worker in a session of
    its own, so the workers are found as the launcher's descendants, not by its session: a worker left behind would
    hold the output pipes open and the test would wait on it."""
    child = subprocess.Popen(
        command,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launch = descendants(child.pid)
        _signal_all(launch, signal.SIGABRT)
        try:
            stdout, stderr = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            _signal_all(launch, signal.SIGKILL)
            stdout, stderr = child.communicate()
        pytest.fail(f"the launch ran past {timeout:g} s; the stacks of its processes then:\n{stderr[-12000:]}")
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def ctrl_c_as_in_a_terminal() -> None:
    """`preexec_fn` of a child that a test interrupts with SIGINT (`interrupt_at_marker`). A shell starts background
    jobs with SIGINT ignored (so does a CI runner that runs the suite as one), Python then installs no
    KeyboardInterrupt handler, and the child would sleep through the test's Ctrl-C: restore the default, as the
    foreground job of a terminal has it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_at_marker(child: subprocess.Popen, marker: Path, timeout: float = 240) -> tuple[int, str]:
    """Wait until `child` (started with stderr=PIPE, text=True, preexec_fn=ctrl_c_as_in_a_terminal) writes `marker`,
    send it SIGINT (Ctrl-C), and return (its exit code, its stderr); fail with the child's stderr if it ended first."""
    _wait_for_marker(child, marker, timeout)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=120)
    return child.returncode, stderr


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move everything alive after collection (torch, transformers, every test module) out of the garbage collector's
    sight, as the commands do once they have imported (coreformer_cli.after_imports): a full collection then
    walks only what the tests create, and each in-process run ends with one (Accelerate's `free_memory`)."""
    gc.freeze()
