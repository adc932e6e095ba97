"""benchmarks/default_finetuning.py --tiny: the default encoder pretrained as a user does (at a tiny size), a random
one of its config beside it, both fine-tuned on the embedded default with the same command seed by seed; a candidate
setting before the defaults; the JSON and the markdown written. By hand: the paired differences."""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "default_finetuning.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("default_finetuning", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_default_finetuning_tiny_pairs_the_pretrained_encoder_with_random_init_seed_by_seed(tmp_path):
    benchmark = load_benchmark()
    argv = ["--tiny", "--output-dir", str(tmp_path), "--candidates", "--lr 1e-3", "--note", "under load"]
    assert benchmark.main(argv) == 0

    report = json.loads((tmp_path / "default_finetuning_tiny.json").read_text())
    assert report["data"] == {"train": 1600, "validation": 400, "labels": ["corrupted", "original"]}
    pretraining = report["pretraining"]
    assert pretraining["command"].startswith("coreformer pretrain --family encoder --config ")
    # the --config file is recorded where a preset name would be
    assert (pretraining["family"], pretraining["preset"], pretraining["steps"]) == ("encoder", "tiny.yaml", 4)
    shapes = report["encoders"]
    assert shapes["random init"] == shapes["pretrained"] and shapes["pretrained"]["hidden_size"] == 32
    assert [(s["flags"], s["seeds"]) for s in report["settings"]] == [("--lr 1e-3", 1), ("", 2)]  # defaults last
    for setting in report["settings"]:
        encoders = setting["encoders"]
        assert list(encoders) == ["random init", "pretrained"]
        for result in encoders.values():
            assert len(result["accuracies"]) == setting["seeds"]
            assert all(0.0 <= accuracy <= 1.0 for accuracy in result["accuracies"])
            assert result["accuracy_mean"] == pytest.approx(statistics.fmean(result["accuracies"]))
        differences = [
            a - b for a, b in zip(encoders["pretrained"]["accuracies"], encoders["random init"]["accuracies"])
        ]
        paired = setting["paired_vs_random_init"]
        assert list(paired) == ["pretrained"]
        assert paired["pretrained"]["mean"] == pytest.approx(statistics.fmean(differences))
        assert paired["pretrained"]["wins"] == sum(d > 0 for d in differences)
    table = (tmp_path / "default_finetuning_tiny.md").read_text()
    assert "(under load)" in table and "- command: `python benchmarks/default_finetuning.py --tiny" in table
    assert "| `--lr 1e-3` | pretrained |" in table and "| defaults | random init |" in table
