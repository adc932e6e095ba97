"""benchmarks/packing.py runs end to end at a tiny size (its numbers are measured by running it, not here)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_packing_benchmark_tiny_compares_every_mode_at_equal_real_tokens(tmp_path):
    spec = importlib.util.spec_from_file_location("packing_benchmark", ROOT / "benchmarks" / "packing.py")
    packing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(packing)

    flags = ["--tiny", "--families", "decoder", "--documents", "lines", "--max-files", "12"]
    assert packing.main([*flags, "--output-dir", str(tmp_path), "--note", "under load"]) == 0
    report = json.loads((tmp_path / "packing_tiny.json").read_text())
    (section,) = report["sections"]
    assert (section["family"], section["documents"]) == ("decoder", "lines")
    rows = {row["packing"]: row for row in section["results"]}
    assert list(rows) == ["concatenated", "padded", "packed"]
    budget = report["settings"]["budget"]
    for row in rows.values():  # every mode spends the budget of real tokens (its steps sized on its first batches)
        assert 0.8 * budget <= row["real_tokens"] < 1.25 * budget
        assert row["tokens_per_second"] >= row["real_tokens_per_second"] > 0
        assert row["held_out_objective"] == "causal LM" and row["held_out_loss"] > 0
    # Lines are short: one per padded row leaves most of the row padding; packed rows pad only their tails.
    assert rows["padded"]["pad_share"] > 0.3 > 0.05 > rows["packed"]["pad_share"]
    assert rows["concatenated"]["pad_share"] == 0.0
    assert rows["padded"]["steps"] > rows["packed"]["steps"]
    assert rows["padded"]["speedup_vs_padded"] == 1.0
    text = (tmp_path / "packing_tiny.md").read_text()
    assert text.startswith("# Packed against padded pretraining, at equal real tokens")
    assert "- machine: " in text and "(under load)" in text
    assert "- command: `python benchmarks/packing.py --tiny --families decoder" in text
    assert "| packed |" in text and "| padded |" in text
