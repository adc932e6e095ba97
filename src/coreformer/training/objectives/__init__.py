"""The pretraining objectives, one file each; THE registry of their names is the torch-free
`coreformer_settings.objectives.OBJECTIVE_REGISTRY` (one line per objective: where the objective is, and the class
of its own settings). Adding an objective is a new file and one line there.

    name          families   file
    masked-lm     encoder    masked_lm.py   BERT masking (15%, 80/10/10)
    causal-lm     decoder    causal_lm.py   next-token prediction on packed blocks
    denoising     seq2seq    denoising.py   BART text infilling + sentence permutation
    electra       encoder    electra.py     replaced-token detection with a small masked-LM generator

    OBJECTIVES      name -> Objective, read from the registry (an objective's module is imported on first use)
    objective(name) the registered Objective called `name`

Each is an `Objective` (base.py: examples, collator, required special tokens, model, loss, what to save, card text);
`--objective NAME` picks one, the family's `default_objective` (families.py) when it is not given. Its own settings
reach it as `args.objective_settings`.
"""

import importlib
from collections.abc import Iterator, Mapping

from coreformer_settings.objectives import OBJECTIVE_REGISTRY

from .base import Objective


def objective(name: str) -> Objective:
    """The Objective registered as `name`: its module imported, the object named checked to be that objective."""
    module, _, attribute = OBJECTIVE_REGISTRY[name].objective.partition(":")
    found = getattr(importlib.import_module(module), attribute)
    if not isinstance(found, Objective) or found.name != name:
        raise TypeError(f"OBJECTIVE_REGISTRY[{name!r}] names {found!r}, not an Objective called {name!r}.")
    return found


class _RegisteredObjectives(Mapping[str, Objective]):
    """name -> Objective over the registry as it is now (an objective registered later is in it too)."""

    def __getitem__(self, name: str) -> Objective:
        if name not in OBJECTIVE_REGISTRY:
            raise KeyError(name)
        return objective(name)

    def __iter__(self) -> Iterator[str]:
        return iter(OBJECTIVE_REGISTRY)

    def __len__(self) -> int:
        return len(OBJECTIVE_REGISTRY)


OBJECTIVES: Mapping[str, Objective] = _RegisteredObjectives()

__all__ = ["OBJECTIVES", "Objective", "objective"]
