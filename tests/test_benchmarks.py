"""The benchmark harnesses run end to end at tiny sizes (their numbers are measured by running them, not here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_long_context_benchmark_runs_and_writes_table_json_and_plot(tmp_path):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "long_context.py"),
        "--lengths",
        "32",
        "64",
        "--repeats",
        "1",
        "--types",
        "full",
        "sliding",
        "linear",
        "--hidden-size",
        "32",
        "--heads",
        "2",
        "--window",
        "8",
        "--recall-steps",
        "2",
        "--output-dir",
        str(tmp_path),
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| sliding |" in result.stdout and "associative recall accuracy" in result.stdout
    report = json.loads((tmp_path / "long_context.json").read_text())
    assert {(r["type"], r["length"]) for r in report["results"]} == {
        (t, n) for t in ("full", "sliding", "linear") for n in (32, 64)
    }
    assert all(r["seconds"] > 0 for r in report["results"])
    assert set(report["recall_accuracy"]) == {"full", "sliding", "strided", "linear"}
    assert (tmp_path / "long_context.png").stat().st_size > 10_000


@pytest.mark.slow
def test_compare_harness_runs_and_checks_both_models_compute_the_same_function(tmp_path):
    # The harness refuses to time a pair whose outputs or generated tokens differ, so a clean exit means every
    # path (training fp32/bf16, padded encoder, dynamic and static cache generation, seq2seq) matched.
    output = tmp_path / "compare.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--tiny", "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(output.read_text())["rows"]
    assert len(rows) == 7 and all(row["coreformer_per_s"] > 0 and row["reference_per_s"] > 0 for row in rows)
    assert "| decoder training step (bf16) |" in result.stdout
    bf16_row = next(row for row in rows if row["benchmark"] == "decoder training step (bf16)")
    assert 0 < bf16_row["coreformer_peak_fraction"] and bf16_row["flops_per_token"] > 0
    assert "of the measured bf16 GEMM peak" in result.stdout
