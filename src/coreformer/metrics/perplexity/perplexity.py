"""Perplexity from per-token losses: exp(mean negative log-likelihood), with no model to download.

The Hub's "perplexity" module downloads a model and scores texts with it; this one takes the token losses the
evaluated model already produced (cross-entropy in nats, one per predicted token), e.g. from an evaluation loop.
"""

import math

import datasets
import evaluate

_DESCRIPTION = """
perplexity       exp(sum of all token losses / number of tokens): the corpus perplexity, every token weighted alike
perplexities     exp(mean token loss) of each sequence
mean_perplexity  mean of `perplexities` (what the Hub's module reports; short sequences weigh as much as long ones)
"""

_KWARGS_DESCRIPTION = """
Args:
    losses: one list of per-token negative log-likelihoods (natural log) per sequence; only the tokens that count
        (no padding, no prompt).
    are_log_likelihoods: the values are log-probabilities (<= 0), negated here (default False).
Returns:
    perplexity, mean_loss, num_tokens, perplexities (list), mean_perplexity.
Example:
    >>> metric.compute(losses=[[math.log(2), math.log(8)]])["perplexity"]   # exp((ln 2 + ln 8) / 2) = 4
"""


class Perplexity(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"losses": datasets.Sequence(datasets.Value("float64"))}),
        )

    def _compute(self, losses, are_log_likelihoods: bool = False) -> dict:
        sign = -1.0 if are_log_likelihoods else 1.0
        sequences = [[sign * value for value in sequence] for sequence in losses]
        if any(value < 0 for sequence in sequences for value in sequence):
            raise ValueError(
                "A token loss is negative: losses are negative log-likelihoods (>= 0); pass log-probabilities with "
                "are_log_likelihoods=True."
            )
        if any(len(sequence) == 0 for sequence in sequences):
            raise ValueError("A sequence has no token losses: drop it, its perplexity is undefined.")
        num_tokens = sum(len(sequence) for sequence in sequences)
        if num_tokens == 0:
            raise ValueError("Perplexity of no tokens is undefined.")
        mean_loss = math.fsum(value for sequence in sequences for value in sequence) / num_tokens
        perplexities = [math.exp(math.fsum(sequence) / len(sequence)) for sequence in sequences]
        return {
            "perplexity": math.exp(mean_loss),
            "mean_loss": mean_loss,
            "num_tokens": num_tokens,
            "perplexities": perplexities,
            "mean_perplexity": math.fsum(perplexities) / len(perplexities),
        }
