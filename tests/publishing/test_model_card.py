"""Tests of hub/model_card.py: each kind renders from its template, the metadata round-trips through huggingface_hub's
ModelCard, validate_model_card names what is wrong, write_model_card is atomic, and the templates ship in the wheel."""

import os
import re
import tomllib
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from coreformer.hub import model_card
from coreformer.hub.model_card import KINDS, ModelCardInfo, render_model_card, validate_model_card, write_model_card

ROOT = Path(__file__).resolve().parents[2]


def make_info(kind: str = "fine-tuned", **overrides) -> ModelCardInfo:
    fields = dict(
        kind=kind,
        title="coreformer tiny classifier",
        family="encoder",
        auto_class="AutoModelForSequenceClassification",
        summary="A tiny encoder fine-tuned to tell positive from negative sentences.",
        num_parameters=123_456,
        base_model="someone/coreformer-encoder-tiny",
        datasets=["stanfordnlp/sst2"],
        dataset_description="SST-2 sentences",
        pipeline_tag="text-classification",
        task_type="text-classification",
        task_name="Sentiment analysis",
        eval_results={"accuracy": 0.875, "f1": 0.8612},
        eval_dataset="stanfordnlp/sst2",
        hyperparameters=[("learning rate", 2e-5), ("epochs", 3), ("EOS token", "</s>")],
        usage='print(model(**tokenizer("great film", return_tensors="pt")).logits)',
        tags=["sentiment"],
    )
    fields.update(overrides)
    return ModelCardInfo(**fields)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_renders_and_its_metadata_round_trips(kind):
    text = str(render_model_card(make_info(kind), path_hint="me/tiny"))
    data = ModelCard(text).data  # what the Hub and huggingface_hub read back
    assert data.license == "apache-2.0" and data.library_name == "transformers"
    assert data.pipeline_tag == "text-classification"
    assert {"coreformer", "custom_code", "encoder", kind, "sentiment"} <= set(data.tags)
    assert data.base_model == "someone/coreformer-encoder-tiny" and data.datasets == ["stanfordnlp/sst2"]
    assert data.model_name == "coreformer tiny classifier"
    assert {(r.task_type, r.dataset_type, r.metric_type, r.metric_value) for r in data.eval_results} == {
        ("text-classification", "stanfordnlp/sst2", "accuracy", 0.875),
        ("text-classification", "stanfordnlp/sst2", "f1", 0.8612),
    }
    assert validate_model_card(text).data.to_dict() == data.to_dict()
    body = ModelCard(text).text
    assert "# coreformer tiny classifier" in body and "123,456" in body
    assert 'AutoModelForSequenceClassification.from_pretrained("me/tiny")' in body  # coreformer installed
    assert 'AutoModelForSequenceClassification.from_pretrained("me/tiny", trust_remote_code=True)' in body
    assert 'print(model(**tokenizer("great film"' in body
    assert "| accuracy | 0.8750 |" in body and "| learning rate | 2e-05 |" in body
    assert "| EOS token | &lt;/s> |" in body  # a cell that would otherwise vanish as an HTML tag
    assert "## Intended use" in body and "## Limitations" in body
    assert "{{" not in text and "{%" not in text


def test_local_paths_stay_out_of_the_metadata_and_are_described_in_the_text(tmp_path):
    info = make_info(base_model=str(tmp_path), datasets=[], eval_dataset="my_reviews.csv (test split)")
    card = render_model_card(info)
    assert card.data.base_model is None and card.data.datasets is None
    assert f"`{tmp_path}`" in card.text
    (result,) = card.data.eval_results[:1]
    assert result.dataset_name == "my_reviews.csv (test split)" and result.dataset_type == model_card.LOCAL_DATASET_TYPE
    with pytest.raises(ValueError, match="Hub dataset ids only.*dataset_description"):
        render_model_card(make_info(datasets=["./data/train.jsonl"]))


def test_card_without_eval_results_has_no_model_index():
    card = render_model_card(make_info("pretrained", eval_results={}, eval_dataset=None))
    assert "model-index" not in str(card) and card.data.eval_results is None
    assert "No evaluation was recorded" in card.text
    validate_model_card(str(card))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(kind="distilled"), "Unknown model card kind 'distilled'; the allowed kinds are pretrained, fine-tuned"),
        (dict(family="mixer"), "Unknown family 'mixer'"),
        (dict(task_type=None, pipeline_tag=None), "need a `task_type`"),
        (dict(eval_results={"accuracy": float("nan")}), "'accuracy' must be a finite number"),
        (dict(eval_dataset=None, datasets=[]), "need an `eval_dataset`"),
    ],
)
def test_bad_info_raises_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        render_model_card(make_info(**overrides))


def _card_with(metadata: str) -> str:
    return f"---\n{metadata}\n---\n\n# a card\n"


REQUIRED = "license: mit\nlibrary_name: transformers\n"
GOOD_INDEX = """model-index:
- name: tiny
  results:
  - task: {type: text-classification}
    dataset: {name: SST-2, type: stanfordnlp/sst2}
    metrics:
    - {type: accuracy, value: 0.9}"""


@pytest.mark.parametrize(
    "text, message",
    [
        ("# no metadata at all\n", "no metadata block"),
        (_card_with("license: [unclosed"), "not valid YAML"),
        (_card_with("- a list"), "must be a YAML mapping"),
        (_card_with("library_name: transformers"), "`license` must be a non-empty string"),
        (_card_with("license: mit"), "`library_name` must be a non-empty string"),
        (_card_with("license: mit\nlibrary_name: transformers\ntags: coreformer"), "`tags` must be a list"),
        (_card_with("license: mit\nlibrary_name: transformers\nmodel-index: []"), "non-empty list"),
        (
            _card_with(REQUIRED + GOOD_INDEX.replace("task: {type: ", "task: {x: ")),
            r"results\[\]\.task\.type",
        ),
        (
            _card_with(REQUIRED + GOOD_INDEX.replace("name: SST-2, ", "")),
            r"dataset\.name",
        ),
        (
            _card_with(REQUIRED + GOOD_INDEX.replace("value: 0.9", "value: high")),
            "'accuracy' needs a finite numeric `value`, got 'high'",
        ),
        (
            _card_with(REQUIRED + GOOD_INDEX.replace("    metrics:\n", "    m:\n")),
            "needs a non-empty `metrics` list",
        ),
    ],
    ids=[
        "no-block",
        "bad-yaml",
        "not-mapping",
        "no-license",
        "no-library",
        "tags-string",
        "empty-index",
        "no-task-type",
        "no-dataset-name",
        "text-value",
        "no-metrics",
    ],
)
def test_validate_names_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        validate_model_card(text)


def test_validate_accepts_a_well_formed_card_from_a_file_or_folder(tmp_path):
    (tmp_path / "README.md").write_text(_card_with(REQUIRED + GOOD_INDEX))
    for where in (tmp_path, tmp_path / "README.md", str(tmp_path / "README.md")):
        assert validate_model_card(where).data.eval_results[0].metric_value == 0.9
    with pytest.raises(ValueError, match="does not exist"):
        validate_model_card(tmp_path / "elsewhere")


def test_write_model_card_replaces_readme_and_leaves_no_temporary(tmp_path):
    (tmp_path / "README.md").write_text("old card")
    path = write_model_card(tmp_path, make_info("converted"))
    assert path == tmp_path / "README.md" and sorted(os.listdir(tmp_path)) == ["README.md"]  # no temporaries left
    assert path.stat().st_mode & 0o777 == 0o644
    assert f'from_pretrained("{tmp_path}")' in path.read_text()  # path_hint defaults to the folder
    assert validate_model_card(path).data.model_name == "coreformer tiny classifier"


def test_templates_ship_in_the_wheel_and_modeling_code_never_imports_cards():
    # src/coreformer/hub/model_cards is a symlink to the top-level model_cards/, so the package finds them in place and
    # every package sits under src/ (one .pth line for editable installs).
    assert model_card.template_dir().resolve() == ROOT / "model_cards"
    assert {path.stem for path in (ROOT / "model_cards").glob("*.md")} >= set(KINDS)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"": "src"}
    assert "coreformer.hub.model_cards" in setuptools["packages"]
    assert setuptools["package-data"]["coreformer.hub.model_cards"] == ["*.md"]  # -> coreformer/hub/model_cards/*.md
    package = ROOT / "src" / "coreformer"
    for module in ("configuration_coreformer", "attention", "layers", "modeling_base", "modeling_encoder"):
        assert "model_card" not in (package / f"{module}.py").read_text(), module
    for module in ("modeling_decoder", "modeling_seq2seq"):
        assert "model_card" not in (package / f"{module}.py").read_text(), module
