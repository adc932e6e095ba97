"""The fine-tuning tasks, one file each; THE registry of their names is the torch-free
`coreformer_settings.tasks.TASK_REGISTRY` (one line per task: where the task is, and the class of its own settings).
Adding a task is a new file and one line there.

    task                      file                         as transformers'     Auto class
    sequence-classification   sequence_classification.py   run_glue             AutoModelForSequenceClassification
    token-classification      token_classification.py      run_ner              AutoModelForTokenClassification
    question-answering        question_answering.py        run_qa               AutoModelForQuestionAnswering
    causal-lm                 causal_lm.py                 run_clm              AutoModelForCausalLM
    seq2seq                   seq2seq.py                   run_summarization    AutoModelForSeq2SeqLM
    multiple-choice           multiple_choice.py           run_swag             AutoModelForMultipleChoice

    TASKS       name -> Task, over the registry (a task's module is imported on first use)

Each is a `Task` (base.py: columns, embedded data, features, collator, metrics, prediction rows, card text); its own
settings reach it as `args.task_settings`.
"""

from collections.abc import Mapping

from coreformer_settings.components import Members
from coreformer_settings.tasks import TASK_REGISTRY

from .base import Evaluation, Task

TASKS: Mapping[str, Task] = Members(TASK_REGISTRY, Task)

__all__ = ["TASKS", "Evaluation", "Task"]
