"""Entity-level precision, recall and F1 for token classification (NER, chunking), computed with `seqeval`.

An entity is a maximal span of tags of one type (B-PER I-PER ...); a predicted entity counts only if its type and both
boundaries equal a reference entity's. Output keys follow the Hub's "seqeval" module, which cannot load offline.
"""

import datasets
import evaluate
from seqeval.metrics import accuracy_score, classification_report
from seqeval.scheme import BILOU, IOB1, IOB2, IOBES, IOE1, IOE2

_DESCRIPTION = """
Default (scheme=None): conlleval's lenient chunking, where an I-X after O or after another type starts a new entity.
With `scheme` ("IOB2", "IOBES", ...) and mode="strict", only entities that are valid in that scheme are counted.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: one list of tag strings per sentence, e.g. [["B-PER", "I-PER", "O"]].
    references: the true tags, same shapes.
    scheme: None | "IOB1" | "IOB2" | "IOE1" | "IOE2" | "IOBES" | "BILOU".
    mode: None (default) or "strict" (with a scheme).
    suffix: tags are written "PER-B" instead of "B-PER".
    zero_division: the value of a ratio whose denominator is 0 (default 0).
Returns:
    overall_precision, overall_recall, overall_f1 (micro over entities), overall_accuracy (token level), and for
    every entity type TYPE: {"precision", "recall", "f1", "number"} (number = reference entities of that type).
Example:
    >>> metric.compute(predictions=[["B-PER", "I-PER", "O"]], references=[["B-PER", "I-PER", "O"]])
"""

SCHEMES = {"IOB1": IOB1, "IOB2": IOB2, "IOE1": IOE1, "IOE2": IOE2, "IOBES": IOBES, "BILOU": BILOU}


class Seqeval(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("string")),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
            codebase_urls=["https://github.com/chakki-works/seqeval"],
        )

    def _compute(self, predictions, references, scheme=None, mode=None, suffix: bool = False, zero_division=0) -> dict:
        if scheme is not None and scheme not in SCHEMES:
            raise ValueError(f"scheme must be None or one of {sorted(SCHEMES)}, got {scheme!r}.")
        for prediction, reference in zip(predictions, references, strict=True):
            if len(prediction) != len(reference):
                raise ValueError(
                    f"A sentence has {len(prediction)} predicted tags for {len(reference)} reference tags: drop the "
                    f"positions labelled -100 (padding, sub-word continuations) from both before computing."
                )
        report = classification_report(
            y_true=references,
            y_pred=predictions,
            suffix=suffix,
            output_dict=True,
            scheme=SCHEMES.get(scheme),
            mode=mode,
            zero_division=zero_division,
        )
        overall = report.pop("micro avg")
        for summary in ("macro avg", "weighted avg"):
            report.pop(summary, None)
        scores = {
            entity_type: {
                "precision": float(values["precision"]),
                "recall": float(values["recall"]),
                "f1": float(values["f1-score"]),
                "number": int(values["support"]),
            }
            for entity_type, values in report.items()
        }
        scores["overall_precision"] = float(overall["precision"])
        scores["overall_recall"] = float(overall["recall"])
        scores["overall_f1"] = float(overall["f1-score"])
        scores["overall_accuracy"] = float(accuracy_score(y_true=references, y_pred=predictions))
        return scores
