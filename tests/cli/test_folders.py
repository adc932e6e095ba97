"""Atomic folder saves (coreformer.hub.folders): a kill at any moment of a save leaves the previous folder intact."""

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import transformers
from conftest import kill_at_marker

import coreformer_cli as cli
from coreformer.hub import folders


def contents(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def make_folder(path: Path, **files: str) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("atomic_exchange", [True, False], ids=["renameat2", "two_renames"])
def test_replace_folder_puts_the_new_folder_in_place_of_the_old(tmp_path, monkeypatch, atomic_exchange):
    if not atomic_exchange:
        monkeypatch.setattr(folders, "exchange", lambda first, second: False)
    elif not folders.exchange(make_folder(tmp_path / "a", x="1"), make_folder(tmp_path / "b", y="2")):
        pytest.skip("this system or filesystem has no renameat2(RENAME_EXCHANGE)")
    old = make_folder(tmp_path / "model", **{"config.json": "old", "stale.bin": "old"})
    new = make_folder(tmp_path / f".model.partial-{folders._HOST}-1-0a0b0c0d", **{"config.json": "new"})
    folders.replace_folder(new, old)
    assert contents(old) == contents(make_folder(tmp_path / "expected", **{"config.json": "new"}))
    assert not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".model")) == []


def test_staged_folder_leaves_the_destination_untouched_when_the_save_fails(tmp_path):
    destination = make_folder(tmp_path / "model", **{"config.json": "old"})
    with pytest.raises(RuntimeError, match="disk full"), folders.staged_folder(destination) as staging:
        (staging / "config.json").write_text("half")
        raise RuntimeError("disk full")
    assert (destination / "config.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_leftovers_of_killed_saves_are_cleaned_and_a_half_swapped_folder_comes_back(tmp_path):
    pid, host = dead_pid(), folders._HOST
    partial = make_folder(tmp_path / f".model.partial-{host}-{pid}-1a2b3c4d", **{"config.json": "half"})
    live = make_folder(tmp_path / f".model.partial-{host}-{os.getpid()}-5e6f7a8b", **{"config.json": "live"})
    replaced = make_folder(tmp_path / f".model.replaced-{host}-{pid}-9c0d1e2f", **{"config.json": "previous"})
    elsewhere = make_folder(tmp_path / f".model.partial-other_machine-{pid}-3a4b5c6d", **{"config.json": "theirs"})
    folders.remove_stale_saves(tmp_path, "model")
    assert not partial.exists() and not replaced.exists()
    assert live.exists(), "a save that is still running must not be touched"
    assert elsewhere.exists(), "a save from another machine cannot be judged from here"
    assert (tmp_path / "model" / "config.json").read_text() == "previous"


def test_a_symlinked_destination_replaces_the_folder_it_points_to(tmp_path):
    real = make_folder(tmp_path / "real", **{"config.json": "old"})
    (tmp_path / "work").mkdir()
    link = tmp_path / "work" / "run"
    link.symlink_to(real)
    with folders.staged_folder(link) as staging:
        (staging / "config.json").write_text("new")
    assert link.is_symlink() and (link / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real", "work"]
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["run"]


def test_a_process_saving_over_its_working_directory_follows_it_to_the_new_folder(tmp_path, monkeypatch):
    run = make_folder(tmp_path / "run", **{"config.json": "old"})
    monkeypatch.chdir(run)
    with folders.staged_folder(".") as staging:
        (staging / "config.json").write_text("new")
    assert Path("config.json").read_text() == "new"  # relative paths still work: the process moved with the folder
    assert Path.cwd() == run.resolve()


def test_concurrent_processes_of_one_launch_share_one_staged_folder_and_only_the_main_one_swaps(tmp_path):
    destination = make_folder(tmp_path / "model", **{"config.json": "old"})
    with folders.staged_folder(destination, main_process=False, launcher_pid=os.getpid()) as worker_staging:
        (worker_staging / "worker.txt").write_text("from rank 1")
    assert (destination / "config.json").read_text() == "old"  # a worker never swaps
    with folders.staged_folder(destination, launcher_pid=os.getpid()) as staging:
        assert staging == worker_staging
        (staging / "config.json").write_text("new")
    assert contents(destination).keys() == {"config.json", "worker.txt"}


KILLED_SAVE = textwrap.dedent(
    """
    import pathlib, sys, time
    from coreformer.hub import folders

    destination, marker = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    with folders.staged_folder(destination) as staging:
        (staging / "config.json").write_text("new")
        marker.write_text("half written")
        time.sleep(300)  # the test kills us here
        (staging / "model.safetensors").write_text("new")
    """
)


def run_until_marker(command: list[str], marker: Path, cwd: Path) -> None:
    """Start `command`, wait until it writes `marker` (it is then mid-save), SIGKILL it."""
    child = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kill_at_marker(child, marker)


@pytest.mark.slow
def test_sigkill_during_a_staged_save_leaves_the_previous_folder(tmp_path):
    destination = make_folder(tmp_path / "model", **{"config.json": "old", "model.safetensors": "old"})
    before = contents(destination)
    run_until_marker(
        [sys.executable, "-c", KILLED_SAVE, str(destination), str(tmp_path / "marker")], tmp_path / "marker", tmp_path
    )
    assert contents(destination) == before
    with folders.staged_folder(destination) as staging:  # the next save cleans the killed one's staging folder
        (staging / "config.json").write_text("next")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".model")] == []
    assert (destination / "config.json").read_text() == "next"


KILLED_CONVERT = textwrap.dedent(
    """
    import pathlib, sys, time
    import coreformer_cli
    import coreformer.commands.convert as convert_command

    marker = pathlib.Path(sys.argv[1])

    def write_model_card(folder, *args, **kwargs):  # the weights are written, the card and the swap are not
        marker.write_text("converting")
        time.sleep(300)  # the test kills us here

    convert_command.write_model_card = write_model_card
    sys.exit(coreformer_cli.main(sys.argv[2:]))
    """
)


@pytest.mark.slow
def test_sigkill_during_coreformer_convert_leaves_the_previous_conversion(tmp_path):
    source = tmp_path / "bert"
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48
    )
    transformers.BertModel(config).save_pretrained(source)
    destination = tmp_path / "converted"
    assert cli.main(["convert", str(source), str(destination), "--skip-tokenizer"]) == 0
    before = contents(destination)
    marker = tmp_path / "marker"
    command = [sys.executable, "-c", KILLED_CONVERT, str(marker), "convert", str(source), str(destination)]
    run_until_marker([*command, "--skip-tokenizer", "--overwrite"], marker, tmp_path)
    assert contents(destination) == before
    assert any(p.name.startswith(".converted.partial-") for p in tmp_path.iterdir())
    assert cli.main(["convert", str(source), str(destination), "--skip-tokenizer", "--overwrite"]) == 0
    assert not any(p.name.startswith(".converted.") for p in tmp_path.iterdir())
    assert (destination / "model.safetensors").is_file() and (destination / "README.md").is_file()


# ---------------------------------------------------------------------------------------------------------------------
# Exported folders, ready for plain transformers
# ---------------------------------------------------------------------------------------------------------------------

AUTO_MAP = {
    "AutoConfig": "configuration_coreformer.CoreformerDecoderConfig",
    "AutoModelForCausalLM": "modeling_decoder.CoreformerDecoderForCausalLM",
}


def _json(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def test_prepare_for_serving_keeps_only_the_auto_map_of_code_the_folder_holds(tmp_path):
    import json

    without_code = make_folder(
        tmp_path / "onnx",
        **{"config.json": json.dumps({"model_type": "coreformer_decoder", "auto_map": AUTO_MAP})},
        **{"tokenizer_config.json": json.dumps({"tokenizer_class": "TokenizersBackend"})},
    )
    folders.prepare_for_serving(without_code, causal_lm=True)
    assert "auto_map" not in _json(without_code / "config.json")  # the code is not there: nothing to ask about
    assert _json(without_code / "tokenizer_config.json")["padding_side"] == "left"

    with_code = make_folder(
        tmp_path / "model",
        **{"config.json": json.dumps({"auto_map": AUTO_MAP}), "configuration_coreformer.py": "", "x.py": ""},
        **{"tokenizer_config.json": json.dumps({"padding_side": "right"})},
    )
    folders.prepare_for_serving(with_code, causal_lm=False)
    assert _json(with_code / "config.json")["auto_map"] == {"AutoConfig": AUTO_MAP["AutoConfig"]}
    assert _json(with_code / "tokenizer_config.json") == {"padding_side": "right"}  # an encoder's stays as it was


# A process without coreformer, whose stdin is closed: transformers' "Do you wish to run the custom code? [y/N]"
# prints its question and then reads nothing. Each folder's output follows a line naming it.
LOAD_TOKENIZERS = """
import sys
sys.modules["coreformer"] = None
from transformers import AutoTokenizer
for folder in sys.argv[1:]:
    print("==", folder, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print("padding", tokenizer.padding_side, flush=True)
"""


def _load_tokenizers_without_coreformer(*folders: Path) -> dict[str, str]:
    """What loading each folder's tokenizer printed, in one process without coreformer, in the order given."""
    result = subprocess.run(
        [sys.executable, "-c", LOAD_TOKENIZERS, *map(str, folders)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # warnings and the question in the order they came
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert result.returncode == 0, result.stdout
    printed = result.stdout.split("== ")[1:]
    return dict(part.split("\n", 1) for part in printed)


@pytest.mark.slow
def test_an_onnx_exports_tokenizer_loads_without_asking_to_run_custom_code(tmp_path):
    from test_publish import build_folder

    from coreformer.export.onnx import copy_companions

    build_folder("decoder", tmp_path / "model")
    for name in ("as-copied", "served"):  # what --to onnx writes beside its graphs, before and after the fix
        (tmp_path / name).mkdir()
        copy_companions(tmp_path / "model", tmp_path / name)
    folders.prepare_for_serving(tmp_path / "served", causal_lm=True)
    # the served folder first, while the process has loaded nothing: its load must not ask
    printed = _load_tokenizers_without_coreformer(tmp_path / "served", tmp_path / "as-copied")
    served, as_copied = printed[str(tmp_path / "served")], printed[str(tmp_path / "as-copied")]
    assert "custom code" not in served and "padding left" in served, served
    assert "Do you wish to run the custom code?" in as_copied, as_copied
