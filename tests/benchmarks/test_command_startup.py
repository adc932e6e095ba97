"""What a command costs besides its work (coreformer_cli.after_imports, benchmarks/command_startup.py): every
command freezes what its imports made before it runs, and the benchmark times each command in both arms. The
benchmark's own numbers come from running it (each row is a fresh process of several seconds), not from here."""

import gc
import json

import pytest
from results_files import sibling

import coreformer_cli


class ReachedAfterImportsError(Exception):
    """Raised in place of after_imports: the command got that far, and no further."""


def _stop(*args) -> None:
    raise ReachedAfterImportsError


@pytest.mark.parametrize(
    "argv",
    [
        ["pretrain", "--family", "decoder", "--output-dir", "{tmp}/out"],
        ["finetune", "--task", "causal-lm", "--model", "{tmp}", "--output-dir", "{tmp}/out"],
        ["evaluate", "{tmp}"],
        ["convert", "{tmp}", "{tmp}/out"],
        ["export", "{tmp}", "{tmp}/out"],
    ],
    ids=lambda argv: argv[0],
)
def test_every_command_freezes_what_its_imports_made_before_its_work(tmp_path, monkeypatch, argv):
    monkeypatch.setattr(coreformer_cli, "after_imports", _stop)  # the one function every command calls
    with pytest.raises(ReachedAfterImportsError):
        coreformer_cli.main([part.format(tmp=tmp_path) for part in argv])
    assert not (tmp_path / "out").exists()  # nothing ran before it


def test_after_imports_moves_every_live_object_out_of_the_collectors_sight():
    gc.unfreeze()  # the suite's own freeze (conftest), restored below
    try:
        assert gc.get_freeze_count() == 0
        coreformer_cli.after_imports()
        assert gc.get_freeze_count() > 100_000  # torch and transformers: hundreds of thousands of objects
    finally:
        gc.freeze()


def test_the_startup_benchmark_times_every_command_in_both_arms_and_writes_its_table(tmp_path, monkeypatch):
    benchmark = sibling("command_startup")
    launched = []

    def timed(code: str, arguments: list[str]) -> dict[str, float]:
        launched.append((code, arguments))
        return {"wall_s": 1.0 + len(launched), "cpu_s": 0.5 + len(launched)}

    monkeypatch.setattr(benchmark, "timed", timed)
    assert benchmark.main(["--repeats", "2", "--output-dir", str(tmp_path), "--note", "a check"]) == 0
    report = json.loads((tmp_path / "command_startup.json").read_text())
    names = list(benchmark.commands(tmp_path))
    assert [(row["command"], row["arm"]) for row in report["results"]] == [
        (name, arm) for name in names for arm in benchmark.ARMS
    ]
    assert len(launched) == 2 * len(names) * len(benchmark.ARMS)  # the arms alternate, every repeat
    assert [code for code, _ in launched[:2]] == [
        "import coreformer.training.pretraining\nimport coreformer_cli; coreformer_cli.after_imports()",
        "import coreformer.training.pretraining\n",
    ]
    pretrain = [(code, arguments) for code, arguments in launched if arguments[:1] == ["pretrain"]]
    assert "after_imports = lambda: None" not in pretrain[0][0] and "after_imports = lambda: None" in pretrain[1][0]
    first = report["results"][0]
    assert (first["min_wall_s"], first["median_wall_s"], first["min_cpu_s"]) == (2.0, 3.0, 1.5)
    table = (tmp_path / "command_startup.md").read_text()
    assert table.startswith("# What a small coreformer command costs besides its work")
    assert "(a check)" in table and "- command: `python benchmarks/command_startup.py --repeats 2" in table
    assert "| pretrain | collector untouched |" in table


def test_the_untouched_arm_replaces_the_function_the_commands_call(monkeypatch):
    benchmark = sibling("command_startup")
    monkeypatch.setattr(coreformer_cli, "after_imports", coreformer_cli.after_imports)  # restored after
    exec(benchmark.ARMS["collector untouched"][0], {})
    assert coreformer_cli.after_imports() is None and coreformer_cli.after_imports.__name__ == "<lambda>"
