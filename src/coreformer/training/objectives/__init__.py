"""The pretraining objectives, one file each; THE registry of their names is the torch-free
`coreformer_settings.objectives.OBJECTIVE_REGISTRY` (one line per objective: where the objective is, and the class
of its own settings). Adding an objective is a new file and one line there.

    name          families   file
    masked-lm     encoder    masked_lm.py   BERT masking (15%, 80/10/10)
    causal-lm     decoder    causal_lm.py   next-token prediction on packed blocks
    denoising     seq2seq    denoising.py   BART text infilling + sentence permutation
    electra       encoder    electra.py     replaced-token detection with a small masked-LM generator

    OBJECTIVES      name -> Objective, over the registry (an objective's module is imported on first use)

Each is an `Objective` (base.py: examples, collator, required special tokens, model, loss, what to save, card text);
`--objective NAME` picks one, the family's `default_objective` (families.py) when it is not given. Its own settings
reach it as `args.objective_settings`.
"""

from collections.abc import Mapping

from coreformer_settings.components import Members
from coreformer_settings.objectives import OBJECTIVE_REGISTRY

from .base import Objective

OBJECTIVES: Mapping[str, Objective] = Members(OBJECTIVE_REGISTRY, Objective)

__all__ = ["OBJECTIVES", "Objective"]
