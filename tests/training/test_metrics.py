"""The shipped evaluate modules (coreformer/metrics) and the compute_metrics builders in
coreformer/training/tasks/metrics.py.

Every metric is held to a number worked out by hand in the test (or, for BLEU / ROUGE, to the library called
directly), and every module loads from its folder with the Hub unreachable.
"""

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from tiny import tiny_model
from transformers import EvalPrediction

import coreformer as cf
from coreformer.training.tasks.metrics import (
    METRICS,
    classification_metrics,
    generation_metrics,
    language_modeling_metrics,
    load_metric,
    metric_path,
    squad_scores,
    token_classification_metrics,
)
from coreformer.training.tokenizer_training import train_tokenizer

close = pytest.approx


@pytest.fixture(scope="module")
def metric():
    """name -> loaded module, loaded once per test module (loading copies the script into the modules cache)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_metric(name)
        return cache[name]

    return get


@pytest.mark.slow
def test_every_metric_loads_in_a_fresh_process_with_the_hub_unreachable(tmp_path):
    child = textwrap.dedent(
        """
        import sys, evaluate, datasets
        for path in sys.argv[1:]:
            module = evaluate.load(path)
            features = module.info.features
            assert isinstance(features, (datasets.Features, list)), path
            print(module.name)
        """
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",  # the discard port: any request would fail
        "HF_MODULES_CACHE": str(tmp_path / "modules"),  # an empty cache: nothing was fetched earlier either
        "HF_HOME": str(tmp_path / "home"),
    }
    paths = [metric_path(name) for name in METRICS]
    result = subprocess.run([sys.executable, "-c", child, *paths], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == list(METRICS)


def test_metric_path_names_the_shipped_metrics_on_a_typo():
    with pytest.raises(ValueError, match="coreformer ships accuracy"):
        metric_path("acuracy")
    assert all(os.path.isfile(os.path.join(metric_path(name), f"{name}.py")) for name in METRICS)


def test_accuracy_is_three_of_four_and_weights_count(metric):
    accuracy = metric("accuracy")
    assert accuracy.compute(predictions=[0, 1, 2, 3], references=[0, 1, 2, 0]) == {"accuracy": 0.75}
    weighted = accuracy.compute(predictions=[0, 1, 2, 3], references=[0, 1, 2, 0], sample_weight=[1, 1, 1, 3])
    assert weighted["accuracy"] == close(3 / 6)  # the wrong prediction weighs 3 of 6
    assert accuracy.compute(predictions=[0, 1, 2, 3], references=[0, 1, 2, 0], normalize=False)["accuracy"] == 3


# Per class (rows: prediction vs reference indices) of PREDICTED / REFERENCE below:
#   class 0: TP 1 FP 1 FN 0 -> P 1/2 R 1   F1 2/3   support 1
#   class 1: TP 1 FP 1 FN 1 -> P 1/2 R 1/2 F1 1/2   support 2
#   class 2: TP 2 FP 0 FN 1 -> P 1   R 2/3 F1 4/5   support 3
PREDICTED = [0, 1, 1, 2, 2, 0]
REFERENCE = [0, 1, 2, 2, 2, 1]
BY_HAND = {
    "macro": (2 / 3, 13 / 18, (2 / 3 + 1 / 2 + 4 / 5) / 3),
    "micro": (4 / 6, 4 / 6, 4 / 6),  # TP 4, FP 2, FN 2 summed over classes
    "weighted": ((1 / 2 + 2 / 2 + 3) / 6, (1 + 2 / 2 + 3 * 2 / 3) / 6, (2 / 3 + 2 / 2 + 3 * 4 / 5) / 6),
}


@pytest.mark.parametrize("average", list(BY_HAND))
def test_precision_recall_f1_equal_the_hand_computation(metric, average):
    result = metric("precision_recall_f1").compute(predictions=PREDICTED, references=REFERENCE, average=average)
    assert (result["precision"], result["recall"], result["f1"]) == close(BY_HAND[average])


def test_precision_recall_f1_binary_and_per_class(metric):
    scores = metric("precision_recall_f1")
    binary = scores.compute(predictions=[1, 1, 0, 0], references=[1, 0, 1, 0], average="binary")
    assert binary == close({"precision": 0.5, "recall": 0.5, "f1": 0.5})  # TP 1, FP 1, FN 1
    per_class = scores.compute(predictions=PREDICTED, references=REFERENCE, average=None)
    assert per_class["f1"] == close([2 / 3, 1 / 2, 4 / 5])
    with pytest.raises(ValueError, match="average must be one of"):
        scores.compute(predictions=PREDICTED, references=REFERENCE, average="samples")


def test_seqeval_scores_entities_not_tokens(metric):
    references = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "I-ORG", "O"]]
    predictions = [["B-PER", "I-PER", "O", "O"], ["B-ORG", "O", "O"]]
    result = metric("seqeval").compute(predictions=predictions, references=references)
    # Reference entities PER[0:2] LOC[3] ORG[0:2]; predicted PER[0:2] (right) and ORG[0:1] (wrong end): TP 1 of 2 / 3.
    assert result["overall_precision"] == close(1 / 2)
    assert result["overall_recall"] == close(1 / 3)
    assert result["overall_f1"] == close(2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3))
    assert result["overall_accuracy"] == close(5 / 7)  # token level: 3 of 4 + 2 of 3
    assert result["PER"] == close({"precision": 1.0, "recall": 1.0, "f1": 1.0, "number": 1})
    assert result["ORG"]["f1"] == 0.0 and result["LOC"]["number"] == 1


def test_seqeval_lenient_by_default_strict_with_a_scheme(metric):
    seqeval = metric("seqeval")
    # conlleval reads an I-PER after O as the start of a PER entity; strict IOB2 rejects it.
    lenient = seqeval.compute(predictions=[["O", "I-PER"]], references=[["O", "B-PER"]])
    strict = seqeval.compute(predictions=[["O", "I-PER"]], references=[["O", "B-PER"]], scheme="IOB2", mode="strict")
    assert lenient["overall_f1"] == 1.0 and strict["overall_f1"] == 0.0
    with pytest.raises(ValueError, match="-100"):
        seqeval.compute(predictions=[["O", "O"]], references=[["O"]])


def test_squad_exact_match_and_f1_on_articles_and_punctuation(metric):
    predictions = [  # matched to references by id, not by position
        {"id": "q2", "prediction_text": "in the city of Paris, France"},
        {"id": "q1", "prediction_text": "The Eiffel Tower!"},
        {"id": "q3", "prediction_text": "a Banana"},
    ]
    references = [
        {"id": "q1", "answers": {"text": ["Eiffel Tower", "the tower"], "answer_start": [0, 4]}},
        {"id": "q2", "answers": {"text": ["Paris"], "answer_start": [15]}},
        {"id": "q3", "answers": {"text": ["banana"], "answer_start": [2]}},
    ]
    result = metric("squad").compute(predictions=predictions, references=references)
    # q1 "eiffel tower" == "eiffel tower": EM 1, F1 1.  q2 "in city of paris france" vs "paris": EM 0, overlap 1,
    # P 1/5 R 1 -> F1 1/3.  q3 article dropped ("an" inside "banana" is not an article): EM 1, F1 1.
    assert result["exact_match"] == close(100 * (1 + 0 + 1) / 3)
    assert result["f1"] == close(100 * (1 + 1 / 3 + 1) / 3)
    # squad_scores: a question without a prediction scores 0, as in the official script.
    scores = squad_scores({"q1": "The Eiffel Tower!"}, {"q1": ["Eiffel Tower"], "q2": ["Paris"]})
    assert scores == close({"exact_match": 50.0, "f1": 50.0})


def test_perplexity_is_exp_of_the_token_mean_loss(metric):
    perplexity = metric("perplexity")
    losses = [[math.log(2), math.log(8)], [math.log(32)]]
    result = perplexity.compute(losses=losses)
    assert result["perplexity"] == close(512 ** (1 / 3))  # exp((ln 2 + ln 8 + ln 32) / 3) = 8
    assert result["perplexity"] == close(8.0)
    assert result["perplexities"] == close([4.0, 32.0]) and result["mean_perplexity"] == close(18.0)
    assert result["num_tokens"] == 3
    from_log_likelihoods = perplexity.compute(
        losses=[[-value for value in row] for row in losses], are_log_likelihoods=True
    )
    assert from_log_likelihoods["perplexity"] == close(8.0)
    with pytest.raises(ValueError, match="are_log_likelihoods"):
        perplexity.compute(losses=[[-1.0]])


def test_rouge_by_hand_and_against_rouge_score(metric):
    from rouge_score import rouge_scorer

    rouge = metric("rouge")
    by_hand = rouge.compute(predictions=["the cat sat"], references=["the cat ran"])
    # unigrams 2 of 3 both ways; bigrams "the cat" 1 of 2; LCS "the cat" 2 of 3.
    assert by_hand == close({"rouge1": 2 / 3, "rouge2": 1 / 2, "rougeL": 2 / 3, "rougeLsum": 2 / 3})

    predictions = ["the quick brown fox jumps", "a dog barked loudly at night\nthen slept"]
    references = [["the fast brown fox jumped", "a quick fox jumps"], ["the dog barked at night\nand slept"]]
    result = rouge.compute(predictions=predictions, references=references, use_stemmer=True)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    direct = [scorer.score_multi(refs, prediction) for prediction, refs in zip(predictions, references, strict=True)]
    for rouge_type, value in result.items():
        assert value == close(np.mean([scores[rouge_type].fmeasure for scores in direct]))
    per_example = rouge.compute(predictions=predictions, references=references, use_aggregator=False)
    assert len(per_example["rouge1"]) == 2


def test_sacrebleu_by_hand_and_against_sacrebleu(metric):
    import sacrebleu as sacrebleu_library

    bleu = metric("sacrebleu")
    result = bleu.compute(predictions=["the cat sat on the mat"], references=[["the cat sat on a mat"]])
    # Clipped n-gram precisions 5/6, 3/5, 2/4, 1/3; equal lengths so BP = 1; BLEU = geometric mean x 100.
    assert result["counts"] == [5, 3, 2, 1] and result["totals"] == [6, 5, 4, 3] and result["bp"] == 1.0
    assert result["score"] == close(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)

    predictions = ["The cat is on the mat.", "There is a dog in the garden today", "Hello world"]
    references = [
        ["The cat sits on the mat.", "A cat is on the mat."],
        ["A dog is in the garden.", "There is a dog in the garden."],
        ["Hello there world", "Hello, world!"],
    ]
    result = bleu.compute(predictions=predictions, references=references)
    streams = [list(stream) for stream in zip(*references, strict=True)]
    assert result["score"] == close(sacrebleu_library.corpus_bleu(predictions, streams).score)
    single = bleu.compute(predictions=predictions, references=[refs[0] for refs in references])
    assert single["score"] == close(sacrebleu_library.corpus_bleu(predictions, [streams[0]]).score)


@pytest.mark.slow
def test_classification_metrics_builder_reads_logits():
    compute = classification_metrics(average="macro")
    logits = np.eye(3)[PREDICTED] * 5.0  # (6, 3), argmax = PREDICTED
    result = compute(EvalPrediction(predictions=logits, label_ids=np.array(REFERENCE)))
    assert result["accuracy"] == close(4 / 6)
    assert (result["precision"], result["recall"], result["f1"]) == close(BY_HAND["macro"])
    # Seq2seq classifiers hand Trainer (logits, encoder states): the builder takes the first.
    as_tuple = compute(EvalPrediction(predictions=(logits, np.zeros((6, 2, 4))), label_ids=np.array(REFERENCE)))
    assert as_tuple == result


@pytest.mark.slow
def test_token_classification_builder_drops_ignored_positions():
    id2label = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC"}
    labels = np.array([[-100, 1, 2, 0, 3, -100], [-100, 3, 0, -100, -100, -100]])
    predicted = np.array([[3, 1, 2, 0, 0, 3], [0, 3, 0, 1, 1, 1]])  # noise at ignored positions must not count
    result = token_classification_metrics(id2label)(EvalPrediction(predictions=np.eye(4)[predicted], label_ids=labels))
    # Entities: references PER, LOC | LOC; predicted PER | LOC -> P 1, R 2/3; counted tokens 3 of 4 + 2 of 2 right.
    assert result["precision"] == close(1.0) and result["recall"] == close(2 / 3)
    assert result["accuracy"] == close(5 / 6) and result["PER_f1"] == close(1.0)


@pytest.mark.parametrize(
    ("family", "head", "causal"),
    [
        ("decoder", cf.CoreformerDecoderForCausalLM, True),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, False),
    ],
)
@pytest.mark.slow
def test_language_modeling_perplexity_equals_exp_of_the_model_loss(family, head, causal):
    model = tiny_model(head, family)
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(3, 99, (3, 9), generator=generator)
    labels[1, 6:] = -100  # padding
    labels[2, :3] = -100  # a prompt that takes no loss
    inputs = {"input_ids": labels.clamp(min=3)} if family == "decoder" else {"input_ids": labels.clamp(min=3)[:, :5]}
    with torch.no_grad():
        output = model(**inputs, labels=labels)
    compute_metrics, preprocess = language_modeling_metrics(causal=causal)
    token_losses = preprocess(output.logits, labels)
    assert token_losses.shape == labels.shape
    result = compute_metrics(EvalPrediction(predictions=token_losses.numpy(), label_ids=labels.numpy()))
    # The model's loss is the mean over every counted token of the batch, so exp(loss) is the corpus perplexity.
    assert result["perplexity"] == close(math.exp(output.loss.item()), rel=1e-5)
    assert result["token_loss"] == close(output.loss.item(), rel=1e-5)


def test_generation_metrics_decode_ids_and_match_the_libraries():
    import sacrebleu as sacrebleu_library

    texts = ["the cat sat on the mat", "a dog barked at night", "the cat ran", "a dog slept at night"]
    tokenizer = train_tokenizer("seq2seq", texts * 5, vocab_size=300)
    generated, reference = ["the cat sat on a mat", "a dog slept"], ["the cat sat on the mat", "a dog barked at night"]
    predicted = tokenizer(generated, padding=True, return_tensors="np")["input_ids"]
    labels = tokenizer(reference, padding=True, return_tensors="np")["input_ids"]
    labels = np.where(labels == tokenizer.pad_token_id, -100, labels)
    result = generation_metrics(tokenizer)(EvalPrediction(predictions=predicted, label_ids=labels))
    expected_rouge = load_metric("rouge").compute(predictions=generated, references=reference)
    assert {key: result[key] for key in expected_rouge} == close(expected_rouge)
    assert result["bleu"] == close(sacrebleu_library.corpus_bleu(generated, [reference]).score)
    special = {tokenizer.pad_token_id}
    assert result["gen_len"] == close(np.mean([sum(t not in special for t in row) for row in predicted]))


@pytest.mark.parametrize(
    ("family", "head", "causal"),
    [
        ("decoder", cf.CoreformerDecoderForCausalLM, True),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, False),
    ],
)
@pytest.mark.slow
def test_trainer_evaluate_reports_the_perplexity_of_its_loss(family, head, causal, tmp_path):
    """Wired into Trainer (preprocess_logits_for_metrics before gathering): one evaluation batch of equal-length
    rows, so Trainer's eval_loss is the token mean and the perplexity must be exp(eval_loss)."""
    from transformers import Trainer, TrainingArguments

    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(3, 99, (6, 8), generator=generator)
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    compute_metrics, preprocess = language_modeling_metrics(causal=causal)
    arguments = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=8, report_to=[], use_cpu=True, disable_tqdm=True
    )
    trainer = Trainer(
        model=tiny_model(head, family),
        args=arguments,
        eval_dataset=dataset,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess,
    )
    result = trainer.evaluate()
    assert result["eval_perplexity"] == close(math.exp(result["eval_loss"]), rel=1e-5)


@pytest.mark.slow
def test_trainer_evaluate_reads_seq2seq_classifier_logits(tmp_path):
    from transformers import Trainer, TrainingArguments

    generator = torch.Generator().manual_seed(2)
    rows = torch.randint(3, 99, (6, 8), generator=generator)
    rows[:, -1] = 2  # the seq2seq classifier pools at eos
    labels = torch.tensor([0, 1, 1, 0, 1, 0])
    dataset = [{"input_ids": row, "labels": label} for row, label in zip(rows, labels, strict=True)]
    model = tiny_model(cf.CoreformerSeq2SeqForSequenceClassification, "seq2seq", num_labels=2)
    arguments = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True
    )
    trainer = Trainer(model=model, args=arguments, eval_dataset=dataset, compute_metrics=classification_metrics())
    result = trainer.evaluate()
    with torch.no_grad():
        predicted = model(input_ids=rows).logits.argmax(-1)
    assert result["eval_accuracy"] == close((predicted == labels).float().mean().item())
