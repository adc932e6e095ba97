"""benchmarks/electra_vs_mlm.py --tiny: one run at equal time and at equal FLOPs, both objectives at each budget, every
encoder (and a random one) loads with only its new classifier missing and fine-tunes; the JSON, the markdown tables
(with the seed-paired differences) and the plot are written with FLOPs that follow the tokens seen, and each
equal-FLOPs run spends its budget. By hand: the paired differences, and a run replacing only its own kind's section.
benchmarks/electra_rtd_probe.py: its AUC against counting the pairs, and its gradient groups."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "electra_vs_mlm.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("electra_vs_mlm", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_rows(section: dict, budgets: list[float], seeds: int) -> None:
    rows = section["results"]
    assert [(r["objective"], r["budget"]) for r in rows] == [
        ("masked-lm", budgets[0]), ("masked-lm", budgets[1]), ("electra", budgets[0]), ("electra", budgets[1])
    ]  # fmt: skip
    for row in rows:
        assert row["steps"] >= 2 and row["train_time_s"] > 0 and 0.0 <= row["accuracy_mean"] <= 1.0
        assert len(row["accuracies"]) == seeds
        expected = row["flops_per_token"] * row["tokens_seen"] + row["flops_per_step"] * row["steps"]
        assert row["pretraining_flops"] == pytest.approx(expected)
        assert row["newly_initialised"] == ["classifier.dense", "classifier.out_proj"]  # the encoder loaded
        assert row["mlm_loss"] > 0
    masked, electra = rows[0], rows[2]
    assert electra["flops_per_step"] > 0 == masked["flops_per_step"]  # projecting the shared tables
    assert 0.5 < electra["rtd_base_rate"] < 1.0 and 0.0 <= electra["rtd_accuracy"] <= 1.0
    base = electra["rtd_base_rate"]
    assert electra["rtd_constant_loss"] == pytest.approx(-(base * math.log(base) + (1 - base) * math.log(1 - base)))
    assert "rtd_accuracy" not in masked
    assert 0.0 <= section["baseline"]["accuracy_mean"] <= 1.0
    # 4 against the random encoder, 2 ELECTRA against masked LM at the same budget
    assert [c["what"] for c in section["paired"]][-2:] == [f"electra - masked-lm at {b:g}" for b in budgets]
    assert len(section["paired"]) == 6


@pytest.mark.slow
def test_electra_vs_mlm_tiny_at_equal_time_and_equal_flops_in_one_run(tmp_path):
    command = [sys.executable, str(BENCHMARK), "--tiny", "--output-dir", str(tmp_path)]
    command += ["--budgets", "1", "--flops-budgets", "1", "--note", "under load"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HF_MODULES_CACHE": str(tmp_path / "m")}
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    report = json.loads((tmp_path / "electra_vs_mlm_tiny.json").read_text())
    assert list(report["sections"]) == ["equal-time", "equal-flops"]
    timed, flops = report["sections"]["equal-time"], report["sections"]["equal-flops"]
    check_rows(timed, [1.0, 2.0], seeds=1)
    check_rows(flops, [5e8, 1e9], seeds=1)
    assert timed["baseline"] == flops["baseline"]  # one random encoder, fine-tuned once, for both kinds
    for row in flops["results"]:  # each run's steps spend its budget: within one step of it
        per_step = row["pretraining_flops"] / row["steps"]
        assert abs(row["pretraining_flops"] - row["budget"]) <= per_step
    table = (tmp_path / "electra_vs_mlm_tiny.md").read_text()
    assert "### equal-time: budgets in seconds of training (under load)" in table
    assert "### equal-flops: budgets in training FLOPs (under load)" in table
    assert table.count("| none (random init) | 0 |") == 2 and table.count("| electra |") == 4
    assert table.count("| electra - masked-lm at ") == 4
    assert table in result.stdout
    assert (tmp_path / "electra_vs_mlm_tiny.png").stat().st_size > 10_000


def test_paired_differences_are_seed_by_seed():
    benchmark = load_benchmark()
    difference = benchmark.paired([0.5, 0.7, 0.6], [0.4, 0.8, 0.5])  # differences +0.1, -0.1, +0.1
    assert difference["mean"] == pytest.approx(0.1 / 3)
    assert difference["std"] == pytest.approx((((0.1 - 0.1 / 3) ** 2 * 2 + (0.1 + 0.1 / 3) ** 2) / 3) ** 0.5)
    assert (difference["wins"], difference["seeds"]) == (2, 3)
    with pytest.raises(ValueError):
        benchmark.paired([0.5], [0.4, 0.8])  # unpaired seeds are refused, not truncated


def test_a_run_replaces_its_own_kind_of_section_and_keeps_the_others():
    benchmark = load_benchmark()
    report = {"sections": {"equal-flops": {"note": "old flops"}, "equal-time": {"note": "quiet"}}}
    sections = benchmark.merge_section(report, "equal-flops", {"note": "new flops"})
    assert sections == {"equal-time": {"note": "quiet"}, "equal-flops": {"note": "new flops"}}  # in KINDS order
    assert report["sections"]["equal-time"] == {"note": "quiet"}


def load_probe():
    spec = importlib.util.spec_from_file_location("electra_rtd_probe", ROOT / "benchmarks" / "electra_rtd_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_auc_is_the_share_of_replaced_original_pairs_ranked_right():
    probe = load_probe()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(200, generator=generator)
    replaced = (torch.rand(200, generator=generator) < 0.3).float()
    logits = logits + replaced  # some signal
    pairs = logits[replaced == 1][:, None] > logits[replaced == 0][None, :]  # every (replaced, original) pair
    assert probe.roc_auc(logits, replaced) == pytest.approx(pairs.float().mean().item())
    assert probe.roc_auc(replaced * 5, replaced) == pytest.approx(1.0)


def test_probe_gradient_groups_split_every_parameter_once():
    from conftest import tiny_electra

    model, _ = tiny_electra()
    groups = load_probe().parameter_groups(model)
    grouped = [id(p) for parameters in groups.values() for p in parameters]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each once, none left out
    encoder = model.discriminator.model.encoder
    tables = [encoder.embed_tokens, encoder.embed_positions, encoder.token_type_embeddings]  # all learned here
    assert [id(p) for p in groups["shared_tables"]] == [id(table.weight) for table in tables]
    assert [id(p) for p in groups["projection"]] == [id(model.embedding_projection.weight)]
