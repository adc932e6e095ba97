"""Adding a pretraining objective is one file plus one registry line: a toy objective written to a temporary module
(its settings class beside it) and registered with one `OBJECTIVE_REGISTRY` entry is a choice of
training/pretrain.py, its setting is a flag that is checked, and it trains a tiny decoder end to end."""

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest
from test_pretraining import PRETRAIN, tiny_settings

from coreformer.training.objectives import OBJECTIVES
from coreformer.training.pretraining.run import PretrainingArguments
from coreformer_settings.components import Registered
from coreformer_settings.objectives import OBJECTIVE_REGISTRY

# Next-token prediction with the loss on the end of each block only: a causal LM whose collator drops the labels of
# the first (1 - labeled_share) of the positions.
TOY_OBJECTIVE = '''
"""A toy objective: causal LM with the loss on the last `labeled_share` of each block."""

from dataclasses import dataclass

from coreformer.training.objectives.causal_lm import CausalLM, PackedCausalLMCollator
from coreformer_settings.base import arg
from coreformer_settings.objectives import ObjectiveSettings


@dataclass
class SuffixSettings(ObjectiveSettings):
    labeled_share: float = arg(0.5, "suffix-lm: share of each block, at its end, that carries the loss")

    def __post_init__(self):
        self.check_between("labeled_share", 0.0, 1.0, low_open=True, high_open=False)


@dataclass(kw_only=True)
class SuffixCollator(PackedCausalLMCollator):
    labeled_share: float

    def __call__(self, examples):
        batch = super().__call__(examples)
        unlabeled = round(batch["labels"].shape[1] * (1 - self.labeled_share))
        batch["labels"][:, :unlabeled] = -100
        return batch


@dataclass(frozen=True)
class SuffixLM(CausalLM):
    def collator(self, tokenizer, args):
        share = args.objective_settings.labeled_share
        return SuffixCollator(eos_token_id=tokenizer.eos_token_id, labeled_share=share)


SUFFIX_LM = SuffixLM(
    name="suffix-lm",
    families=("decoder",),
    description="next-token prediction on the end of each block",
    auto_class="AutoModelForCausalLM",
    pipeline_tag="text-generation",
    usage="",
    required_tokens=("eos_token",),
)
'''


@pytest.fixture
def suffix_lm(tmp_path, monkeypatch):
    """The toy objective's module, importable, and registered with one line."""
    (tmp_path / "toy_suffix_lm.py").write_text(textwrap.dedent(TOY_OBJECTIVE))
    monkeypatch.syspath_prepend(str(tmp_path))
    toy = importlib.import_module("toy_suffix_lm")
    monkeypatch.setitem(OBJECTIVE_REGISTRY, "suffix-lm", Registered("toy_suffix_lm:SUFFIX_LM", toy.SuffixSettings))
    yield toy
    sys.modules.pop("toy_suffix_lm")


def pretrain_script():
    spec = importlib.util.spec_from_file_location("pretrain_script_for_toy", PRETRAIN)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def tiny_config(tmp_path: Path, **overrides) -> Path:
    """A tiny decoder run as a --config file (4 steps, the model mapping included)."""
    settings = tiny_settings("decoder", max_steps=4, eval_every=2, eval_batches=2, **overrides)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(settings))
    return path


def test_a_registered_objective_is_a_choice_and_its_setting_a_flag(suffix_lm):
    help_text = pretrain_script().build_parser().format_help()
    section = help_text.split("settings of the suffix-lm objective:")[1]
    assert "--labeled-share" in section and "share of each block" in section
    assert OBJECTIVES["suffix-lm"] is suffix_lm.SUFFIX_LM


def test_a_bad_value_of_the_objectives_setting_gets_one_clear_error(suffix_lm, tmp_path, capsys):
    argv = ["--config", str(tiny_config(tmp_path)), "--objective", "suffix-lm", "--labeled-share", "0"]
    assert pretrain_script().main([*argv, "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == "pretrain.py: error: `labeled_share` must be in (0, 1], got 0.0.\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_registered_objective_pretrains_end_to_end_with_its_setting(suffix_lm, tmp_path):
    output_dir = tmp_path / "run"
    argv = ["--config", str(tiny_config(tmp_path)), "--objective", "suffix-lm", "--labeled-share", "0.25"]
    assert pretrain_script().main([*argv, "--output-dir", str(output_dir)]) == 0
    run_config = json.loads((output_dir / "run_config.json").read_text())
    assert (run_config["objective"], run_config["objective_settings"]) == ("suffix-lm", {"labeled_share": 0.25})
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert len(metrics["history"]["train"]) >= 1 and metrics["history"]["train"][-1]["step"] == 4
    assert (output_dir / "model.safetensors").is_file()
    # the collator the run trained with puts the loss on the last quarter of each block only
    args = PretrainingArguments.resolve(run_config)
    collator = OBJECTIVES["suffix-lm"].collator(type("Tokenizer", (), {"eos_token_id": 2})(), args)
    labels = collator([{"input_ids": list(range(3, 35))}])["labels"]  # one block of 32
    assert (labels != -100).sum() == 8 and (labels[0, -8:] != -100).all()
