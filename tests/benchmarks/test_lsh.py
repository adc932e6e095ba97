"""benchmarks/lsh.py's two parts run alone at tiny sizes and each writes its own results file (machine, date and
command at the top); the speed part states from its rows where LSH pays off. The numbers are measured by running
the script, not here."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--heads", "2", "--head-dim", "8", "--bucket-size", "4", "--recall-bucket-size", "2", "--num-buckets", "4"]
TINY += ["--pairs", "3", "--recall-steps", "2", "--repeats", "1", "--threads", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("lsh_benchmark", ROOT / "benchmarks" / "lsh.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(seconds: dict[int, tuple[float, float]], memory: dict[int, tuple[float, float]]) -> dict:
    """{(type, length): row} from {length: (full, lsh)} seconds and MiB."""
    cells = {}
    for length, (full, lsh) in seconds.items():
        cells[("full", length)] = {"seconds": full, "peak_mib": memory[length][0]}
        cells[("lsh", length)] = {"seconds": lsh, "peak_mib": memory[length][1]}
    return cells


def test_the_payoff_length_is_read_from_the_measured_rows(bench):
    lengths = [1024, 2048, 4096, 8192]
    seconds = {1024: (1, 2), 2048: (2, 3), 4096: (5, 4), 8192: (20, 8)}
    memory = {1024: (10, 1), 2048: (20, 2), 4096: (40, 4), 8192: (80, 8)}
    time_line, memory_line = bench.payoff_lines(_rows(seconds, memory), lengths)
    assert time_line == (
        "- LSH is faster than full sdpa from L = 4096 on (not at 2048): it pays off between 2048 and 4096 tokens."
    )
    assert memory_line == "- LSH is lighter in peak memory than full sdpa at every measured length, from L = 1024 on."
    # A win that does not last to the longest length is no payoff length; no win at all is said as such.
    seconds = {1024: (1, 2), 2048: (3, 2), 4096: (5, 4), 8192: (20, 30)}
    memory = {1024: (1, 10), 2048: (2, 20), 4096: (4, 40), 8192: (8, 80)}
    time_line, memory_line = bench.payoff_lines(_rows(seconds, memory), lengths)
    assert time_line == "- LSH was faster than full sdpa at L = 2048, 4096, but not at the longest, 8192."
    assert memory_line == "- LSH was not lighter in peak memory than full sdpa at any measured length (up to L = 8192)."


def _check_header(text: str, part: str) -> None:
    title, blank, machine, command = text.splitlines()[:4]
    assert title.startswith("### LSH attention") and not blank
    assert machine.startswith("Machine: ") and "torch " in machine and "threads" in machine and " UTC." in machine
    assert command.startswith("Command: `python ") and f"--part {part}" in command


@pytest.mark.slow
def test_the_quality_part_runs_alone_and_writes_its_own_file(bench, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["benchmarks/lsh.py", "--part", "quality", *TINY])
    bench.main(["--part", "quality", *TINY, "--results-dir", str(tmp_path)])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lsh_quality.md"]
    text = (tmp_path / "lsh_quality.md").read_text()
    _check_header(text, "quality")
    for row in ("| full |", "| sliding |", "| lsh |", "| lsh, its lsh layers' output zeroed |"):
        assert row in text
    assert "sliding window 2, the same number of earlier keys per query" in text  # 2 rounds x (bucket 2 - 1)
    shares = [float(word.rstrip(".;")) for word in text.split("mass")[-1].split() if word[:2] == "0."]
    assert len(shares) == 2 and all(0 < share <= 1 for share in shares)


def test_the_speed_part_runs_alone_and_states_where_lsh_pays_off(bench, tmp_path, monkeypatch, capsys):
    # Each (type, length) is measured in a child process (`--one`); here the children's work runs in this process.
    bench.main(["--one", "lsh", "32", *TINY])
    child = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert child["type"] == "lsh" and child["length"] == 32 and child["seconds"] > 0

    def in_process(args):
        return [bench.measure_one(name, length, args) for length in args.lengths for name in bench.SPEED_TYPES]

    monkeypatch.setattr(bench, "measure_all", in_process)
    monkeypatch.setattr("sys.argv", ["benchmarks/lsh.py", "--part", "speed", *TINY])
    bench.main(["--part", "speed", "--lengths", "16", "32", *TINY, "--results-dir", str(tmp_path)])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lsh_speed.md"]
    text = (tmp_path / "lsh_speed.md").read_text()
    _check_header(text, "speed")
    assert "| L | full s | full MiB | sliding s | sliding MiB | lsh s | lsh MiB | lsh / full time |" in text
    assert "\n| 16 |" in text and "\n| 32 |" in text
    payoff = [line for line in text.splitlines() if line.startswith("- LSH")]
    assert len(payoff) == 2 and "faster than full sdpa" in payoff[0] and "peak memory" in payoff[1]
