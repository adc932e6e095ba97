"""Adding a fine-tuning task is one file plus one registry line: a toy task written to a temporary module (its
settings class beside it) and registered with one `TASK_REGISTRY` entry is a --task of training/finetune.py, its
setting is a flag that is checked, and it fine-tunes a tiny encoder end to end."""

import importlib
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import coreformer as cf
from coreformer.training.finetuning.arguments import FinetuningArguments
from coreformer.training.finetuning.data import embedded_dataset
from coreformer.training.tasks import TASKS
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer
from coreformer_settings.components import Registered
from coreformer_settings.tasks import TASK_REGISTRY

FINETUNE = Path(__file__).resolve().parents[3] / "training" / "finetune.py"

# Sequence classification that reads only the first `max_words` words of each text.
TOY_TASK = '''
"""A toy task: sequence classification on the first `max_words` words of each text."""

import dataclasses
from dataclasses import dataclass

from coreformer.training.tasks.sequence_classification import SEQUENCE_CLASSIFICATION, SequenceClassification
from coreformer_settings.base import arg
from coreformer_settings.tasks import SequenceClassificationSettings


@dataclass
class HeadlineSettings(SequenceClassificationSettings):
    max_words: int = arg(8, "headline-classification: words read from the start of each text")

    def __post_init__(self):
        self.check_at_least(1, ("max_words",))


@dataclass(frozen=True)
class HeadlineClassification(SequenceClassification):
    def features(self, split, tokenizer, args, max_length, to_id):
        column, words = args.text_column, args.task_settings.max_words
        cut = split.map(lambda row: {column: " ".join(row[column].split()[:words])})
        return super().features(cut, tokenizer, args, max_length, to_id)


HEADLINE_CLASSIFICATION = HeadlineClassification(
    **{field.name: getattr(SEQUENCE_CLASSIFICATION, field.name) for field in dataclasses.fields(SequenceClassification)}
    | {"name": "headline-classification"}
)
'''


@pytest.fixture
def headline_task(tmp_path, monkeypatch):
    """The toy task's module, importable, and registered with one line."""
    (tmp_path / "toy_headline.py").write_text(textwrap.dedent(TOY_TASK))
    monkeypatch.syspath_prepend(str(tmp_path))
    toy = importlib.import_module("toy_headline")
    entry = Registered("toy_headline:HEADLINE_CLASSIFICATION", toy.HeadlineSettings)
    monkeypatch.setitem(TASK_REGISTRY, "headline-classification", entry)
    yield toy
    sys.modules.pop("toy_headline")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> Path:
    """A tiny random encoder folder with a tokenizer trained on the embedded classification texts."""
    texts = embedded_dataset("sequence-classification")["train"]["text"]
    tokenizer = train_tokenizer("encoder", texts, 400, model_max_length=64)
    config = cf.CoreformerEncoderConfig(
        **token_config_kwargs(tokenizer, "encoder"), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=66,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("base") / "encoder"
    cf.CoreformerEncoderForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def finetune_script():
    spec = importlib.util.spec_from_file_location("finetune_script_for_toy", FINETUNE)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def tiny_flags(model: Path, output_dir: Path) -> list[str]:
    return [
        "--task", "headline-classification", "--model", str(model), "--output-dir", str(output_dir), "--max-steps",
        "2", "--batch-size", "8", "--max-train-examples", "16", "--max-eval-examples", "8", "--max-length", "32",
        "--logging-steps", "1", "--save-every", "0",
    ]  # fmt: skip


def test_a_registered_task_has_its_setting_as_a_flag(headline_task):
    help_text = finetune_script().build_parser().format_help()
    section = help_text.split("settings of the headline-classification task:")[1]
    assert "--max-words WORDS, --max_words WORDS" in section
    assert TASKS["headline-classification"] is headline_task.HEADLINE_CLASSIFICATION


def test_a_bad_value_of_the_tasks_setting_gets_one_clear_error(headline_task, tmp_path, capsys):
    assert finetune_script().main([*tiny_flags(tmp_path, tmp_path / "run"), "--max-words", "0"]) == 2
    assert capsys.readouterr().err == "finetune.py: error: `max_words` must be >= 1, got 0.\n"
    assert not (tmp_path / "run").exists()


def test_a_new_task_built_on_classification_refuses_padding_free_as_classification_does(
    headline_task, tmp_path, capsys
):
    assert finetune_script().main([*tiny_flags(tmp_path, tmp_path / "run"), "--padding-free"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("finetune.py: error: --padding-free: headline-classification pools one vector per row")
    assert error.count("\n") == 1 and "drop --padding-free" in error


@pytest.mark.slow
def test_a_registered_task_fine_tunes_end_to_end_with_its_setting(headline_task, encoder, tmp_path, capsys):
    output_dir = tmp_path / "run"
    assert finetune_script().main([*tiny_flags(encoder, output_dir), "--max-words", "3"]) == 0
    assert "\ndone: {'eval_" in capsys.readouterr().out
    run_config = json.loads((output_dir / "run_config.json").read_text())
    assert run_config["task"] == "headline-classification"
    assert run_config["task_settings"] == {"text_pair_column": None, "max_words": 3}
    assert (output_dir / "model.safetensors").is_file()
    # what the run trained on: the first 3 words of each text
    args = FinetuningArguments.resolve(run_config)
    split = embedded_dataset("sequence-classification")["train"].select(range(8))
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    features = TASKS["headline-classification"].features(split, tokenizer, args, 32, lambda label: 0)
    cut = [" ".join(text.split()[:3]) for text in split["text"]]
    assert features["input_ids"] == tokenizer(cut, truncation=True, max_length=32)["input_ids"]
