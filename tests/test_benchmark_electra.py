"""benchmarks/electra_vs_mlm.py --tiny: both objectives pretrain at each budget, every encoder (and a random one)
fine-tunes, and the JSON, the markdown table and the plot are written with FLOPs that follow the tokens seen."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_electra_vs_mlm_tiny_writes_accuracy_against_compute(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "electra_vs_mlm.py"), "--tiny", "--output-dir", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HF_MODULES_CACHE": str(tmp_path / "m")}
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "electra_vs_mlm_tiny.json").read_text())
    rows = report["results"]
    assert [(r["objective"], r["budget_s"]) for r in rows] == [
        ("masked-lm", 1.0), ("masked-lm", 2.0), ("electra", 1.0), ("electra", 2.0)
    ]  # fmt: skip
    for row in rows:
        assert row["steps"] >= 2 and row["train_time_s"] > 0 and 0.0 <= row["accuracy_mean"] <= 1.0
        assert row["pretraining_flops"] == pytest.approx(row["flops_per_token"] * row["tokens_seen"])
    masked, electra = rows[0], rows[2]
    assert electra["flops_per_token"] > masked["flops_per_token"]  # the generator's forward and backward count too
    assert 0.0 <= report["baseline"]["accuracy_mean"] <= 1.0
    table = (tmp_path / "electra_vs_mlm_tiny.md").read_text()
    assert "| none (random init) | 0 |" in table and table.count("| electra |") == 2
    assert table in result.stdout
    assert (tmp_path / "electra_vs_mlm_tiny.png").stat().st_size > 10_000
