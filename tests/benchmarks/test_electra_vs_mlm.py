"""benchmarks/electra_vs_mlm.py --tiny: masked LM and ELECTRA at 1/4 and 1/2 generator width, each run spending its
FLOPs budget; the gates (held-out MLM loss against the unigram entropy, the discriminator's AUC and RTD loss against
the constant answer) beside each run; every encoder of the largest budget (and a random one) loads with only its new
classifier missing, fine-tunes with its lr chosen on dev, and is paired by seed; the JSON, the markdown and the plot
are written. By hand: the paired differences, the AUC against counting the pairs (ties half), the budget check.
benchmarks/electra_rtd_probe.py: its AUC against counting the pairs, and its gradient groups."""

import importlib.util
import json
import math
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


@pytest.mark.slow
def test_electra_vs_mlm_tiny_spends_each_budget_scores_the_gates_and_pairs_the_encoders(tmp_path):
    benchmark = load_benchmark()
    assert benchmark.main(["--tiny", "--output-dir", str(tmp_path), "--note", "under load"]) == 0

    report = json.loads((tmp_path / "electra_vs_mlm_tiny.json").read_text())
    budgets, variants = [3e8, 6e8], ["masked-lm", "electra, 1/4 width", "electra, 1/2 width"]
    runs = report["runs"]
    assert [(r["variant"], r["budget"], r["seed"]) for r in runs] == [(v, b, 0) for v in variants for b in budgets]
    entropy = report["unigram_entropy"]
    assert 3.0 < entropy < math.log(384)  # below the uniform distribution over the tiny vocabulary
    for row in runs:  # each run's steps spend its budget: within one step of it
        expected = row["flops_per_token"] * row["tokens_seen"] + row["flops_per_step"] * row["steps"]
        assert row["pretraining_flops"] == pytest.approx(expected)
        assert abs(row["pretraining_flops"] - row["budget"]) <= row["pretraining_flops"] / row["steps"]
        assert row["mlm_loss"] > 0 and row["gates"]["context_learned"] == (entropy - row["mlm_loss_at_masks"] >= 1.0)
        assert 0 < row["mlm_tokens_at_masks"] < row["mlm_tokens"]  # BERT's 80% of the selected tokens
    masked, quarter, half = runs[0], runs[2], runs[4]
    assert "rtd_auc" not in masked and masked["flops_per_step"] == 0 < quarter["flops_per_step"]
    assert quarter["flops_per_token"] < half["flops_per_token"]  # the wider generator costs more per token
    for electra in runs[2:]:
        assert 0.0 <= electra["rtd_auc"] <= 1.0 and 0.5 < electra["rtd_base_rate"] < 1.0
        base = electra["rtd_base_rate"]
        assert electra["rtd_constant_loss"] == pytest.approx(-(base * math.log(base) + (1 - base) * math.log(1 - base)))
        detected = electra["rtd_auc"] >= 0.6 and electra["rtd_loss"] < electra["rtd_constant_loss"]
        assert electra["gates"]["replacements_detected"] == detected
    task = report["tasks"]["corrupted"]
    assert list(task["encoders"]) == ["random init"] + [f"{v} 6e+08, seed 0" for v in variants]  # the largest budget
    for result in task["encoders"].values():
        assert result["newly_initialised"] == ["classifier.dense", "classifier.out_proj"]  # the encoder loaded
        assert len(result["accuracies"]) == 2 and result["lr"] in (1e-4, 3e-4)
    assert [c["what"] for c in task["paired"]] == [
        "masked-lm 6e+08, seed 0 - random init",
        "electra, 1/4 width 6e+08, seed 0 - random init",
        "electra, 1/4 width 6e+08, seed 0 - masked-lm 6e+08, seed 0",
        "electra, 1/2 width 6e+08, seed 0 - random init",
        "electra, 1/2 width 6e+08, seed 0 - masked-lm 6e+08, seed 0",
    ]
    assert [c["what"] for c in task["across_pretraining_seeds"]] == [
        "masked-lm 6e+08 - random init",
        "electra, 1/4 width 6e+08 - random init",
        "electra, 1/4 width 6e+08 - masked-lm 6e+08",
        "electra, 1/2 width 6e+08 - random init",
        "electra, 1/2 width 6e+08 - masked-lm 6e+08",
    ]
    assert [(v["electra"], v["pretraining_seeds"]) for v in report["verdicts"]] == [
        (f"{v} 6e+08", 1) for v in variants[1:]
    ]
    table = (tmp_path / "electra_vs_mlm_tiny.md").read_text()
    assert table.startswith("# ELECTRA against masked LM at equal training FLOPs")
    assert "(under load)" in table and "- command: `python benchmarks/electra_vs_mlm.py --tiny" in table
    assert table.count("| electra, 1/2 width | ") == 2 and "| corrupted | electra, 1/4 width 6e+08 - masked-lm" in table
    assert "| corrupted | electra, 1/4 width 6e+08, seed 0 - masked-lm 6e+08, seed 0 |" in table
    assert (tmp_path / "electra_vs_mlm_tiny.png").stat().st_size > 10_000


def test_roc_auc_is_the_share_of_positive_negative_pairs_ranked_right_ties_counting_half():
    benchmark = load_benchmark()
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 20, (300,), generator=generator).float()  # many ties
    positives = torch.rand(300, generator=generator) < 0.3
    scores = scores + 3 * positives  # some signal
    above = scores[positives][:, None] > scores[~positives][None, :]  # every (positive, negative) pair
    tied = scores[positives][:, None] == scores[~positives][None, :]
    assert benchmark.roc_auc(scores, positives) == pytest.approx(
        (above.double().mean() + tied.double().mean() / 2).item()
    )
    assert (
        benchmark.roc_auc(positives.float(), positives) == 1.0
        and benchmark.roc_auc(-positives.float(), positives) == 0.0
    )
    assert benchmark.roc_auc(torch.zeros(10), torch.arange(10) < 4) == 0.5  # a constant score: no signal
    with pytest.raises(ValueError, match="both classes"):
        benchmark.roc_auc(torch.randn(5), torch.zeros(5))


def test_finetune_budgets_must_be_among_the_pretraining_budgets():
    benchmark = load_benchmark()
    assert benchmark.parse_args(["--flops-budgets", "2e13", "1e13"]).finetune_budgets == [2e13]  # the largest
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--flops-budgets", "1e13", "--finetune-budgets", "3e13"])


def test_paired_differences_are_seed_by_seed():
    benchmark = load_benchmark()
    difference = benchmark.paired([0.5, 0.7, 0.6], [0.4, 0.8, 0.5])  # differences +0.1, -0.1, +0.1
    assert difference["mean"] == pytest.approx(0.1 / 3)
    assert difference["std"] == pytest.approx((((0.1 - 0.1 / 3) ** 2 * 2 + (0.1 + 0.1 / 3) ** 2) / 3) ** 0.5)
    assert (difference["wins"], difference["seeds"]) == (2, 3)
    with pytest.raises(ValueError):
        benchmark.paired([0.5], [0.4, 0.8])  # unpaired seeds are refused, not truncated


def test_pretraining_seeds_pair_each_electra_run_with_the_masked_lm_run_of_its_seed():
    benchmark = load_benchmark()
    runs = [
        {"variant": variant, "objective": objective, "budget": 1e13, "seed": seed}
        for variant, objective in (("masked-lm", "masked-lm"), ("electra, 1/4 width", "electra"))
        for seed in (0, 1)
    ]

    def result(*accuracies):
        return {"accuracies": list(accuracies), "accuracy_mean": sum(accuracies) / len(accuracies)}

    results = {
        "random init": result(0.5, 0.5),
        "masked-lm 1e+13, seed 0": result(0.6, 0.8),  # mean 0.7
        "masked-lm 1e+13, seed 1": result(0.5, 0.7),  # mean 0.6
        "electra, 1/4 width 1e+13, seed 0": result(0.7, 0.7),  # mean 0.7: ties its masked LM
        "electra, 1/4 width 1e+13, seed 1": result(0.8, 0.8),  # mean 0.8: +0.3, +0.1 on its masked LM
    }
    by_seed = {row["what"]: row for row in benchmark.comparisons("t", results, runs)}
    seed_one = by_seed["electra, 1/4 width 1e+13, seed 1 - masked-lm 1e+13, seed 1"]
    assert seed_one["mean"] == pytest.approx(0.2) and seed_one["wins"] == 2  # fine-tuning seed by seed
    assert "electra, 1/4 width 1e+13, seed 1 - masked-lm 1e+13, seed 0" not in by_seed  # never across seeds
    across = {row["what"]: row for row in benchmark.across_pretraining_seeds("t", results, runs)}
    electra = across["electra, 1/4 width 1e+13 - masked-lm 1e+13"]  # per-seed means: 0.7 - 0.7, 0.8 - 0.6
    assert electra["mean"] == pytest.approx(0.1) and electra["std"] == pytest.approx(0.1)
    assert (electra["wins"], electra["seeds"]) == (1, 2)
    assert across["masked-lm 1e+13 - random init"]["mean"] == pytest.approx(0.15)


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
    from tiny import tiny_electra

    model, _ = tiny_electra()
    groups = load_probe().parameter_groups(model)
    grouped = [id(p) for parameters in groups.values() for p in parameters]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each once, none left out
    encoder = model.discriminator.model.encoder
    tables = [encoder.embed_tokens, encoder.embed_positions, encoder.token_type_embeddings]  # all learned here
    assert [id(p) for p in groups["shared_tables"]] == [id(table.weight) for table in tables]
    assert [id(p) for p in groups["projection"]] == [id(model.embedding_projection.weight)]
