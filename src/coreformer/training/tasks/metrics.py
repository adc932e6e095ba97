"""Offline evaluation: where the shipped `evaluate` modules live, and `compute_metrics` builders for `Trainer`.

`evaluate.load("accuracy")` fetches its script from the Hub, so coreformer ships its own modules in
`coreformer/metrics/<name>/<name>.py`, each an `evaluate.Metric` that loads offline from its folder:

    accuracy              accuracy (optionally weighted)
    precision_recall_f1   precision / recall / F1, average "macro" | "micro" | "weighted" | "binary" | None (sklearn)
    seqeval               entity-level precision / recall / F1 for token classification (seqeval)
    squad                 SQuAD v1.1 exact match / F1 (the official script's normalisation)
    perplexity            exp(mean token NLL) from token losses the model already computed (no model download)
    rouge                 ROUGE-1/2/L/Lsum F-measures (rouge-score)
    sacrebleu             corpus BLEU (sacrebleu)

    evaluate.load(metric_path("squad"))  ==  load_metric("squad")

The builders return callables for `Trainer(compute_metrics=...)`, one per task: `classification_metrics`,
`token_classification_metrics`, `language_modeling_metrics` (with its `preprocess_logits_for_metrics`),
`generation_metrics` (for `Seq2SeqTrainer(predict_with_generate=True)`), and `squad_scores` for QA answers that the
caller has already turned into text.
"""

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import evaluate
import numpy as np
import torch
from transformers import EvalPrediction, PreTrainedTokenizerBase

METRICS_DIR = Path(__file__).resolve().parents[2] / "metrics"  # coreformer/metrics
METRICS = ("accuracy", "precision_recall_f1", "seqeval", "squad", "perplexity", "rouge", "sacrebleu")
IGNORE_INDEX = -100  # label of positions that take no loss (padding, prompts, sub-word continuations)


def metric_path(name: str) -> str:
    """The absolute folder of the shipped metric `name`, for `evaluate.load(metric_path(name))`."""
    if name not in METRICS:
        raise ValueError(f"Unknown metric {name!r}: coreformer ships {', '.join(METRICS)}.")
    folder = METRICS_DIR / name
    if not (folder / f"{name}.py").is_file():
        raise FileNotFoundError(
            f"{folder / f'{name}.py'} is missing: the installed package lacks its metric scripts (package-data)."
        )
    return str(folder)


def load_metric(name: str, **kwargs) -> evaluate.EvaluationModule:
    """`evaluate.load` of a shipped metric; kwargs go to `evaluate.load` (config_name, experiment_id, ...)."""
    return evaluate.load(metric_path(name), **kwargs)


def _logits(predictions: np.ndarray | tuple) -> np.ndarray:
    # Models that return more than logits (seq2seq heads add encoder states) reach compute_metrics as a tuple.
    return predictions[0] if isinstance(predictions, tuple) else predictions


def classification_metrics(*, average: str = "macro") -> Callable[[EvalPrediction], dict[str, float]]:
    """Accuracy and `average`d precision / recall / F1 of single-label sequence classification.

    The callable takes an `EvalPrediction` with logits (N, num_labels) and labels (N,).
    """
    accuracy, scores = load_metric("accuracy"), load_metric("precision_recall_f1")

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        predicted = _logits(prediction.predictions).argmax(-1)
        references = prediction.label_ids
        return {
            **accuracy.compute(predictions=predicted, references=references),
            **scores.compute(predictions=predicted, references=references, average=average),
        }

    return compute_metrics


def token_classification_metrics(id2label: Mapping[int, str]) -> Callable[[EvalPrediction], dict[str, float]]:
    """Entity-level precision / recall / F1 and token accuracy (seqeval) of BIO-tagged token classification.

    Positions labelled -100 (padding, special tokens, sub-word continuations) are dropped before tags are compared.
    Per-type scores are flattened to `<TYPE>_f1` so that `Trainer` can log them.
    """
    seqeval = load_metric("seqeval")
    id2label = {int(key): value for key, value in id2label.items()}

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        predicted = _logits(prediction.predictions).argmax(-1)  # (N, T)
        tags, references = [], []
        for row_predictions, row_labels in zip(predicted, prediction.label_ids, strict=True):
            keep = row_labels != IGNORE_INDEX
            tags.append([id2label[int(label)] for label in row_predictions[keep]])
            references.append([id2label[int(label)] for label in row_labels[keep]])
        result = seqeval.compute(predictions=tags, references=references)
        flat = {
            "precision": result.pop("overall_precision"),
            "recall": result.pop("overall_recall"),
            "f1": result.pop("overall_f1"),
            "accuracy": result.pop("overall_accuracy"),
        }
        flat.update({f"{entity_type}_f1": scores["f1"] for entity_type, scores in result.items()})
        return flat

    return compute_metrics


def token_losses(logits: torch.Tensor, labels: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Per-token negative log-likelihood aligned with `labels`: (B, T, V), (B, T) -> (B, T).

    causal: logits[:, t] predicts labels[:, t + 1] (decoders; transformers' causal LM loss shifts the same way), so
        position 0 predicts nothing and gets 0. Otherwise logits[:, t] predicts labels[:, t] (seq2seq, whose decoder
        inputs are already the labels shifted right).
    Positions labelled -100 get 0; read them back with `labels != -100` (and from position 1 when causal).
    """
    if causal:
        logits, targets = logits[:, :-1], labels[:, 1:]
    else:
        targets = labels
    nll = torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), targets.clamp(min=0), reduction="none"
    )  # (B, V, T') -> (B, T')
    nll = nll.masked_fill(targets == IGNORE_INDEX, 0.0)
    if causal:
        nll = torch.cat([nll.new_zeros(nll.shape[0], 1), nll], dim=1)  # (B, T)
    return nll


def language_modeling_metrics(*, causal: bool) -> tuple[Callable, Callable]:
    """Token-weighted perplexity for `Trainer`: returns `(compute_metrics, preprocess_logits_for_metrics)`.

    The second turns each batch's (B, T, V) logits into (B, T) token losses before `Trainer` gathers them, so the
    vocabulary-sized logits of the whole evaluation set are never held. `causal`: see `token_losses`.
    The perplexity weighs every token alike: exp(total NLL / tokens), not exp of `Trainer`'s mean of batch losses.
    """
    perplexity = load_metric("perplexity")

    def preprocess_logits_for_metrics(logits: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
        logits = logits[0] if isinstance(logits, tuple) else logits
        return token_losses(logits, labels, causal=causal)

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        losses, labels = _logits(prediction.predictions), prediction.label_ids
        counted = labels != IGNORE_INDEX
        if causal:
            counted[:, 0] = False
        rows = [row_losses[row_mask].tolist() for row_losses, row_mask in zip(losses, counted, strict=True)]
        result = perplexity.compute(losses=[row for row in rows if row])
        return {"perplexity": result["perplexity"], "token_loss": result["mean_loss"]}

    return compute_metrics, preprocess_logits_for_metrics


def generation_metrics(
    tokenizer: PreTrainedTokenizerBase, *, metrics: Sequence[str] = ("rouge", "sacrebleu")
) -> Callable[[EvalPrediction], dict[str, float]]:
    """ROUGE F-measures and/or BLEU of generated token ids (`Seq2SeqTrainer(predict_with_generate=True)`).

    Both predictions and labels are decoded without special tokens; -100 (label padding) becomes the pad token first.
    Also reports `gen_len`, the mean number of non-pad generated tokens.
    """
    unknown = set(metrics) - {"rouge", "sacrebleu"}
    if unknown:
        raise ValueError(f"generation_metrics computes 'rouge' and 'sacrebleu', not {sorted(unknown)}.")
    loaded = {name: load_metric(name) for name in metrics}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def decode(ids: np.ndarray) -> list[str]:
        ids = np.where(ids == IGNORE_INDEX, pad, ids)
        return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        generated = _logits(prediction.predictions)
        predictions, references = decode(generated), decode(prediction.label_ids)
        result: dict[str, float] = {}
        if "rouge" in loaded:
            result.update(loaded["rouge"].compute(predictions=predictions, references=references))
        if "sacrebleu" in loaded:
            result["bleu"] = loaded["sacrebleu"].compute(predictions=predictions, references=references)["score"]
        result["gen_len"] = float(np.mean(((generated != pad) & (generated != IGNORE_INDEX)).sum(-1)))
        return result

    return compute_metrics


def squad_scores(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """SQuAD exact match and F1 (0-100) of predicted answer texts against gold answers, both keyed by question id.

    A question without a prediction scores 0 (it is scored as the empty answer), as in the official script.
    """
    unknown = set(predictions) - set(references)
    if unknown:
        raise ValueError(f"Predictions for questions without gold answers: {sorted(unknown)[:5]}.")
    return load_metric("squad").compute(
        predictions=[{"id": key, "prediction_text": predictions.get(key, "")} for key in references],
        references=[
            {"id": key, "answers": {"text": list(answers), "answer_start": [0] * len(answers)}}
            for key, answers in references.items()
        ],
    )
