"""Corpus BLEU with `sacrebleu` (Post 2018): standard tokenisation and smoothing, so scores compare across papers.

Output keys follow the Hub's "sacrebleu" module, which cannot load offline.
"""

import datasets
import evaluate
from sacrebleu.metrics import BLEU

_DESCRIPTION = """
BLEU = BP * exp(mean over n = 1..4 of log p_n), p_n the clipped n-gram precision over the whole corpus and BP the
brevity penalty min(1, exp(1 - ref_len / sys_len)); reported x 100, as sacrebleu does.
"""

_CITATION = """@inproceedings{post-2018-call,
  title={A Call for Clarity in Reporting {BLEU} Scores}, author={Post, Matt},
  booktitle={Proceedings of the Third Conference on Machine Translation}, year={2018}}"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: generated texts, one per example.
    references: one reference text, or a list of reference texts, per example (every example the same number).
    smooth_method: "exp" (default) | "none" | "floor" | "add-k".
    smooth_value: for "floor" / "add-k".
    lowercase: case-insensitive BLEU (default False).
    tokenize: sacrebleu tokenizer name (default "13a"; "zh", "ja-mecab", "char", "none", ...).
    use_effective_order: skip n-gram orders with no matches (sentence-level BLEU; default False).
Returns:
    score (0-100), counts, totals, precisions (per n-gram order, in %), bp, sys_len, ref_len.
"""


class Sacrebleu(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
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
            codebase_urls=["https://github.com/mjpost/sacreBLEU"],
        )

    def _compute(
        self,
        predictions,
        references,
        smooth_method="exp",
        smooth_value=None,
        lowercase=False,
        tokenize=None,
        use_effective_order=False,
    ) -> dict:
        references = [[reference] if isinstance(reference, str) else list(reference) for reference in references]
        counts = {len(reference) for reference in references}
        if len(counts) > 1:
            raise ValueError(f"sacrebleu needs the same number of references for every prediction, got {counts}.")
        # sacrebleu takes references as streams: the first reference of every example, then the second, ...
        streams = [list(stream) for stream in zip(*references, strict=True)]
        bleu = BLEU(
            lowercase=lowercase,
            tokenize=tokenize,
            smooth_method=smooth_method,
            smooth_value=smooth_value,
            effective_order=use_effective_order,
        )
        result = bleu.corpus_score(predictions, streams)
        return {
            "score": result.score,
            "counts": result.counts,
            "totals": result.totals,
            "precisions": result.precisions,
            "bp": result.bp,
            "sys_len": result.sys_len,
            "ref_len": result.ref_len,
        }
