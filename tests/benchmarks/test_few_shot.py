"""benchmarks/few_shot.py: draws of a few rows per class, seeded and balanced; the likelihood classifier (a logistic
regression on masked-LM scores) by hand on scores with a known answer; head-tuning starts from the likelihood
classifier's own feature and learns its few examples; --tiny end to end: every encoder and every method on the same
draws, paired against random init, the settings chosen on dev, the JSON and the markdown written."""

import argparse
import json
import random

import pytest
import torch
from results_files import sibling

import coreformer as cf
from coreformer.training.corpora import read_source, stdlib_root
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer

LINES = [  # eight lines as written, eight corrupted (two adjacent names swapped)
    ("def add(first, second): return first + second", "as written"),
    ("for item in sorted(values): print(item)", "as written"),
    ("if name is None: raise ValueError(message)", "as written"),
    ("with open(path) as handle: data = handle.read()", "as written"),
    ("while queue: handle(queue.pop())", "as written"),
    ("class Point(object): pass", "as written"),
    ("return [line.strip() for line in lines]", "as written"),
    ("except KeyError as error: log(error)", "as written"),
    ("def add(second, first): return first + second", "corrupted"),
    ("for item in values(sorted): print(item)", "corrupted"),
    ("if None is name: raise ValueError(message)", "corrupted"),
    ("with open(handle) as path: data = handle.read()", "corrupted"),
    ("while handle: queue(queue.pop())", "corrupted"),
    ("class object(Point): pass", "corrupted"),
    ("return [strip.line() for line in lines]", "corrupted"),
    ("except error as KeyError: log(error)", "corrupted"),
]


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


def untrained_masked_lm(folder):
    """A tiny randomly initialised masked LM and its tokenizer, saved as the benchmark's encoders are."""
    text = "\n".join(read_source(stdlib_root() / name) for name in ("textwrap.py", "shlex.py"))
    tokenizer = train_tokenizer("encoder", [text], 320)
    torch.manual_seed(0)
    config = cf.CoreformerEncoderConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=160,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **token_config_kwargs(tokenizer, "encoder"),
    )
    cf.CoreformerEncoderForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_head_tuned_feature_of_an_untuned_encoder_is_the_likelihood_feature(tmp_path):
    benchmark = load_benchmark()
    folder = untrained_masked_lm(tmp_path / "encoder")
    model, tokenizer, _ = benchmark.load_language_model(folder)
    singles = [{"text": text, "label": label} for text, label in LINES]
    pairs = [{"text": LINES[i][0], "text_pair": LINES[i + 1][0], "label": "next"} for i in range(len(LINES) - 1)]
    for rows, pair in ((singles, False), (pairs, True)):
        terms = benchmark.row_terms(folder, rows, pair)  # every token, full logits: the library's way
        references = [terms[benchmark.row_key(row)] for row in rows]
        copies = benchmark.row_copies(tokenizer, rows, pair)
        with torch.no_grad():
            every_token = benchmark.tuned_feature(
                model.eval(), tokenizer.pad_token_id, copies, references, 10**6, random.Random(0)
            )
            some = benchmark.tuned_feature(model, tokenizer.pad_token_id, copies, references, 3, random.Random(0))
        expected = [benchmark.features(row)[benchmark.TUNED_FEATURE[pair]] for row in references]
        assert every_token.tolist() == pytest.approx(expected, abs=1e-5)
        assert not torch.allclose(some, every_token)  # three tokens of each text: another estimate of the mean


def test_head_tuning_learns_its_few_examples(tmp_path):
    benchmark = load_benchmark()
    folder = untrained_masked_lm(tmp_path / "encoder")
    rows = [{"text": text, "label": label} for text, label in LINES]
    terms = benchmark.row_terms(folder, rows, pair=False)

    def accuracy(steps: int) -> float:
        args = argparse.Namespace(tuned_steps=steps)
        return benchmark.head_tuned_accuracy(folder, terms, "corrupted", rows, rows, lr=3e-3, args=args)

    # the trained tokenizer and the seeded model are the same in every process, but a change to either redraws the
    # untrained scores: with 8 rows per label a random score separates them about once in 6,000 draws, and tuning's
    # margin holds from about 30 steps
    assert accuracy(0) < 1.0  # the untrained encoder's scores do not separate the rows
    assert accuracy(80) == 1.0  # tuned through its head on them, it tells them apart


def test_pair_tasks_may_choose_mutual_information_and_single_texts_may_not():
    benchmark = load_benchmark()
    assert benchmark.scores_for(pair=False) == ["mean log-prob", "lowest log-prob"]
    assert benchmark.scores_for(pair=True) == ["mean log-prob", "lowest log-prob", "mutual information", "all"]
    predict = benchmark.fit_logistic(torch.tensor([[0.0], [1.0]], dtype=torch.float64), torch.tensor([0.0, 1.0]))
    assert predict(torch.tensor([[-1.0], [2.0]], dtype=torch.float64)).tolist() == [False, True]


@pytest.mark.slow
def test_few_shot_tiny_scores_every_encoder_every_way_on_the_same_draws(tmp_path):
    benchmark = load_benchmark()
    assert benchmark.main(["--tiny", "--tasks", "corrupted", "next-line", "--output-dir", str(tmp_path)]) == 0

    report = json.loads((tmp_path / "few_shot_tiny.json").read_text())
    assert [row["recipe"] for row in report["pretraining"]] == ["tiny-faithful", "tiny-modern"]
    assert list(report["tasks"]) == ["corrupted", "next-line"]
    for task, entry in report["tasks"].items():
        encoders = entry["encoders"]
        assert list(encoders) == ["random init", "tiny-faithful", "tiny-modern"]
        for name, methods in encoders.items():
            assert list(methods) == list(benchmark.METHODS)
            for tuned in (methods["fine-tuned"], methods["head-tuned"]):
                assert tuned["lr"] == 1e-3 and list(tuned["dev_accuracy"]) == ["0.001"]
            likelihood = methods["likelihood"]
            assert likelihood["score"] in benchmark.scores_for(pair=task == "next-line")
            assert likelihood["dev_accuracy"][likelihood["score"]] == max(likelihood["dev_accuracy"].values())
            for method, result in methods.items():
                assert len(result["accuracies"]) == 2 and all(0.0 <= a <= 1.0 for a in result["accuracies"])
                if name == "random init":
                    assert "paired_vs_random" not in result
                    continue
                baseline = encoders["random init"][method]
                differences = [a - b for a, b in zip(result["accuracies"], baseline["accuracies"], strict=True)]
                assert result["paired_vs_random"]["mean"] == pytest.approx(sum(differences) / 2)
                assert result["paired_vs_random"]["wins"] == sum(d > 0 for d in differences)
    text = (tmp_path / "few_shot_tiny.md").read_text()
    assert text.startswith("# Few-shot: pretrained encoders against random init, three ways")
    assert "- command: `python benchmarks/few_shot.py --tiny --tasks corrupted next-line" in text
    assert "| corrupted | tiny-modern |" in text and "- corrupted: context: was the line corrupted" in text
