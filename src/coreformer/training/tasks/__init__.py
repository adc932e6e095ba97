"""The fine-tuning tasks, one file each, and their registry: adding one is a new file and one line below.

    task                      file                         as transformers'     Auto class
    sequence-classification   sequence_classification.py   run_glue             AutoModelForSequenceClassification
    token-classification      token_classification.py      run_ner              AutoModelForTokenClassification
    question-answering        question_answering.py        run_qa               AutoModelForQuestionAnswering
    causal-lm                 causal_lm.py                 run_clm              AutoModelForCausalLM
    seq2seq                   seq2seq.py                   run_summarization    AutoModelForSeq2SeqLM
    multiple-choice           multiple_choice.py           run_swag             AutoModelForMultipleChoice

Each is a `Task` (base.py: columns, embedded data, features, collator, metrics, prediction rows, card text).
"""

from .base import Evaluation, Task
from .causal_lm import CAUSAL_LM
from .multiple_choice import MULTIPLE_CHOICE
from .question_answering import QUESTION_ANSWERING
from .seq2seq import SEQ2SEQ
from .sequence_classification import SEQUENCE_CLASSIFICATION
from .token_classification import TOKEN_CLASSIFICATION

_REGISTERED = (
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
    QUESTION_ANSWERING,
    CAUSAL_LM,
    SEQ2SEQ,
    MULTIPLE_CHOICE,
)
TASKS: dict[str, Task] = {task.name: task for task in _REGISTERED}

__all__ = ["TASKS", "Evaluation", "Task"]
