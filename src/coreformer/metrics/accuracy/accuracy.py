"""Accuracy: the fraction of predictions equal to their reference, optionally weighted.

A local `evaluate` module (load it offline with
`evaluate.load(coreformer.training.tasks.metrics.metric_path("accuracy"))`); the Hub's "accuracy" cannot be loaded
without a network.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """Accuracy = (number of correct predictions) / (number of predictions), with optional sample weights."""

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted class ids, one int per example.
    references: true class ids, one int per example.
    normalize: return the fraction (default) or, with False, the (weighted) count of correct predictions.
    sample_weight: one weight per example (default: all 1).
Returns:
    accuracy: float in [0, 1] (or the count when normalize=False).
Example:
    >>> accuracy.compute(predictions=[0, 1, 2, 3], references=[0, 1, 2, 0])
    {'accuracy': 0.75}
"""


class Accuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, normalize: bool = True, sample_weight=None) -> dict:
        correct = np.asarray(predictions) == np.asarray(references)
        weights = np.ones(len(correct)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if len(weights) != len(correct):
            raise ValueError(f"sample_weight has {len(weights)} entries for {len(correct)} predictions.")
        total = float((weights * correct).sum())
        if not normalize:
            return {"accuracy": total}
        if weights.sum() == 0:
            raise ValueError("Accuracy of no examples (or all weights 0) is undefined.")
        return {"accuracy": total / float(weights.sum())}
