"""Folders travel between transformers releases: saved by coreformer under one release, they load by remote code
under another in a venv holding only torch and that release, with the same logits (1e-5) and greedy tokens, for
every family and a decoder mixing every causal layer type (travel.py holds the cases).

`make test-compat TRANSFORMERS=X` builds the venvs and names them here: X with coreformer (this process), X alone, the
development release with coreformer (.venv) and the development release alone. Outside that tier there is no second
release to travel to, so the test skips saying so.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TRAVEL = Path(__file__).with_name("travel.py")
# The interpreters `make test-compat` names: the other release with coreformer, and each release without it.
VENVS = ("COREFORMER_COMPAT_OTHER", "COREFORMER_COMPAT_BARE", "COREFORMER_COMPAT_OTHER_BARE")

pytestmark = pytest.mark.compat


def _travel(python: str, mode: str, folder: Path, tmp_path: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / f"modules-{folder.name}-{mode}")}
    result = subprocess.run(
        [python, str(TRAVEL), mode, str(folder)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert result.returncode == 0, f"{python} {mode} {folder}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def interpreters() -> dict[str, str]:
    missing = [name for name in VENVS if not os.environ.get(name)]
    if missing:
        pytest.skip(f"{', '.join(missing)} unset: make test-compat builds the other release's venvs and names them")
    return {name: os.environ[name] for name in VENVS}


@pytest.mark.slow
def test_a_folder_saved_under_this_release_loads_under_the_other_without_coreformer(interpreters, tmp_path):
    folder = tmp_path / "saved-here"
    folder.mkdir()
    _travel(sys.executable, "save", folder, tmp_path)
    assert "ok" in _travel(interpreters["COREFORMER_COMPAT_OTHER_BARE"], "load", folder, tmp_path)


@pytest.mark.slow
def test_a_folder_saved_under_the_other_release_loads_under_this_one_without_coreformer(interpreters, tmp_path):
    folder = tmp_path / "saved-there"
    folder.mkdir()
    _travel(interpreters["COREFORMER_COMPAT_OTHER"], "save", folder, tmp_path)
    assert "ok" in _travel(interpreters["COREFORMER_COMPAT_BARE"], "load", folder, tmp_path)
