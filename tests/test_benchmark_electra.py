"""benchmarks/electra_vs_mlm.py --tiny: both objectives pretrain at each budget, every encoder (and a random one)
loads with only its new classifier missing and fine-tunes; the JSON, the markdown tables and the plot are written with
FLOPs that follow the tokens seen; an equal-FLOPs run spends its budgets and keeps the equal-time section beside it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "benchmarks" / "electra_vs_mlm.py"), "--tiny", "--output-dir", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HF_MODULES_CACHE": str(tmp_path / "m")}
    result = subprocess.run(command + list(flags), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def check_rows(section: dict, budgets: list[float]) -> None:
    rows = section["results"]
    assert [(r["objective"], r["budget"]) for r in rows] == [
        ("masked-lm", budgets[0]), ("masked-lm", budgets[1]), ("electra", budgets[0]), ("electra", budgets[1])
    ]  # fmt: skip
    for row in rows:
        assert row["steps"] >= 2 and row["train_time_s"] > 0 and 0.0 <= row["accuracy_mean"] <= 1.0
        expected = row["flops_per_token"] * row["tokens_seen"] + row["flops_per_step"] * row["steps"]
        assert row["pretraining_flops"] == pytest.approx(expected)
        assert row["newly_initialised"] == ["classifier.dense", "classifier.out_proj"]  # the encoder loaded
        assert row["mlm_loss"] > 0
    masked, electra = rows[0], rows[2]
    assert electra["flops_per_step"] > 0 == masked["flops_per_step"]  # projecting the shared tables
    assert 0.5 < electra["rtd_base_rate"] < 1.0 and 0.0 <= electra["rtd_accuracy"] <= 1.0
    assert "rtd_accuracy" not in masked
    assert 0.0 <= section["baseline"]["accuracy_mean"] <= 1.0


@pytest.mark.slow
def test_electra_vs_mlm_tiny_at_equal_time_then_equal_flops(tmp_path):
    timed = run_benchmark(tmp_path)
    report = json.loads((tmp_path / "electra_vs_mlm_tiny.json").read_text())
    check_rows(report["sections"]["equal-time"], [1.0, 2.0])
    table = (tmp_path / "electra_vs_mlm_tiny.md").read_text()
    assert "| none (random init) | 0 |" in table and table.count("| electra |") == 2
    assert table in timed.stdout

    run_benchmark(tmp_path, "--flops-budgets", "1", "--note", "under load")
    report = json.loads((tmp_path / "electra_vs_mlm_tiny.json").read_text())
    assert set(report["sections"]) == {"equal-time", "equal-flops"}  # the equal-time section is kept
    flops = report["sections"]["equal-flops"]
    check_rows(flops, [5e8, 1e9])
    for row in flops["results"]:  # each run's steps spend its budget: within one step of it
        per_step = row["pretraining_flops"] / row["steps"]
        assert abs(row["pretraining_flops"] - row["budget"]) <= per_step
    table = (tmp_path / "electra_vs_mlm_tiny.md").read_text()
    assert "### equal-time" in table and "### equal-flops: budgets in training FLOPs (under load)" in table
    assert table.count("| electra |") == 4
    assert (tmp_path / "electra_vs_mlm_tiny.png").stat().st_size > 10_000
