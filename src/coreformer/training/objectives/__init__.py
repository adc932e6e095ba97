"""The pretraining objectives, one file each, and their registry: adding one is a new file and one line below.

    name          families   file
    masked-lm     encoder    masked_lm.py   BERT masking (15%, 80/10/10)
    causal-lm     decoder    causal_lm.py   next-token prediction on packed blocks
    denoising     seq2seq    denoising.py   BART text infilling + sentence permutation
    electra       encoder    electra.py     replaced-token detection with a small masked-LM generator

Each is an `Objective` (base.py: examples, collator, required special tokens, model, loss, what to save, card text);
`--objective NAME` picks one, the family's `default_objective` (families.py) when it is not given.
"""

from .base import Objective
from .causal_lm import CAUSAL_LM
from .denoising import DENOISING
from .electra import ELECTRA
from .masked_lm import MASKED_LM

_REGISTERED = (
    MASKED_LM,
    CAUSAL_LM,
    DENOISING,
    ELECTRA,
)
OBJECTIVES: dict[str, Objective] = {objective.name: objective for objective in _REGISTERED}

__all__ = ["OBJECTIVES", "Objective"]
