"""Extractive question answering (transformers' run_qa): question + context -> the answer span; SQuAD EM / F1.

Long contexts are cut into `--max-length` windows overlapping by `--doc-stride`; each question's answer is the best
span (`pipelines.best_spans`) of its most confident window, cut from the context by the token offsets.

Embedded default: `def name(params): first docstring paragraph` of standard-library functions, with questions about
the function's name, its first parameter, a parameter's default value, or which parameter has a given default.
"""

import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import transformers

from ...pipelines import best_spans
from ..corpora import Definition, first_paragraph, seeded_sample, split_rows, stdlib_definitions
from .base import Evaluation, FinetuningError, Task
from .metrics import squad_scores

# tokenizers releases whose `return_overflowing_tokens` cuts the overflow short (pyproject excludes them too).
SHORT_OVERFLOW_TOKENIZERS = frozenset({"0.23.2"})


def _qa_example(definition: Definition, turn: int) -> dict | None:
    """Context `def name(a, b=1): doc` and one question about it, the answer located while the context is built."""
    doc = first_paragraph(definition.doc)
    if not definition.params or len(doc.split()) < 3:
        return None
    context = f"def {definition.name}("
    name_span = (4, definition.name)
    param_starts, default_starts = {}, {}
    for index, (param, default) in enumerate(definition.params):
        context += ", " if index else ""
        param_starts[param] = len(context)
        context += param
        if default is not None:
            context += "="
            default_starts[param] = len(context)
            context += default
    context += f"): {doc}"
    defaults = {param: default for param, default in definition.params if default is not None and len(default) <= 20}
    unique = [p for p, d in defaults.items() if list(defaults.values()).count(d) == 1 and d not in definition.name]
    first = definition.params[0][0]
    questions = {
        "name": ("What is the name of the function?", name_span),
        "first": (f"What is the first parameter of {definition.name}?", (param_starts[first], first)),
    }
    if defaults:
        param = next(iter(defaults))
        span = (default_starts[param], defaults[param])
        questions["default"] = (f"What is the default value of {param} in {definition.name}?", span)
    if unique:
        param = unique[-1]
        span = (param_starts[param], param)
        questions["which"] = (f"Which parameter of {definition.name} defaults to {defaults[param]}?", span)
    # Each kind in turn; a function without defaults asks one of the first two instead.
    kind = ("name", "first", "default", "which")[turn % 4]
    kind = kind if kind in questions else list(questions)[turn % len(questions)]
    question, (start, text) = questions[kind]
    assert context[start : start + len(text)] == text  # the span is where the context was built to have it
    return {
        "id": f"{definition.path}:{definition.lineno}:{kind}",
        "question": question,
        "context": context,
        "answers": {"text": [text], "answer_start": [start]},
    }


def _embedded_question_answering() -> datasets.DatasetDict:
    functions = [d for d in stdlib_definitions() if d.kind == "function" and d.params]
    rows = [row for turn, d in enumerate(seeded_sample(functions, 400)) if (row := _qa_example(d, turn)) is not None]
    return split_rows(rows)


def _question_ids(split, args) -> list[str]:
    if args.task_settings.id_column in split.column_names:
        return [str(value) for value in split[args.task_settings.id_column]]
    return [str(index) for index in range(len(split))]


def _question_answering_features(split, tokenizer, args, max_length: int) -> datasets.Dataset:
    """run_qa's windows: question + a window of the context per feature (stride `doc_stride`), start / end token
    of the first answer (0, the first token, when the window does not hold it), and for evaluation the character
    offsets, which tokens are context, and the question id."""
    if not tokenizer.is_fast:
        raise FinetuningError("Question answering maps tokens back to characters: it needs a fast tokenizer.")
    if (installed := importlib.metadata.version("tokenizers")) in SHORT_OVERFLOW_TOKENIZERS:
        raise FinetuningError(
            f"tokenizers {installed} returns only a sliver of a long context's windows past the first, so answers in "
            f"them would be lost; install another version (pip install 'tokenizers!={installed}')."
        )
    tokenizer.padding_side = "right"  # logits line up with offsets only when padding comes after the tokens
    ids = _question_ids(split, args)
    split = split.add_column("_qid", ids)

    settings = args.task_settings  # QuestionAnsweringSettings

    def encode(batch: dict[str, list]) -> dict[str, list]:
        questions = [question.lstrip() for question in batch[settings.question_column]]
        try:
            encoded = tokenizer(
                questions,
                batch[settings.context_column],
                truncation="only_second",
                max_length=max_length,
                stride=settings.doc_stride,
                return_overflowing_tokens=True,
                return_offsets_mapping=True,
            )
        except Exception as error:  # tokenizers: stride too large for what the question leaves of the window
            raise FinetuningError(
                f"Cannot cut the contexts into windows of {max_length} tokens with --doc-stride {settings.doc_stride}: "
                f"{error}. Lower --doc-stride or raise --max-length."
            ) from error
        sample = encoded.pop("overflow_to_sample_mapping")
        encoded.update(start_positions=[], end_positions=[], example_id=[], context_mask=[])
        for index, offsets in enumerate(encoded["offset_mapping"]):
            sequence_ids = encoded.sequence_ids(index)
            context_mask = [int(s == 1) for s in sequence_ids]
            answers = batch[args.task_settings.answers_column][sample[index]]
            start_token = end_token = 0
            if answers["text"]:
                start_char = answers["answer_start"][0]
                end_char = start_char + len(answers["text"][0])
                inside = [t for t, flag in enumerate(context_mask) if flag]
                if inside and offsets[inside[0]][0] <= start_char and offsets[inside[-1]][1] >= end_char:
                    start_token = next(t for t in inside if offsets[t][1] > start_char)
                    end_token = next(t for t in reversed(inside) if offsets[t][0] < end_char)
            encoded["start_positions"].append(start_token)
            encoded["end_positions"].append(end_token)
            encoded["example_id"].append(batch["_qid"][sample[index]])
            encoded["context_mask"].append(context_mask)
        return encoded

    return split.map(encode, batched=True, remove_columns=split.column_names)


def question_answering_predictions(
    features: Sequence[Mapping[str, Any]] | datasets.Dataset,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    contexts: Mapping[str, str],
    *,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """The answer text of each question: the best span (`pipelines.best_spans`) of each of its windows, the most
    probable window's span kept, cut from the context by the token offsets, surrounding whitespace trimmed.

    Args:
        features: rows with "example_id", "offset_mapping" (T, 2) and "context_mask" (T,) of each window.
        start_logits, end_logits: (N, T') with T' >= each window's length (Trainer pads batches with -100).
        contexts: question id -> context.
    """
    best: dict[str, tuple[float, str]] = {}
    for index, feature in enumerate(features):
        mask = np.asarray(feature["context_mask"], dtype=bool)
        length = len(mask)
        spans = best_spans(
            np.asarray(start_logits[index][:length]),
            np.asarray(end_logits[index][:length]),
            mask,
            max_answer_length=max_answer_length,
        )
        if not spans:
            continue
        start_token, end_token, score = spans[0]
        question = feature["example_id"]
        offsets = feature["offset_mapping"]
        text = contexts[question][offsets[start_token][0] : offsets[end_token][1]].strip()
        if question not in best or score > best[question][0]:
            best[question] = (score, text)
    return {question: text for question, (_, text) in best.items()}


@dataclass(frozen=True)
class QuestionAnswering(Task):
    def embedded_data(self) -> datasets.DatasetDict:
        return _embedded_question_answering()

    def features(self, split, tokenizer, args, max_length: int, to_id: Callable | None) -> datasets.Dataset:
        return _question_answering_features(split, tokenizer, args, max_length)

    def _predictions(self, start_logits, end_logits, args, evaluation: Evaluation) -> dict[str, str]:
        windows = evaluation.features.select_columns(["example_id", "offset_mapping", "context_mask"])
        contexts = dict(
            zip(
                _question_ids(evaluation.examples, args),
                evaluation.examples[args.task_settings.context_column],
                strict=True,
            )
        )
        return question_answering_predictions(
            windows, start_logits, end_logits, contexts, max_answer_length=args.task_settings.max_answer_length
        )

    def metrics(self, args, evaluation: Evaluation, tokenizer, label_names) -> tuple[Callable, None]:
        ids = _question_ids(evaluation.examples, args)
        references = {
            qid: list(answers["text"])
            for qid, answers in zip(ids, evaluation.examples[args.task_settings.answers_column], strict=True)
        }

        def qa_metrics(prediction: transformers.EvalPrediction) -> dict[str, float]:
            start_logits, end_logits = prediction.predictions[:2]
            return squad_scores(self._predictions(start_logits, end_logits, args, evaluation), references)

        return qa_metrics, None

    def prediction_rows(self, output, args, evaluation: Evaluation, tokenizer, label_names) -> list[dict]:
        answers = self._predictions(output.predictions[0], output.predictions[1], args, evaluation)
        ids = dict.fromkeys(_question_ids(evaluation.examples, args))  # in order, each question once
        return [{"id": qid, "prediction_text": answers.get(qid, "")} for qid in ids]


QUESTION_ANSWERING = QuestionAnswering(
    name="question-answering",
    auto_class="AutoModelForQuestionAnswering",
    peft_task_type="QUESTION_ANS",
    pipeline_tag="question-answering",
    card_task_type="question-answering",
    card_task_name="Extractive Question Answering",
    label_names=("start_positions", "end_positions"),
    shown=(("question", "question_column"), ("context", "context_column"), ("gold", "answers_column")),
    columns={
        "id_column": "id",
        "question_column": "question",
        "context_column": "context",
        "answers_column": "answers",
    },
    embedded_description="`def name(params): first docstring paragraph` of standard-library functions, with "
    "questions about the function's name, its first parameter, a parameter's default value, or which parameter "
    "has a given default; the answer is the span in the context",
    usage="from transformers import pipeline\n\n"
    'qa = pipeline("coreformer-question-answering", model=model, tokenizer=tokenizer)\n'
    'print(qa(question="What is the name of the function?", context="def quote(text): Quote a string."))',
    padding_free_refusal="takes its answer span over each window's own row (start and end positions, a softmax over "
    "the row); drop --padding-free",
)
