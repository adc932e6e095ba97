"""The pytest hooks of conftest.py take effect: under `--dist loadgroup`, the tests that share a module fixture
of their own file are one xdist group, so the fixture is built once, and the tests that run flex_attention are one
group, so its kernels are built once; and loading conftest.py, as pytest-xdist's controller does, imports neither
torch nor coreformer."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def shared() -> object:
    return object()


def group_of(request) -> str:
    """The xdist group in the test's node id: xdist's worker names it there, from the marks that exist when its own
    hook runs. Skips outside a worker under `--dist loadgroup` (xdist tells its workers `loadgroup`; their own `dist`
    is "no")."""
    if not getattr(request.config.option, "loadgroup", False) or "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("groups exist only in an xdist worker under --dist loadgroup (make test runs so)")
    return request.node.nodeid.rpartition("@")[2]


def test_a_module_fixture_user_is_in_its_files_group_under_loadgroup(shared, request):
    assert group_of(request) == "tests/test_conftest.py"


def test_a_flex_attention_user_is_in_the_flex_attention_group_under_loadgroup(flex_attention, request):
    assert group_of(request) == "flex_attention"


def test_a_test_without_a_module_fixture_stays_ungrouped(request):
    assert "@" not in request.node.nodeid


def test_loading_conftest_imports_neither_torch_nor_coreformer():
    tests = Path(__file__).resolve().parent
    loaded = "import sys; import conftest; print(sorted({name.split('.')[0] for name in sys.modules}))"
    result = subprocess.run([sys.executable, "-c", loaded], capture_output=True, text=True, cwd=tests, check=True)
    top_level = result.stdout
    assert "'pytest'" in top_level and "'torch'" not in top_level and "'coreformer'" not in top_level, top_level
