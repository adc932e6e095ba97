"""The session's hooks (conftest.py) take effect: under `--dist loadgroup`, the tests that share a module fixture
of their own file are one xdist group, so the fixture is built once."""

import os

import pytest


@pytest.fixture(scope="module")
def shared() -> object:
    return object()


def test_a_module_fixture_user_is_in_its_files_group_under_loadgroup(shared, request):
    # xdist tells its workers `loadgroup` (their own `dist` is "no")
    if not getattr(request.config.option, "loadgroup", False) or "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("groups exist only in an xdist worker under --dist loadgroup (make test runs so)")
    # xdist's worker names the group in the node id, from the marks that exist when its own hook runs.
    assert request.node.nodeid.endswith("@tests/test_conftest.py")


def test_a_test_without_a_module_fixture_stays_ungrouped(request):
    assert "@" not in request.node.nodeid
