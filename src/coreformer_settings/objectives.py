"""THE pretraining objective registry and each objective's own settings, importable without torch: where
`--objective NAME` finds its objective, and the flags, config keys and checks of the settings it owns.

    OBJECTIVE_REGISTRY              objective name -> Registered("module:NAME" of the Objective, its settings class):
                                    one line per objective
    ObjectiveSettings               the base of an objective's settings: a dataclass of `arg` fields (a flag each),
                                    checked in its __post_init__ (one PretrainingError per bad value)
    MaskedLMSettings, DenoisingSettings, ElectraSettings   the settings of the built-in objectives that have some
    objective_fields()              every registered objective's settings fields by name (--help, config files)
    objective_settings(name, values)    the typed, checked settings of objective `name` from raw values

A run's settings hold the chosen objective's in `objective_settings` (an instance of its settings class), which the
objective reads (`args.objective_settings.mlm_probability`); on the command line and in a config file they are flat
keys like every other setting (`--mlm-probability 0.2`, `mlm_probability: 0.2`). A setting of another objective is
refused, naming the objective that owns it.

To add an objective: write one file holding the `Objective` (and, when it has settings, its `ObjectiveSettings`
subclass), then add one line here. The built-in objectives' settings classes live in this file rather than beside
their objective because `--help` answers before torch is imported, and any module inside the `coreformer` package
imports torch (the package's `__init__` registers the models with transformers).
"""

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import PretrainingError, RunSettings, arg
from .components import Registered, owned_fields, owned_settings


@dataclass
class ObjectiveSettings(RunSettings):
    """An objective's own settings (none here): subclasses add `arg` fields and check them in __post_init__."""

    error: typing.ClassVar[type[PretrainingError]] = PretrainingError


@dataclass
class MaskedLMSettings(ObjectiveSettings):
    """BERT masking (objectives/masked_lm.py)."""

    mlm_probability: float = arg(0.15, "encoder: share of tokens selected for masking")

    def __post_init__(self) -> None:
        self.check_between("mlm_probability", 0.0, 1.0, low_open=False, high_open=True)


@dataclass
class DenoisingSettings(ObjectiveSettings):
    """BART text infilling (objectives/denoising.py)."""

    mask_ratio: float = arg(0.3, "seq2seq: share of tokens hidden by text infilling")
    poisson_lambda: float = arg(3.0, "seq2seq: mean infilled span length")

    def __post_init__(self) -> None:
        self.check_between("mask_ratio", 0.0, 1.0, low_open=False, high_open=True)
        self.check_positive("poisson_lambda")


@dataclass
class ElectraSettings(MaskedLMSettings):
    """ELECTRA (objectives/electra.py): its generator's masking, width and the weight of the discriminator's loss."""

    generator_fraction: float = arg(
        0.25, "electra: the generator's width as a share of the discriminator's (paper: 1/4 to 1/2 work best)"
    )
    rtd_weight: float = arg(50.0, "electra: weight of the replaced-token-detection loss (paper: 50)")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_between("generator_fraction", 0.0, 1.0, low_open=True, high_open=False)
        self.check_positive("rtd_weight")


OBJECTIVE_REGISTRY: dict[str, Registered] = {
    "masked-lm": Registered("coreformer.training.objectives.masked_lm:MASKED_LM", MaskedLMSettings),
    "causal-lm": Registered("coreformer.training.objectives.causal_lm:CAUSAL_LM", ObjectiveSettings),
    "denoising": Registered("coreformer.training.objectives.denoising:DENOISING", DenoisingSettings),
    "electra": Registered("coreformer.training.objectives.electra:ELECTRA", ElectraSettings),
}


def objective_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """setting name -> (the first registered objective that owns it, its field); ELECTRA's masking probability is
    masked-lm's, listed once."""
    return owned_fields(OBJECTIVE_REGISTRY)


def objective_settings(objective: str, values: Mapping[str, Any] | ObjectiveSettings) -> ObjectiveSettings:
    """The settings of the registered `objective` from raw values, typed and checked by its settings class; a setting
    another objective owns is refused, naming that objective."""
    return owned_settings(OBJECTIVE_REGISTRY, objective, values, kind="objective")
