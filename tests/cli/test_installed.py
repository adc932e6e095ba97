"""The installed experience: coreformer built as a wheel, installed into a fresh virtual environment, and run from a
folder outside the clone (pretrain, then the fine-tuning command its summary names, publish, export).

The environment is fresh but cheap: `python -m venv --without-pip`, the wheel installed by this interpreter's pip
(`pip --python`), and the dependencies read from this test run's own site-packages through a plain path line in a
.pth file. A path added that way has none of its own .pth files processed, so the clone's editable install (the line
that puts src/ on sys.path) is not seen: every coreformer module the commands import comes from the wheel. Nothing is
downloaded and nothing touches the network (the Hub is tests/hub_server.py on 127.0.0.1).
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from hub_server import LoopbackHub
from test_publish import hub_env

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = (".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "outputs", "out", "site")
TINY_PRETRAIN = "--max-steps 2 --max-documents 20 --vocab-size 300 --eval-every 0 --eval-batches 1 --batch-size 2"
TINY_FINETUNE = "--max-steps 2 --max-train-examples 8 --max-eval-examples 4 --batch-size 2 --max-length 32"


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the clone (an in-place build would reuse a stale build/ folder's files)."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SHIPPED))
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation"]
    subprocess.run([*command, "-w", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("coreformer-*.whl")
    return wheel


def fresh_environment(tmp_path: Path, wheel: Path) -> Path:
    """A new virtual environment holding the wheel; its dependencies are this interpreter's (see the docstring)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dependencies = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    Path(site, "dependencies.pth").write_text("\n".join(dependencies) + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*install, str(wheel)], check=True, capture_output=True)
    return venv


def run(venv: Path, command: str, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    """`command` (a `coreformer ...` line) with the environment's bin/ first on PATH; its stdout."""
    result = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.slow
def test_a_wheel_in_a_fresh_environment_pretrains_finetunes_publishes_and_exports(tmp_path):
    wheel = build_wheel(tmp_path)
    venv = fresh_environment(tmp_path, wheel)
    work = tmp_path / "work"
    work.mkdir()
    assert not work.resolve().is_relative_to(ROOT)
    hub = LoopbackHub()
    hub.start()
    try:
        env = {key: value for key, value in hub_env(hub, tmp_path / "home").items() if key != "PYTHONPATH"}
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        # where the package and the command's front resolve (found, not imported: the commands below import them)
        found = (
            "import importlib.util as u; print(u.find_spec('coreformer').origin, u.find_spec('coreformer_cli').origin)"
        )
        where = run(venv, f'python -c "{found}"', work, env).split()
        assert len(where) == 2 and all(Path(path).is_relative_to(venv) for path in where), where  # the wheel's files

        pretrained = run(venv, f"coreformer pretrain --family decoder {TINY_PRETRAIN} --output-dir model", work, env)
        # the preset came from the installed package; the summary's next command works here, as printed
        (hint,) = [line.split(None, 1)[1] for line in pretrained.splitlines() if line.startswith("  fine-tune ")]
        assert hint == "coreformer finetune --task causal-lm --model model --output-dir model-causal-lm", hint
        finetuned = run(venv, f"{hint} {TINY_FINETUNE}", work, env)
        assert "where everything went:" in finetuned and "coreformer publish model-causal-lm" in finetuned

        env["HF_HUB_OFFLINE"] = "0"  # the loopback Hub, 127.0.0.1 only
        published = run(venv, "coreformer publish model-causal-lm --repo-id user/tiny", work, env)
        assert published.startswith("published model-causal-lm -> ") and "user/tiny" in hub.repos

        env["HF_HUB_OFFLINE"] = "1"
        exported = run(venv, "coreformer export model-causal-lm native --check", work, env)
        assert "max abs difference" in exported and (work / "native" / "config.json").is_file(), exported
    finally:
        hub.stop()
