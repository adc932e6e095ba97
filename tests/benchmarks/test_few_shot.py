"""benchmarks/few_shot.py: draws of a few rows per class, seeded and balanced; the likelihood classifier (a logistic
regression on masked-LM scores) by hand on scores with a known answer; --tiny end to end: every encoder and both
methods on the same draws, paired against random init, the settings chosen on dev, the JSON and the markdown
written."""

import json

import pytest
import torch
from results_files import sibling


def load_benchmark():
    return sibling("few_shot")


def rows(count: int) -> list[dict]:
    return [{"text": f"line {i}", "label": "corrupted" if i % 2 else "as written"} for i in range(count)]


def test_a_draw_takes_the_same_count_of_every_label_and_its_seed_fixes_which():
    benchmark = load_benchmark()
    pool = rows(40)
    first = benchmark.draw(pool, 4, seed=0)
    assert [row["label"] for row in first] == ["as written"] * 4 + ["corrupted"] * 4
    assert first == benchmark.draw(pool, 4, seed=0)
    assert first != benchmark.draw(pool, 4, seed=1)
    assert all(row in pool for row in first) and len({row["text"] for row in first}) == 8
    with pytest.raises(ValueError, match="--shots 21: the split holds only 20 rows labelled 'as written'"):
        benchmark.draw(pool, 21, seed=0)


def test_the_likelihood_classifier_learns_the_direction_of_a_score_and_stays_at_chance_without_one():
    benchmark = load_benchmark()
    pool = rows(40)
    # a corrupted line is less likely: lower mean log-prob; its lowest token says nothing (the same for every line)
    table = {benchmark.row_key(row): {"mean": -5.0 - (i % 2) - 0.01 * i, "lowest": -9.0} for i, row in enumerate(pool)}
    training, evaluation = benchmark.draw(pool, 3, seed=0), pool
    assert benchmark.likelihood_accuracy(table, "mean log-prob", training, evaluation, "corrupted") == 1.0
    flipped = {key: {"mean": -value["mean"], "lowest": -9.0} for key, value in table.items()}  # the other direction
    assert benchmark.likelihood_accuracy(flipped, "mean log-prob", training, evaluation, "corrupted") == 1.0
    assert benchmark.likelihood_accuracy(table, "lowest log-prob", training, evaluation, "corrupted") == 0.5


def test_pair_tasks_may_choose_mutual_information_and_single_texts_may_not():
    benchmark = load_benchmark()
    assert benchmark.scores_for(pair=False) == ["mean log-prob", "lowest log-prob"]
    assert benchmark.scores_for(pair=True) == ["mean log-prob", "lowest log-prob", "mutual information", "all"]
    predict = benchmark.fit_logistic(torch.tensor([[0.0], [1.0]], dtype=torch.float64), torch.tensor([0.0, 1.0]))
    assert predict(torch.tensor([[-1.0], [2.0]], dtype=torch.float64)).tolist() == [False, True]


@pytest.mark.slow
def test_few_shot_tiny_scores_every_encoder_both_ways_on_the_same_draws(tmp_path):
    benchmark = load_benchmark()
    assert benchmark.main(["--tiny", "--tasks", "corrupted", "next-line", "--output-dir", str(tmp_path)]) == 0

    report = json.loads((tmp_path / "few_shot_tiny.json").read_text())
    assert [row["recipe"] for row in report["pretraining"]] == ["tiny-faithful", "tiny-modern"]
    assert list(report["tasks"]) == ["corrupted", "next-line"]
    for task, entry in report["tasks"].items():
        encoders = entry["encoders"]
        assert list(encoders) == ["random init", "tiny-faithful", "tiny-modern"]
        for name, methods in encoders.items():
            finetuned, likelihood = methods["fine-tuned"], methods["likelihood"]
            assert finetuned["lr"] == 1e-3 and list(finetuned["dev_accuracy"]) == ["0.001"]
            assert likelihood["score"] in benchmark.scores_for(pair=task == "next-line")
            assert likelihood["dev_accuracy"][likelihood["score"]] == max(likelihood["dev_accuracy"].values())
            for result in (finetuned, likelihood):
                assert len(result["accuracies"]) == 2 and all(0.0 <= a <= 1.0 for a in result["accuracies"])
                if name == "random init":
                    assert "paired_vs_random" not in result
                    continue
                baseline = encoders["random init"]["fine-tuned" if result is finetuned else "likelihood"]
                differences = [a - b for a, b in zip(result["accuracies"], baseline["accuracies"], strict=True)]
                assert result["paired_vs_random"]["mean"] == pytest.approx(sum(differences) / 2)
                assert result["paired_vs_random"]["wins"] == sum(d > 0 for d in differences)
    text = (tmp_path / "few_shot_tiny.md").read_text()
    assert text.startswith("# Few-shot: pretrained encoders fine-tuned, or scored by their masked-LM head")
    assert "- command: `python benchmarks/few_shot.py --tiny --tasks corrupted next-line" in text
    assert "| corrupted | context: was the line corrupted | tiny-modern |" in text
