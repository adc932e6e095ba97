"""Precision, recall and F1 of class predictions in one call, averaged "macro", "micro", "weighted" or "binary".

A local `evaluate` module over scikit-learn's `precision_recall_fscore_support` (the same computation as the Hub's
"precision", "recall" and "f1" modules, which cannot be loaded offline).
"""

import datasets
import evaluate
from sklearn.metrics import precision_recall_fscore_support

_DESCRIPTION = """
Per class c: precision_c = TP_c / (TP_c + FP_c), recall_c = TP_c / (TP_c + FN_c), F1_c = 2 P_c R_c / (P_c + R_c).
  macro     unweighted mean over the classes (F1 is the mean of the per-class F1s, not the F1 of the means)
  micro     the three ratios of the counts summed over the classes (= accuracy for single-label data)
  weighted  mean over the classes weighted by their number of references (support)
  binary    the class `pos_label` only
  None      one value per class (lists), in the order of `labels` (default: sorted classes present)
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted class ids, one int per example.
    references: true class ids, one int per example.
    average: "macro" (default) | "micro" | "weighted" | "binary" | None.
    labels: the classes to include (default: every class in predictions or references).
    pos_label: the positive class for average="binary" (default 1).
    zero_division: the value of a ratio whose denominator is 0 (default 0.0).
Returns:
    precision, recall, f1: floats (lists when average=None).
Example:
    >>> metric.compute(predictions=[0, 1, 1, 2], references=[0, 1, 2, 2], average="macro")
"""

AVERAGES = ("macro", "micro", "weighted", "binary", None)


class PrecisionRecallF1(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
            reference_urls=[
                "https://scikit-learn.org/stable/modules/model_evaluation.html#precision-recall-f-measure-metrics"
            ],
        )

    def _compute(self, predictions, references, average="macro", labels=None, pos_label=1, zero_division=0.0) -> dict:
        if average not in AVERAGES:
            raise ValueError(f"average must be one of {AVERAGES}, got {average!r}.")
        precision, recall, f1, _ = precision_recall_fscore_support(
            references,
            predictions,
            average=average,
            labels=labels,
            pos_label=pos_label,
            zero_division=zero_division,
        )
        if average is None:
            return {"precision": precision.tolist(), "recall": recall.tolist(), "f1": f1.tolist()}
        return {"precision": float(precision), "recall": float(recall), "f1": float(f1)}
