"""Tests of coreformer_settings, the torch-free declarations of every run setting: they name what the registries
hold, and the runs' argument classes add checks but no setting of their own (so that --help shows every one).
That the scripts build their parsers from them without importing torch is tested in test_cli.py."""

import dataclasses

import pytest

from coreformer import families
from coreformer.training.finetuning import FinetuningArguments
from coreformer.training.objectives import OBJECTIVES
from coreformer.training.pretraining import PretrainingArguments
from coreformer.training.tasks import TASKS
from coreformer_settings import finetuning, pretraining


def test_the_settings_name_every_registered_family_objective_and_task():
    assert pretraining.FAMILY_NAMES == tuple(families.FAMILIES)
    assert pretraining.OBJECTIVE_NAMES == tuple(OBJECTIVES)
    assert finetuning.TASK_NAMES == tuple(TASKS)


@pytest.mark.parametrize(
    "arguments, settings",
    [(PretrainingArguments, pretraining.PretrainingSettings), (FinetuningArguments, finetuning.FinetuningSettings)],
    ids=["pretraining", "finetuning"],
)
def test_every_setting_is_declared_once_in_the_torch_free_settings(arguments, settings):
    assert issubclass(arguments, settings)
    declared = [(spec.name, spec.default, spec.metadata) for spec in dataclasses.fields(settings)]
    assert [(spec.name, spec.default, spec.metadata) for spec in dataclasses.fields(arguments)] == declared
