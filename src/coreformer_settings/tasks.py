"""THE fine-tuning task registry and each task's own settings, importable without torch: where `--task NAME` finds
its task, and the flags, config keys and checks of the settings it owns.

    TASK_REGISTRY            task name -> Registered("module:NAME" of the Task, its settings class): one line a task
    TaskSettings             the base of a task's settings: a dataclass of `arg` fields (a flag each, also
                             `--field_name` and the example scripts' aliases), checked in __post_init__
    SequenceClassificationSettings, TokenClassificationSettings, QuestionAnsweringSettings, Seq2SeqSettings,
    MultipleChoiceSettings   the built-in tasks' own columns and lengths
    task_fields()            every registered task's settings fields by name (--help, config files)
    task_settings(name, values)   the typed, checked settings of task `name` from raw values

A run's settings hold the chosen task's in `task_settings` (an instance of its settings class), which the task reads
(`args.task_settings.doc_stride`); on the command line and in a config file they are flat keys like every other
setting (`--doc-stride 64`, `doc_stride: 64`). A setting of another task is refused, naming the task that owns it.
The settings every task reads (`text_column`, `label_column`, the lengths and generation settings the driver passes
to Trainer) stay run settings (finetuning.py).

To add a task: write one file holding the `Task` (and, when it has settings, its `TaskSettings` subclass), then add
one line here. The built-in tasks' settings classes live in this file rather than beside their task because
`--help` answers before torch is imported, and any module inside the `coreformer` package imports torch.
"""

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import FinetuningError, RunSettings, arg
from .components import Registered, owned_fields, owned_settings


@dataclass
class TaskSettings(RunSettings):
    """A task's own settings (none here): subclasses add `arg` fields and check them in __post_init__. A field whose
    metadata has `column` names a data column (`column`: what it holds, for the missing-column message)."""

    error: typing.ClassVar[type[FinetuningError]] = FinetuningError


@dataclass
class SequenceClassificationSettings(TaskSettings):
    text_pair_column: str | None = arg(
        None, "sequence-classification: optional second text (sentence pairs)", column="the second text"
    )


@dataclass
class TokenClassificationSettings(TaskSettings):
    tokens_column: str = arg("tokens", "token-classification: the words of each example", column="the words")


@dataclass
class QuestionAnsweringSettings(TaskSettings):
    question_column: str = arg(
        "question", "question-answering: the question", aliases=("--question_column_name",), column="the questions"
    )
    context_column: str = arg(
        "context", "question-answering: the context", aliases=("--context_column_name",), column="the contexts"
    )
    answers_column: str = arg(
        "answers",
        "question-answering: SQuAD-style answers {'text': [...], 'answer_start': [...]}",
        aliases=("--answer_column_name",),
        column="the SQuAD-style answers",
    )
    id_column: str = arg("id", "question-answering: question ids (row numbers when the column is absent)")
    doc_stride: int = arg(32, "question-answering: overlap between the windows of a long context")
    max_answer_length: int = arg(30, "question-answering: longest answer, in tokens")

    def __post_init__(self) -> None:
        self.check_at_least(0, ("doc_stride",))
        self.check_at_least(1, ("max_answer_length",))


@dataclass
class Seq2SeqSettings(TaskSettings):
    summary_column: str = arg("summary", "seq2seq: the target text", column="the target texts")
    source_prefix: str = arg("", "seq2seq: text put before every input (T5-style 'summarize: ')")


@dataclass
class MultipleChoiceSettings(TaskSettings):
    choices_column: str = arg(
        "choices",
        "multiple-choice: the candidate answers (a list, the same length everywhere)",
        column="the candidate answers",
    )


TASK_REGISTRY: dict[str, Registered] = {
    "sequence-classification": Registered(
        "coreformer.training.tasks.sequence_classification:SEQUENCE_CLASSIFICATION", SequenceClassificationSettings
    ),
    "token-classification": Registered(
        "coreformer.training.tasks.token_classification:TOKEN_CLASSIFICATION", TokenClassificationSettings
    ),
    "question-answering": Registered(
        "coreformer.training.tasks.question_answering:QUESTION_ANSWERING", QuestionAnsweringSettings
    ),
    "causal-lm": Registered("coreformer.training.tasks.causal_lm:CAUSAL_LM", TaskSettings),
    "seq2seq": Registered("coreformer.training.tasks.seq2seq:SEQ2SEQ", Seq2SeqSettings),
    "multiple-choice": Registered("coreformer.training.tasks.multiple_choice:MULTIPLE_CHOICE", MultipleChoiceSettings),
}


def task_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """setting name -> (the first registered task that owns it, its field)."""
    return owned_fields(TASK_REGISTRY)


def task_settings(task: str, values: Mapping[str, Any] | TaskSettings) -> TaskSettings:
    """The settings of the registered `task` from raw values, typed and checked by its settings class; a setting
    another task owns is refused, naming that task."""
    return owned_settings(TASK_REGISTRY, task, values, kind="task")
