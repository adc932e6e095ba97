"""ROUGE-1/2/L/Lsum F-measures for summarisation, computed with Google's `rouge-score` package.

Unlike the Hub's "rouge" module, the aggregate is the plain mean of the per-example F-measures (the Hub module
reports the median of bootstrap resamples, which varies with the random state); with several references per
prediction each example scores its best reference (`RougeScorer.score_multi`).
"""

import datasets
import evaluate
from rouge_score import rouge_scorer

_DESCRIPTION = """
rouge1 / rouge2  unigram / bigram overlap; rougeL  longest common subsequence over the whole text;
rougeLsum  summary-level LCS over sentences, which must be separated by newlines ("\\n").
Texts are lower-cased and split on non-alphanumeric characters by rouge-score's default tokenizer, which drops
non-Latin text: pass `tokenizer` (an object with .tokenize(text) -> list[str]) for other scripts.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: generated texts, one per example.
    references: one reference text, or a list of reference texts, per example.
    rouge_types: default ["rouge1", "rouge2", "rougeL", "rougeLsum"].
    use_stemmer: Porter-stem words first (default False).
    use_aggregator: return the mean over examples (default) or, with False, one score per example.
    tokenizer: a custom tokenizer for rouge-score (default: its own).
Returns:
    {rouge_type: mean F-measure in [0, 1]} (lists with use_aggregator=False).
"""

DEFAULT_TYPES = ["rouge1", "rouge2", "rougeL", "rougeLsum"]


class Rouge(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string"),
                        "references": datasets.Sequence(datasets.Value("string")),
                    }
                ),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
            codebase_urls=["https://github.com/google-research/google-research/tree/master/rouge"],
        )

    def _compute(
        self, predictions, references, rouge_types=None, use_stemmer=False, use_aggregator=True, tokenizer=None
    ) -> dict:
        rouge_types = list(rouge_types or DEFAULT_TYPES)
        scorer = rouge_scorer.RougeScorer(rouge_types, use_stemmer=use_stemmer, tokenizer=tokenizer)
        per_example = {rouge_type: [] for rouge_type in rouge_types}
        for prediction, reference in zip(predictions, references, strict=True):
            if isinstance(reference, str):
                scores = scorer.score(reference, prediction)
            else:
                scores = scorer.score_multi(reference, prediction)
            for rouge_type in rouge_types:
                per_example[rouge_type].append(float(scores[rouge_type].fmeasure))
        if not use_aggregator:
            return per_example
        if not predictions:
            raise ValueError("ROUGE of no examples is undefined.")
        return {rouge_type: sum(values) / len(values) for rouge_type, values in per_example.items()}
