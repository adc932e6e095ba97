"""SQuAD v1.1 exact match and F1 for extractive question answering, written from the official script's logic.

Both compare normalised strings: lower-cased, punctuation removed, the articles "a", "an", "the" removed, whitespace
collapsed. Exact match is 1 when the normalised prediction equals a normalised gold answer; F1 is the harmonic mean of
the token-bag precision and recall. Each question scores its best gold answer; the corpus scores are means x 100.
"""

import re
import string
from collections import Counter

import datasets
import evaluate

_DESCRIPTION = """SQuAD v1.1 (Rajpurkar et al. 2016) exact match and token F1, each the max over the gold answers."""

_CITATION = """@inproceedings{rajpurkar-etal-2016-squad,
  title={{SQ}u{AD}: 100,000+ Questions for Machine Comprehension of Text},
  author={Rajpurkar, Pranav and Zhang, Jian and Lopyrev, Konstantin and Liang, Percy},
  booktitle={EMNLP}, year={2016}}"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: one {"id": str, "prediction_text": str} per question.
    references: one {"id": str, "answers": {"text": [str, ...], "answer_start": [int, ...]}} per question (the
        SQuAD dataset's layout); matched to predictions by id.
Returns:
    exact_match, f1: floats in [0, 100]. A reference without a prediction scores 0.
Example:
    >>> metric.compute(predictions=[{"id": "q1", "prediction_text": "the Eiffel Tower"}],
    ...                references=[{"id": "q1", "answers": {"text": ["Eiffel Tower"], "answer_start": [0]}}])
    {'exact_match': 100.0, 'f1': 100.0}
"""

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation, drop articles, collapse whitespace (in this order, as the official script)."""
    text = "".join(character for character in text.lower() if character not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    prediction_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    overlap = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:  # also when either side is empty after normalisation (v1.1 has no "no answer")
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


class Squad(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": {"id": datasets.Value("string"), "prediction_text": datasets.Value("string")},
                    "references": {
                        "id": datasets.Value("string"),
                        "answers": datasets.Sequence(
                            {"text": datasets.Value("string"), "answer_start": datasets.Value("int32")}
                        ),
                    },
                }
            ),
            reference_urls=["https://rajpurkar.github.io/SQuAD-explorer/"],
        )

    def _compute(self, predictions, references) -> dict:
        predicted = {prediction["id"]: prediction["prediction_text"] for prediction in predictions}
        if not references:
            raise ValueError("SQuAD scores of no questions are undefined.")
        exact_match = f1 = 0.0
        for reference in references:
            answers = reference["answers"]["text"]
            if not answers:
                raise ValueError(f"Question {reference['id']!r} has no gold answer (SQuAD v1.1 needs one).")
            if reference["id"] not in predicted:
                continue  # unanswered: scores 0, as in the official script
            prediction = predicted[reference["id"]]
            exact_match += max(exact_match_score(prediction, gold) for gold in answers)
            f1 += max(f1_score(prediction, gold) for gold in answers)
        return {"exact_match": 100.0 * exact_match / len(references), "f1": 100.0 * f1 / len(references)}
