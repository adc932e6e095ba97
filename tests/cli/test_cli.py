"""Tests of the command lines' first minutes: coreformer_cli (fast --help, --version, missing folders), the install
(a folder named coreformer/ in the working directory), `convert` without a tokenizer, saved file modes, a refused Hub
token, and tests/hub_server.py --help."""

import argparse
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import transformers
from tiny import tiny_model

import coreformer
import coreformer_cli
from coreformer.hub import folders
from coreformer_settings import command_line

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "coreformer")


def run_python(code: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


HEAVY_IMPORTS_AFTER = """
    import sys, coreformer_cli
    try:
        code = coreformer_cli.main({argv!r})
    except SystemExit as exit:
        code = exit.code
    print("exit", code)
    print("imported", sorted(name for name in {heavy!r} if name in sys.modules))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["convert", "--help"],
        ["attention-map", "--help"],
        ["convert", "./nope", "x"],
        ["pretrain", "--help"],
        ["finetune", "--help"],
        ["publish", "--version"],
        ["evaluate", "--help"],
        ["tokenize", "--help"],
    ],
    ids=[
        "help",
        "version",
        "convert-help",
        "attention-map-help",
        "missing-folder",
        "pretrain",
        "finetune",
        "publish",
        "evaluate",
        "tokenize",
    ],
)
def test_help_version_and_a_missing_folder_answer_without_importing_torch(tmp_path, argv):
    result = run_python(HEAVY_IMPORTS_AFTER.format(argv=argv, heavy=HEAVY), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "imported []" in result.stdout, result.stdout  # before: coreformer.cli imported torch first (6.5 s)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["evaluate", "./nope"], "coreformer evaluate: error: no such folder: ./nope"),
        (["finetune", "--task", "nope"], "coreformer finetune: error: Unknown task 'nope': --task must be one of"),
        (["finetune", "--train-file", "missing.jsonl"], "coreformer finetune: error: Local data file 'missing.jsonl'"),
        (["pretrain", "--family", "decoder", "--dataset", "missing.txt"], "Local data file 'missing.txt' does not"),
        (["pretrain", "--family", "decoder", "--output-dir", "run"], "--output-dir 'run' already holds a run. Pass"),
        (["finetune", "--task", "causal-lm", "--output-dir", "run"], "--output-dir 'run' already holds a run. Pass"),
        (
            ["pretrain", "--family", "decoder", "--output-dir", "notes"],
            "'notes' is not empty and holds no previous run",
        ),
        (["tokenize", "missing.txt", "out", "--tokenizer", "notes"], "Local data file 'missing.txt' does not exist"),
        (["tokenize", "notes/todo.txt", "notes", "--tokenizer", "notes"], "notes is not empty and holds no manifest"),
        (["tokenize", "notes/todo.txt", "notes/todo.txt", "--tokenizer", "notes"], "notes/todo.txt is a file"),
    ],
    ids=[
        "evaluate-folder",
        "finetune-task",
        "finetune-file",
        "pretrain-dataset",
        "pretrain-run",
        "finetune-run",
        "other",
        "tokenize-source",
        "tokenize-not-shards",
        "tokenize-file",
    ],
)
def test_simple_input_errors_answer_in_one_line_without_importing_torch(tmp_path, argv, message):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_config.json").write_text("{}")  # a previous run's folder
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not a run")
    result = run_python(HEAVY_IMPORTS_AFTER.format(argv=argv, heavy=HEAVY), tmp_path)
    assert "exit 2" in result.stdout and "imported []" in result.stdout, result.stdout + result.stderr
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


# A meta-path finder that refuses the heavy packages: a script that imports one before parsing its arguments fails
# with ImportError (exit 1) instead of answering.
BLOCKED_SCRIPT = """
    import runpy, sys

    class RefuseHeavyImports:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {heavy!r}:
                raise ImportError(f"{{name}} was imported before the arguments were parsed")

    sys.meta_path.insert(0, RefuseHeavyImports())
    sys.argv = [{script!r}, *{argv!r}]
    runpy.run_path({script!r}, run_name="__main__")
"""
SCRIPTS = {"pretrain": "usage: pretrain.py", "finetune": "usage: finetune.py", "publish": "usage: publish.py"}


@pytest.mark.parametrize("flag", ["--help", "--version"])
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_training_scripts_answer_help_and_version_without_importing_torch(tmp_path, script, flag):
    path = ROOT / "training" / f"{script}.py"
    heavy = (*HEAVY, "accelerate", "datasets")
    result = run_python(BLOCKED_SCRIPT.format(heavy=heavy, script=str(path), argv=[flag]), tmp_path)
    assert result.returncode == 0, result.stderr  # before: ImportError (the settings lived beside torch)
    expected = SCRIPTS[script] if flag == "--help" else f"coreformer {coreformer.__version__}"
    assert result.stdout.startswith(expected), result.stdout


MISTYPED = {
    "pretrain": (["--family", "decoder", "--tokenizer", "./no-tokenizer", "--output-dir", "out"], "./no-tokenizer"),
    "finetune": (["--task", "sequence-classification", "--model", "./no-model", "--output-dir", "out"], "./no-model"),
}


@pytest.mark.parametrize("script", list(MISTYPED))
def test_training_scripts_name_a_mistyped_folder_before_importing_torch(tmp_path, script):
    argv, folder = MISTYPED[script]
    path = ROOT / "training" / f"{script}.py"
    result = run_python(
        BLOCKED_SCRIPT.format(heavy=(*HEAVY, "accelerate", "datasets"), script=str(path), argv=argv), tmp_path
    )
    # before: the run module (torch) was imported first and the check came after it
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"{script}.py: error: no such folder: {folder} "), result.stderr
    assert not (tmp_path / "out").exists()


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit:
        coreformer_cli.main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"coreformer {coreformer.__version__}"
    assert coreformer_cli.version() == coreformer.__version__


def test_the_console_command_is_the_light_front(tmp_path):
    command = shutil.which("coreformer", path=str(Path(sys.executable).parent))
    assert command is not None, "the coreformer console script is not installed next to this Python"
    result = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"coreformer {coreformer.__version__}"


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                yield from _actions(subparser)
        else:
            yield parser.prog, action


def load_script(name: str):
    """training/NAME.py as a module (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "training" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_every_flag_and_argument_has_help_text():
    parsers = [coreformer_cli.build_parser(), *(load_script(name).build_parser() for name in SCRIPTS)]
    undocumented = [(prog, action.dest) for parser in parsers for prog, action in _actions(parser) if not action.help]
    assert undocumented == []


@pytest.mark.parametrize(
    "name, local",
    [
        ("./nope", True),
        ("../nope", True),
        ("/abs/nope", True),
        ("~/nope", True),
        ("a/b/c", True),  # more than one slash: never a repo id
        ("bad name", True),  # not a valid repo id
        ("owner/na--me", True),
        ("existing/nope", True),  # its parent is a local folder
        ("gpt2", False),
        ("owner/model-name", False),
        ("owner/model.v2", False),
    ],
)
def test_looks_local(tmp_path, monkeypatch, name, local):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing").mkdir()
    assert command_line.looks_local(name) is local


def test_missing_local_folders_are_refused_and_hub_ids_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    with pytest.raises(command_line.NoSuchFolderError, match=r"^no such folder: outputs/nope \(looked for "):
        command_line.check_model_location("outputs/nope")
    assert command_line.check_model_location("outputs") == "outputs"
    monkeypatch.setattr(command_line, "hub_unreachable", lambda: None)  # a Hub that answers
    assert command_line.check_model_location("owner/model") == "owner/model"  # goes on to the Hub


@pytest.mark.parametrize(
    "environment, reason",
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
        (
            {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
            r"the Hub at http://127\.0\.0\.1:9 cannot be ",
        ),
    ],
    ids=["offline", "unreachable"],
)
def test_a_mistyped_hub_name_fails_at_once_in_one_line(tmp_path, monkeypatch, capsys, environment, reason):
    import time

    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for variable in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    start = time.perf_counter()
    argv = ["finetune", "--task", "sequence-classification", "--model", "gtp2", "--output-dir", "out"]
    assert coreformer_cli.main(argv) == 2
    assert time.perf_counter() - start < 5  # before: a minute of huggingface_hub's retries, then three lines
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(
        rf"coreformer finetune: error: gtp2 is not a local folder, and the Hub cannot be asked for it: {reason}", err
    ), err
    assert "check the name, or pass a local folder" in err and not (tmp_path / "out").exists()
    (tmp_path / "hub" / "models--gtp2").mkdir(parents=True)  # in the local cache: it loads offline, so it passes
    assert command_line.check_model_location("gtp2") == "gtp2"


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["finetune", "--task", "causal-lm", "--lerning_rate", "1e-3"], "--learning_rate"),
        (["finetune", "--task", "causal-lm", "--lerning-rate=1e-3"], "--learning-rate"),
        (["pretrain", "--family", "decoder", "--max-step", "3"], None),  # a prefix: argparse takes it as --max-steps
        (["pretrain", "--family", "decoder", "--max-stesp", "3"], "--max-steps"),
        (["export", "a", "b", "--overwirte"], "--overwrite"),
        # a flag holding every word typed, however far its spelling: not `--export`, 0.62 alike
        (["finetune", "--task", "causal-lm", "--epochs", "2"], "--num-train-epochs"),
        (["pretrain", "--family", "decoder", "--epochs", "2"], ""),  # nothing close: no suggestion
    ],
)
def test_an_unknown_flag_names_the_closest_one(tmp_path, monkeypatch, capsys, argv, suggestion):
    monkeypatch.chdir(tmp_path)
    if suggestion is None:
        # parse only: running would train
        assert vars(coreformer_cli.COMMANDS["pretrain"].build_parser().parse_args(argv[1:]))["max_steps"] == 3
        return
    with pytest.raises(SystemExit) as exit:
        coreformer_cli.main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"coreformer {argv[0]}: error: unrecognized arguments: "), err
    assert err.endswith(f"(did you mean {suggestion}?)") if suggestion else "did you mean" not in err


def test_the_scripts_and_the_installed_command_share_one_parser():
    for name in SCRIPTS:
        script, installed = load_script(name).build_parser(), coreformer_cli.COMMANDS[name].build_parser()
        assert script.prog == f"{name}.py" and installed.prog == f"coreformer {name}"
        flags = {option for action in installed._actions for option in action.option_strings}
        assert flags == {option for action in script._actions for option in action.option_strings}
        assert script.description == installed.description  # the usage lines wrap after the program's name
        assert [action.help for action in script._actions] == [action.help for action in installed._actions]


def test_presets_resolve_from_the_package():
    from coreformer_settings.pretraining import default_configs_dir, preset_path

    package = Path(coreformer.__file__).resolve().parent
    assert default_configs_dir() == package.parent / "coreformer" / "training" / "configs"
    shipped = {path.name for path in default_configs_dir().rglob("*.yaml")}
    assert shipped == {path.name for path in (ROOT / "training" / "configs").rglob("*.yaml")} and shipped
    assert (
        preset_path("decoder", "tiny").read_text() == (ROOT / "training" / "configs" / "decoder-tiny.yaml").read_text()
    )


def test_no_hint_names_a_clone_only_script():
    hints = subprocess.run(
        ["grep", "-rn", "--include=*.py", "python training/", str(ROOT / "src")], capture_output=True, text=True
    )
    assert hints.stdout == ""  # a wheel install has no training/ folder: hints say `coreformer finetune ...`


@pytest.mark.parametrize(
    "argv",
    [
        ["attention-map", "outputs/nope", "some text", "-o", "map.png"],
        ["attention-map", "./nope", "some text", "-o", "map.png"],
        ["convert", "outputs/nope", "converted"],
        ["convert", "owner/model", "converted"],  # convert reads local folders only
        ["convert", "a-file", "converted"],
    ],
)
def test_cli_names_a_missing_folder_in_one_line_before_any_hub_call(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()

    def no_hub(*args, **kwargs):
        raise AssertionError("a missing folder reached from_pretrained")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", no_hub)
    (tmp_path / "a-file").write_text("not a folder")
    assert coreformer_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(rf"coreformer {argv[0]}: error: (no such folder|not a folder): ", err), err
    assert not (tmp_path / "converted").exists()


def test_convert_without_a_tokenizer_says_so(tmp_path, capsys):
    source = tmp_path / "bert"
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48
    )
    transformers.BertModel(config).save_pretrained(source)
    assert coreformer_cli.main(["convert", str(source), str(tmp_path / "converted")]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "tokenizer" in line]
    assert len(notes) == 1 and "holds no tokenizer" in notes[0] and ".save_pretrained(" in notes[0], notes
    assert coreformer_cli.main(["convert", str(source), str(tmp_path / "weights-only"), "--skip-tokenizer"]) == 0
    assert "tokenizer" not in capsys.readouterr().err  # asked for: nothing to say


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_ctrl_c_in_a_command_is_one_line_exit_130_and_leaves_no_half_written_output(tmp_path, monkeypatch, capsys):
    source = tmp_path / "bert"
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48
    )
    transformers.BertModel(config).save_pretrained(source)
    import coreformer.commands.convert

    # Ctrl-C while the converted folder is being written
    monkeypatch.setattr(coreformer.commands.convert, "write_model_card", _interrupt)
    assert coreformer_cli.main(["convert", str(source), str(tmp_path / "converted")]) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("coreformer convert: stopped by Ctrl-C before it finished;"), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert not (tmp_path / "converted").exists()  # before: a KeyboardInterrupt traceback


def test_tokenize_writes_shards_resumes_and_refuses_another_source_or_tokenizer_in_one_line(
    tmp_path, monkeypatch, capsys
):
    from coreformer.training import shards
    from coreformer.training.tokenizer_training import train_tokenizer

    texts = [f"line {i} of the tiny corpus, {'word ' * (i % 9)}" for i in range(60)]
    (tmp_path / "a.txt").write_text("\n".join(texts) + "\n")
    (tmp_path / "b.txt").write_text("another corpus\n")
    train_tokenizer("decoder", texts, 300).save_pretrained(tmp_path / "tok")
    train_tokenizer("decoder", [text.upper() for text in texts], 300).save_pretrained(tmp_path / "other")
    out = tmp_path / "out"

    def tokenize(source: str = "a.txt", tokenizer: str = "tok") -> int:
        argv = ["tokenize", str(tmp_path / source), str(out), "--tokenizer", str(tmp_path / tokenizer)]
        return coreformer_cli.main([*argv, "--shard-tokens", "100", "--num-proc", "2"])

    monkeypatch.setattr(shards, "CHUNK_DOCUMENTS", 8)
    append = shards._append  # Ctrl-C half-way through the text, then the same command again
    monkeypatch.setattr(
        shards, "_append", lambda chunk, *args: _interrupt() if chunk.positions[0] > 30 else append(chunk, *args)
    )
    assert tokenize() == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "coreformer tokenize: stopped by Ctrl-C; the shards written so far are kept (manifest.json lists them): run "
        "the same command again to go on from the last one"
    )
    monkeypatch.setattr(shards, "_append", append)
    assert tokenize() == 0
    assert capsys.readouterr().out.endswith(" shards\n")
    assert shards.ShardedTokens(out).num_tokens + shards.ShardedTokens(out, "validation").num_tokens == sum(
        len(ids) for ids in transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")(texts)["input_ids"]
    )
    for source, tokenizer, refusal in (
        ("b.txt", "tok", f"{out} holds shards of {str(tmp_path / 'a.txt')!r}, not of {str(tmp_path / 'b.txt')!r}"),
        ("a.txt", "other", f"made by tokenizer {str(tmp_path / 'tok')!r} (sha256:"),
    ):
        assert tokenize(source, tokenizer) == 2
        err = capsys.readouterr().err
        assert err.startswith("coreformer tokenize: error: ") and refusal in err and err.count("\n") == 1, err
    assert f"not by {str(tmp_path / 'other')!r}" in err


def test_ctrl_c_while_publishing_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    import coreformer.hub.publishing

    script = load_script("publish")
    monkeypatch.setattr(coreformer.hub.publishing, "publish_folder", _interrupt)
    assert script.main([str(tmp_path), "--repo-id", "me/model"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "publish.py: stopped by Ctrl-C" in err and "all of it or none of it" in err, err


def test_staged_folder_gives_saved_files_the_umasks_mode(tmp_path):
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48
    )
    old = os.umask(0o022)
    try:
        with folders.staged_folder(tmp_path / "model") as staging:
            transformers.BertModel(config).save_pretrained(staging)
            (staging / "private.txt").write_text("x")
            (staging / "private.txt").chmod(0o600)  # what a save through a temporary file leaves
            (staging / "run.sh").write_text("#!/bin/sh\n")
            (staging / "run.sh").chmod(0o700)
    finally:
        os.umask(old)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "model").iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, "private.txt": 0o644, "run.sh": 0o755}


@pytest.mark.slow
def test_a_refused_token_names_hf_token_and_the_token_flag(tmp_path):
    from hub_server import LoopbackHub
    from test_publish import build_folder, hub_env, run_publish

    folder = tmp_path / "model"
    build_folder("decoder", folder)
    hub = LoopbackHub()
    hub.start()
    try:  # no HF_TOKEN, an empty HF_HOME (no stored login): the loopback Hub answers 401 to the first write
        result = run_publish(folder, "user/model", hub_env(hub, tmp_path / "home", token=None))
    finally:
        hub.stop()
    assert result.returncode == 1 and hub.repos == {}
    assert re.search(r"HubAuthError: the Hub at http://127\.0\.0\.1:\d+ answered 401 ", result.stderr), result.stderr
    assert "pass a token with write access with --token or the HF_TOKEN environment variable" in result.stderr
    assert "Traceback" not in result.stderr


def test_hub_server_help_prints_usage_instead_of_serving():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "hub_server.py"), "--help"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: python tests/hub_server.py"), result


def test_every_folder_the_readmes_commands_write_in_the_clone_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: there is no .gitignore to consult")
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S))
    destinations = re.findall(r"--output-dir (\S+)", blocks) + re.findall(
        r"coreformer (?:convert|export) \S+ (\S+)", blocks
    )
    # the clone-relative ones; placeholders (D, OUT, FOLDER, path/to/...) and absolute paths write nowhere in the clone
    tops = {Path(path).parts[0] for path in destinations if re.fullmatch(r"[a-z][\w.-]*(/\S*)?", path)} - {"path"}
    assert {"outputs", "out", "minilm-cf"} <= tops, tops
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", *(f"{top}/" for top in sorted(tops))],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    ignored = {line.split("\t")[-1].rstrip("/") for line in result.stdout.splitlines()}
    assert ignored == tops, f"not in .gitignore: {sorted(tops - ignored)}"  # before: minilm-cf/ was not


def test_make_demo_leaves_torch_every_core():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "training/pretrain.py" in recipe and "OMP_NUM_THREADS" not in recipe  # was OMP_NUM_THREADS=1


def test_a_folder_named_coreformer_in_the_working_directory_does_not_shadow_the_package(tmp_path):
    (tmp_path / "coreformer" / "training").mkdir(parents=True)  # a clone named coreformer/, seen from its parent
    # where `import coreformer` would load from, found by the same import system without running the package (its
    # import takes torch: seconds)
    result = run_python("import importlib.util; print(importlib.util.find_spec('coreformer').origin)", tmp_path)
    assert result.returncode == 0, result.stderr
    package = Path(result.stdout.strip())  # "None" before: the empty folder, found as a namespace package
    assert package.name == "__init__.py" and package.is_file() and not package.is_relative_to(tmp_path), package


def test_export_is_quiet_and_its_decoder_tokenizer_pads_left(tmp_path, capsys):
    import logging

    from test_publish import build_folder

    build_folder("decoder", tmp_path / "model")
    capsys.readouterr()
    assert coreformer_cli.main(["export", str(tmp_path / "model"), str(tmp_path / "native")]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines() == [
        f"exported {tmp_path / 'model'} -> GPT2LMHeadModel: wrote {tmp_path / 'native'}"
    ]
    assert "Loading weights" not in captured.err and "Writing model shards" not in captured.err, captured.err
    # torch.onnx names each torchvision operator it skips at WARNING when --to onnx runs without torchvision
    assert logging.getLogger("torch.onnx._internal.exporter._registration").getEffectiveLevel() >= logging.ERROR
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "native").padding_side == "left"


def test_the_summary_says_why_a_run_kept_no_checkpoints(tmp_path):
    from types import SimpleNamespace

    from coreformer.training.reports import checkpoints_line

    assert checkpoints_line(SimpleNamespace(save_every=0), tmp_path) == "none (save_every is 0)"
    # before: "none (--save-every 0)" for a short run of a preset that saves every 200 steps
    assert checkpoints_line(SimpleNamespace(save_every=200), tmp_path) == (
        "none (the run ended before step 200, the first save; --save-every N saves more often)"
    )


def test_fine_tuning_ends_with_where_everything_went(tmp_path):
    from types import SimpleNamespace

    from coreformer.training.reports import finetune_summary

    folder = tmp_path / "cls"
    make = SimpleNamespace(auto_class="AutoModelForSequenceClassification")
    args = SimpleNamespace(output_dir=str(folder), spec=make, peft="lora", save_every=0, export=None)
    tiny_model(coreformer.CoreformerEncoderForSequenceClassification, "encoder").save_pretrained(folder)
    (folder / "all_results.json").write_text("{}")
    assert finetune_summary(args).splitlines() == [
        "where everything went:",
        f"  model        {folder}/  (AutoModelForSequenceClassification.from_pretrained({str(folder)!r}))",
        f"  adapter      {folder}/adapter/  (the LoRA adapter alone, for PEFT)",
        f"  model card   {folder}/README.md",
        f"  metrics      {folder}/all_results.json",
        "  checkpoints  none (save_every is 0)",
        "what to run next:",
        f"  publish      coreformer publish {folder} --repo-id YOUR_NAME/cls",
        f"  export       coreformer export {folder} {folder}-native --check",
    ]


def test_missing_columns_are_named_together(tmp_path):
    import datasets

    from coreformer.training.finetuning.arguments import FinetuningArguments
    from coreformer.training.finetuning.data import check_columns
    from coreformer_settings.base import FinetuningError

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["a"], "kind": [0]})})
    # text_pair_column is optional and left unset: not looked for
    args = FinetuningArguments.resolve(
        {"task": "sequence-classification", "model": "m", "output_dir": str(tmp_path), "text_column": "text"}
    )
    with pytest.raises(FinetuningError) as error:
        check_columns(splits, args)
    assert str(error.value) == (
        "The train data has no column 'text' (the input text), 'label' (the labels) for sequence-classification; its "
        "columns are ['body', 'kind']. Pass --text-column with the column that holds the input text, --label-column "
        "with the column that holds the labels."
    )  # before: only 'text', and after fixing it, a second run to learn about 'label'


RECORDED: list[tuple] = []


def _record(prepared, prog: str) -> int:
    RECORDED.append((prepared, prog))
    return 0


def test_a_command_checks_its_inputs_before_it_imports_its_handler(tmp_path, capsys):
    imported = []

    def import_handler():  # what each command's handler function does: import the (heavy) module, return its handler
        imported.append("demo")
        return _record

    demo = coreformer_cli.Command(
        "demo",
        "a demo",
        lambda parser: parser.add_argument("folder"),
        import_handler,
        prepare=coreformer_cli._check(local_folders=("folder",)),
    )
    assert demo.main([str(tmp_path / "missing")]) == 2
    assert "coreformer demo: error: no such folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["a", "--nope"])  # refused by the parser: nothing checked, nothing imported
    assert imported == []
    assert demo.main([str(tmp_path)], prog="demo.py") == 0
    assert imported == ["demo"] and RECORDED[-1][0].folder == str(tmp_path) and RECORDED[-1][1] == "demo.py"


def test_every_subcommand_is_one_command_whose_handler_is_in_the_package():
    for name, command in coreformer_cli.COMMANDS.items():
        assert isinstance(command, coreformer_cli.Command) and command.name == name
        handler = command.handler()
        assert handler.__module__.startswith("coreformer.commands.") and callable(handler)


def test_evaluate_help_prints_percentages_once():
    help_text = " ".join(coreformer_cli.COMMANDS["evaluate"].build_parser().format_help().split())
    assert "a fixed 15% masking" in help_text and "BART's 30%" in help_text and "%%" not in help_text
