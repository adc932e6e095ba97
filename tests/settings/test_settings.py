"""Tests of coreformer_settings, the torch-free declarations of every run setting: the registries' names are read
from the registries, the runs' argument classes add checks but no setting of their own (so that --help shows every
one), and each objective's own settings are flags, config keys and checks of that objective alone.
That the scripts build their parsers from them without importing torch is tested in test_cli.py."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from coreformer import families
from coreformer.training.finetuning.arguments import FinetuningArguments
from coreformer.training.objectives import OBJECTIVES
from coreformer.training.pretraining.run import PretrainingArguments
from coreformer.training.tasks import TASKS
from coreformer_settings import finetuning, pretraining
from coreformer_settings.base import FinetuningError, PretrainingError, arg
from coreformer_settings.components import Registered
from coreformer_settings.objectives import OBJECTIVE_REGISTRY, ElectraSettings, objective_fields
from coreformer_settings.registries import FAMILY_NAMES
from coreformer_settings.tasks import TASK_REGISTRY, QuestionAnsweringSettings, task_fields

PRETRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "training" / "pretrain.py"


def test_family_names_are_read_from_the_family_registry_file():
    assert FAMILY_NAMES == tuple(families.FAMILIES)


@pytest.mark.parametrize("loaded, registry", [(OBJECTIVES, OBJECTIVE_REGISTRY), (TASKS, TASK_REGISTRY)])
def test_every_registry_entry_loads_as_the_member_of_its_name(loaded, registry):
    assert list(loaded) == list(registry)
    for name, member in loaded.items():
        assert member.name == name


@pytest.mark.parametrize(
    "arguments, settings",
    [(PretrainingArguments, pretraining.PretrainingSettings), (FinetuningArguments, finetuning.FinetuningSettings)],
    ids=["pretraining", "finetuning"],
)
def test_every_setting_is_declared_once_in_the_torch_free_settings(arguments, settings):
    assert issubclass(arguments, settings)
    declared = [(spec.name, spec.default, spec.metadata) for spec in dataclasses.fields(settings)]
    assert [(spec.name, spec.default, spec.metadata) for spec in dataclasses.fields(arguments)] == declared


def test_the_objective_settings_left_the_run_settings():
    run = {spec.name for spec in dataclasses.fields(pretraining.PretrainingSettings)}
    assert not run & set(objective_fields())
    assert {"mlm_probability", "mask_ratio", "poisson_lambda", "generator_fraction", "rtd_weight"} <= set(
        objective_fields()
    )


def test_an_objective_reads_its_own_flat_settings_typed_into_its_settings_class():
    args = PretrainingArguments.resolve(
        {"family": "encoder", "objective": "electra", "rtd_weight": "20", "mlm_probability": 0.2}
    )
    assert args.objective_settings == ElectraSettings(mlm_probability=0.2, rtd_weight=20.0)
    again = PretrainingArguments.resolve(dataclasses.asdict(args))  # run_config.json read back as a --config
    assert again.objective_settings == args.objective_settings


def test_a_setting_of_another_objective_is_refused_naming_the_objective_that_owns_it():
    with pytest.raises(PretrainingError, match=r"`rtd_weight` is a setting of the electra objective, .* masked-lm"):
        PretrainingArguments.resolve({"family": "encoder", "rtd_weight": 10})


@pytest.mark.parametrize(
    "values, message",
    [
        ({"family": "encoder", "mlm_probability": 1.0}, r"`mlm_probability` must be in \[0, 1\), got 1.0"),
        ({"family": "seq2seq", "poisson_lambda": 0}, r"`poisson_lambda` must be > 0, got 0"),
        ({"family": "encoder", "objective": "electra", "generator_fraction": 0}, r"must be in \(0, 1\], got 0"),
        ({"family": "encoder", "objective": "electra", "rtd_weight": -1}, r"`rtd_weight` must be > 0, got -1"),
    ],
)
def test_a_bad_objective_setting_gets_one_clear_error(values, message):
    with pytest.raises(PretrainingError, match=message):
        PretrainingArguments.resolve(values)


def test_an_unknown_setting_lists_the_objectives_settings_among_the_known():
    with pytest.raises(PretrainingError, match=r"Unknown setting\(s\) mlm_probabilty; known: .*mlm_probability"):
        PretrainingArguments.resolve({"family": "encoder", "mlm_probabilty": 0.2})


def _pretrain_script():
    spec = importlib.util.spec_from_file_location("pretrain_script_for_settings", PRETRAIN_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_each_objective_setting_is_a_flag_of_the_pretraining_script_under_its_objective():
    parser = _pretrain_script().build_parser()
    given = vars(parser.parse_args(["--mask-ratio", "0.4", "--rtd-weight", "7"]))
    assert given == {"preset": None, "config": None, "mask_ratio": 0.4, "rtd_weight": 7.0}  # only the flags given
    help_text = parser.format_help()
    for owner, spec in objective_fields().values():
        section = help_text.split(f"settings of the {owner} objective:")[1]
        assert "--" + spec.name.replace("_", "-") in section.split("\n\n")[0]


FINETUNE_RUN = {"model": "unused", "output_dir": "unused"}


def test_a_task_reads_its_own_flat_settings_with_their_aliases_typed_into_its_settings_class():
    given = {"task": "question-answering", "doc_stride": "16", "question_column": "q", **FINETUNE_RUN}
    args = FinetuningArguments.resolve(given)
    assert args.task_settings == QuestionAnsweringSettings(question_column="q", doc_stride=16)
    assert args.setting("question_column") == "q" and args.setting("text_column") == "text"
    assert FinetuningArguments.resolve(dataclasses.asdict(args)).task_settings == args.task_settings
    assert not {spec.name for spec in dataclasses.fields(finetuning.FinetuningSettings)} & set(task_fields())


@pytest.mark.parametrize(
    "values, message",
    [
        ({"doc_stride": 8}, r"`doc_stride` is a setting of the question-answering task, .* sequence-classification"),
        ({"task": "question-answering", "doc_stride": -1}, r"`doc_stride` must be >= 0, got -1"),
        ({"task": "question-answering", "max_answer_length": 0}, r"`max_answer_length` must be >= 1, got 0"),
    ],
)
def test_a_bad_or_misplaced_task_setting_gets_one_clear_error(values, message):
    with pytest.raises(FinetuningError, match=message):
        FinetuningArguments.resolve({**FINETUNE_RUN, **values})


def test_an_objective_setting_named_like_a_run_setting_is_refused(monkeypatch):
    @dataclasses.dataclass
    class Clashing(ElectraSettings):
        seed: int = arg(0, "a second --seed")

    monkeypatch.setitem(OBJECTIVE_REGISTRY, "clashing", Registered("nowhere:CLASHING", Clashing))
    with pytest.raises(PretrainingError, match=r"`seed` of clashing is a setting of every run already"):
        PretrainingArguments.resolve({"family": "encoder"})


def test_a_preset_that_extends_another_says_only_what_differs(tmp_path):
    (tmp_path / "encoder-tiny-modern.yaml").write_text(
        "family: encoder\nmodel:\n  hidden_size: 128\n  gated_mlp: true\nlr: 2.0e-3\nmax_steps: 600\n"
    )
    (tmp_path / "encoder-tiny.yaml").write_text("extends: tiny-modern\nmax_steps: 1800\n")
    (tmp_path / "encoder-small.yaml").write_text("extends: tiny\nmodel:\n  hidden_size: 256\n")
    values, source = pretraining.gather_settings(family="encoder", preset="small", configs_dir=tmp_path)
    assert source == "small" and "extends" not in values
    assert values["model"] == {"hidden_size": 256, "gated_mlp": True}  # model fields merged one by one
    assert values["lr"] == 2.0e-3 and values["max_steps"] == 1800  # the nearest preset wins
    config = tmp_path / "mine.yaml"
    config.write_text("family: encoder\nextends: tiny\nlr: 1.0e-3\n")
    values, _ = pretraining.gather_settings(config_file=config, configs_dir=tmp_path)
    assert values["lr"] == 1.0e-3 and values["max_steps"] == 1800 and values["model"]["gated_mlp"] is True


def test_presets_that_extend_each_other_in_a_circle_are_refused(tmp_path):
    (tmp_path / "decoder-tiny.yaml").write_text("extends: tiny-modern\n")
    (tmp_path / "decoder-tiny-modern.yaml").write_text("extends: tiny\n")
    with pytest.raises(PretrainingError, match="in a circle: tiny -> tiny-modern -> tiny"):
        pretraining.gather_settings(family="decoder", preset="tiny", configs_dir=tmp_path)
    config = tmp_path / "mine.yaml"
    config.write_text("extends: tiny\n")
    with pytest.raises(PretrainingError, match="extends a preset but names no family; add `family:`"):
        pretraining.gather_settings(config_file=config, configs_dir=tmp_path)


def test_a_config_file_that_does_not_parse_or_holds_no_mapping_is_refused_naming_it(tmp_path):
    from coreformer_settings.base import load_config_file

    broken, listed, commented = tmp_path / "broken.yaml", tmp_path / "listed.yml", tmp_path / "commented.yaml"
    broken.write_text("lr: [1, 2\nmax_steps: 3\n")
    listed.write_text("- lr\n- max_steps\n")
    commented.write_text("_why: a note\nlr: 1.0e-3\nmodel:\n  hidden_size: 64\nname: 'off'\nflag: off\n")
    with pytest.raises(PretrainingError, match=r"broken\.yaml' does not parse: while parsing a flow sequence"):
        load_config_file(broken, error=PretrainingError)
    with pytest.raises(PretrainingError, match=r"listed\.yml' must hold a mapping of settings"):
        load_config_file(listed, error=PretrainingError)
    # YAML 1.1 as PyYAML reads it, whichever loader parses: an unquoted off is False, a quoted one a string
    assert load_config_file(commented) == {"lr": 1.0e-3, "model": {"hidden_size": 64}, "name": "off", "flag": False}
