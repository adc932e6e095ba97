"""Fine-tuning on transformers' `Trainer`: five tasks over any coreformer folder, with an offline default dataset each.

    FinetuningArguments                every run setting (a CLI flag per field, plus run_glue / run_qa style aliases)
    resolve_arguments(...)             dataclass defaults < --config file (YAML / JSON) < flags given
    TASKS                              task name -> TaskSpec (Auto class, families, PEFT task type, card tags)
    embedded_dataset(task)             the offline default of a task, built from the Python standard library's source
    load_task_data(args)               train / validation splits: embedded default | Hub dataset | local files
    run_finetuning(args) -> dict       data, labels, model (+ LoRA), Trainer or Seq2SeqTrainer, evaluation, save
    evaluate_folder(folder, args)      reload a saved folder with its Auto class and evaluate it on the same split
    question_answering_predictions     QA features' start / end logits -> one answer text per question

The tasks, each as the transformers example script that does it (column options in parentheses):

    task                      examples script      Auto class                          families           metrics
    sequence-classification   run_glue             AutoModelForSequenceClassification  all three          accuracy, F1
    token-classification      run_ner              AutoModelForTokenClassification     encoder, decoder   seqeval
    question-answering        run_qa               AutoModelForQuestionAnswering       encoder            SQuAD EM / F1
    causal-lm                 run_clm              AutoModelForCausalLM                decoder            perplexity
    seq2seq                   run_summarization    AutoModelForSeq2SeqLM               seq2seq            ROUGE, BLEU

Metrics come from the shipped offline `evaluate` modules through `coreformer.evaluation`'s builders.

An output folder, as a run leaves it (written into a hidden sibling folder, renamed into place at the end, so a
crash never leaves a half-written `output_dir`):

    output_dir/
      config.json, model.safetensors, modeling code, tokenizer files [, generation_config.json]
      README.md                          model card (coreformer.model_card, kind "fine-tuned")
      eval_results.json, train_results.json, all_results.json, trainer_state.json, run_config.json
      eval_predictions.jsonl             one line per validation example (not for causal-lm: no predictions)
      adapter/                           --peft lora only: the LoRA adapter (the folder itself holds the merged model)

QA and seq2seq folders carry coreformer's custom pipeline (`save_with_pipeline`), so
`pipeline(model=output_dir, trust_remote_code=True)` works where transformers 5 has no QA / text2text pipeline.
"""

import ast
import builtins
import dataclasses
import io
import json
import keyword
import os
import random
import sysconfig
import tokenize
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import transformers
from transformers import AutoConfig, PreTrainedTokenizerBase

from . import run_arguments
from .configuration_coreformer import CoreformerDecoderConfig, CoreformerEncoderConfig, CoreformerSeq2SeqConfig
from .evaluation import (
    IGNORE_INDEX,
    classification_metrics,
    generation_metrics,
    language_modeling_metrics,
    squad_scores,
    token_classification_metrics,
)
from .folders import MissingTokenizerError, folder_tokenizer, staged_folder
from .model_card import ModelCardInfo, inherited_license, is_hub_id
from .pipelines import best_spans, input_length_limit, save_with_pipeline
from .pretraining_data import PackedCausalLMCollator, pack_into_blocks
from .run_arguments import arg

PEFT_CHOICES = ("none", "lora")
REPORT_TO = ("none", "tensorboard")
RUN_CONFIG = "run_config.json"
PREDICTIONS = "eval_predictions.jsonl"
ADAPTER_DIR = "adapter"
# What a run leaves in its output folder: a folder holding any of these is a previous run (--overwrite replaces it).
_RUN_MARKERS = ("config.json", RUN_CONFIG, "all_results.json", ADAPTER_DIR)

_FAMILIES = {
    CoreformerEncoderConfig.model_type: "encoder",
    CoreformerDecoderConfig.model_type: "decoder",
    CoreformerSeq2SeqConfig.model_type: "seq2seq",
}
_DATA_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class FinetuningError(ValueError):
    """One clear message about a bad input; raised before anything in the output directory is touched."""


# ---------------------------------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """What a task needs from the model and says on its card."""

    auto_class: str  # name in transformers
    families: tuple[str, ...]
    peft_task_type: str  # peft.TaskType member
    pipeline_tag: str
    card_task_type: str  # model-index task type
    card_task_name: str
    label_names: tuple[str, ...]  # Trainer label_names
    head_suffix: str | None = None  # class-name suffix of a head whose label count must match the data
    generates: bool = False  # Seq2SeqTrainer with predict_with_generate


TASKS: dict[str, TaskSpec] = {
    "sequence-classification": TaskSpec(
        "AutoModelForSequenceClassification",
        ("encoder", "decoder", "seq2seq"),
        "SEQ_CLS",
        "text-classification",
        "text-classification",
        "Text Classification",
        ("labels",),
        head_suffix="ForSequenceClassification",
    ),
    "token-classification": TaskSpec(
        "AutoModelForTokenClassification",
        ("encoder", "decoder"),
        "TOKEN_CLS",
        "token-classification",
        "token-classification",
        "Token Classification",
        ("labels",),
        head_suffix="ForTokenClassification",
    ),
    "question-answering": TaskSpec(
        "AutoModelForQuestionAnswering",
        ("encoder",),
        "QUESTION_ANS",
        "question-answering",
        "question-answering",
        "Extractive Question Answering",
        ("start_positions", "end_positions"),
    ),
    "causal-lm": TaskSpec(
        "AutoModelForCausalLM",
        ("decoder",),
        "CAUSAL_LM",
        "text-generation",
        "text-generation",
        "Causal Language Modeling",
        ("labels",),
    ),
    "seq2seq": TaskSpec(
        "AutoModelForSeq2SeqLM",
        ("seq2seq",),
        "SEQ_2_SEQ_LM",
        "summarization",
        "summarization",
        "Summarization",
        ("labels",),
        generates=True,
    ),
}


# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class FinetuningArguments:
    """Every setting of a fine-tuning run. The CLI exposes each field as `--field-name` (and `--field_name`), plus
    the `aliases` in its metadata: the names transformers' example scripts use (`--model_name_or_path`, ...)."""

    task: str = arg("sequence-classification", f"what to fine-tune for: {', '.join(TASKS)}")
    model: str = arg(
        "",
        "a coreformer folder: pretrained (training/pretrain.py), fine-tuned, or converted (coreformer convert)",
        aliases=("--model_name_or_path", "--model-name-or-path"),
    )
    tokenizer: str | None = arg(
        None, "tokenizer folder or name; default: the one in --model", aliases=("--tokenizer_name",)
    )
    # data
    dataset: str | None = arg(
        None,
        "a datasets Hub name (downloaded only then) or a local .csv/.json/.jsonl/.parquet file; omit both this and "
        "--train-file for the task's embedded offline default (built from the Python standard library)",
        aliases=("--dataset_name",),
    )
    dataset_config: str | None = arg(None, "configuration of a Hub dataset", aliases=("--dataset_config_name",))
    train_file: str | None = arg(None, "local training file (.csv/.json/.jsonl/.parquet)")
    validation_file: str | None = arg(None, "local validation file; default: --validation-fraction of the training")
    validation_fraction: float = arg(0.1, "held-out share of the training data when there is no validation split")
    max_train_examples: int | None = arg(None, "use the first N training examples", aliases=("--max_train_samples",))
    max_eval_examples: int | None = arg(None, "use the first N validation examples", aliases=("--max_eval_samples",))
    # columns
    text_column: str = arg(
        "text", "text to classify / language-model / summarise (input side)", aliases=("--text_column_name",)
    )
    text_pair_column: str | None = arg(None, "sequence-classification: optional second text (sentence pairs)")
    label_column: str | None = arg(
        None,
        "labels: sequence-classification 'label' (ClassLabel, strings or ints), token-classification 'ner_tags' "
        "(one tag per word; BIO names)",
        aliases=("--label_column_name",),
    )
    tokens_column: str = arg("tokens", "token-classification: the words of each example")
    question_column: str = arg("question", "question-answering: the question", aliases=("--question_column_name",))
    context_column: str = arg("context", "question-answering: the context", aliases=("--context_column_name",))
    answers_column: str = arg(
        "answers",
        "question-answering: SQuAD-style answers {'text': [...], 'answer_start': [...]}",
        aliases=("--answer_column_name",),
    )
    id_column: str = arg("id", "question-answering: question ids (row numbers when the column is absent)")
    summary_column: str = arg("summary", "seq2seq: the target text")
    source_prefix: str = arg("", "seq2seq: text put before every input (T5-style 'summarize: ')")
    # lengths
    max_length: int = arg(
        128,
        "input tokens per example (capped by the model): sequence length, QA window, causal-lm block, seq2seq source",
        aliases=("--max_seq_length", "--max_source_length", "--block_size"),
    )
    max_target_length: int = arg(64, "seq2seq: target tokens (also the default generation length)")
    doc_stride: int = arg(32, "question-answering: overlap between the windows of a long context")
    max_answer_length: int = arg(30, "question-answering: longest answer, in tokens")
    generation_max_length: int | None = arg(None, "seq2seq: max new tokens at evaluation; default --max-target-length")
    num_beams: int = arg(1, "seq2seq: beams at evaluation")
    # optimisation
    num_train_epochs: float = arg(3.0, "epochs (ignored when --max-steps is set)")
    max_steps: int | None = arg(None, "optimizer steps; overrides --num-train-epochs")
    batch_size: int = arg(16, "training examples per device and step", aliases=("--per_device_train_batch_size",))
    eval_batch_size: int = arg(32, "evaluation examples per device", aliases=("--per_device_eval_batch_size",))
    grad_accum: int = arg(1, "micro-batches per optimizer step", aliases=("--gradient_accumulation_steps",))
    lr: float = arg(5e-5, "peak learning rate (AdamW)", aliases=("--learning_rate", "--learning-rate"))
    weight_decay: float = arg(0.0, "AdamW weight decay")
    warmup_steps: int = arg(0, "linear warmup steps")
    lr_scheduler_type: str = arg("linear", "transformers scheduler name (linear, cosine, constant, ...)")
    bf16: bool = arg(False, "bfloat16 mixed precision")
    seed: int = arg(42, "seed of the head's initialisation, the data order and dropout")
    logging_steps: int = arg(10, "log the training loss every N steps")
    eval_steps: int = arg(0, "also evaluate every N steps (0: only at the end)")
    # model
    ignore_mismatched_sizes: bool = arg(
        False, "re-initialise a classification head whose label count differs from the data's"
    )
    peft: str = arg("none", "parameter-efficient fine-tuning: none or lora", choices=PEFT_CHOICES)
    lora_r: int = arg(8, "LoRA rank")
    lora_alpha: int = arg(16, "LoRA alpha (scale alpha / r)")
    lora_dropout: float = arg(0.05, "dropout on the LoRA branch")
    lora_target_modules: str = arg("q_proj,v_proj", "comma-separated module names that get adapters")
    # run
    output_dir: str = arg("outputs/finetune", "run folder: the fine-tuned model, its card, metrics, predictions")
    overwrite: bool = arg(
        False, "replace an output directory that holds another run", aliases=("--overwrite_output_dir",)
    )
    report_to: str = arg("none", "tracker: none or tensorboard (logs under output_dir/runs)", choices=REPORT_TO)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise FinetuningError(f"Unknown task {self.task!r}: --task must be one of {', '.join(TASKS)}.")
        for name, allowed in (("peft", PEFT_CHOICES), ("report_to", REPORT_TO)):
            if getattr(self, name) not in allowed:
                raise FinetuningError(f"`{name}` must be one of {', '.join(allowed)}; got {getattr(self, name)!r}.")
        if not self.model:
            raise FinetuningError("Pass --model: a coreformer folder (pretrained, fine-tuned or converted).")
        positive = ("max_length", "max_target_length", "max_answer_length", "num_beams", "batch_size")
        positive += ("eval_batch_size", "grad_accum", "logging_steps", "lora_r", "lora_alpha")
        for name in positive:
            if getattr(self, name) < 1:
                raise FinetuningError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        for name in ("max_steps", "max_train_examples", "max_eval_examples", "generation_max_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise FinetuningError(f"`{name}` must be >= 1 (or unset), got {getattr(self, name)}.")
        for name in ("doc_stride", "warmup_steps", "eval_steps"):
            if getattr(self, name) < 0:
                raise FinetuningError(f"`{name}` must be >= 0, got {getattr(self, name)}.")
        if self.max_steps is None and self.num_train_epochs <= 0:
            raise FinetuningError(f"`num_train_epochs` must be > 0, got {self.num_train_epochs}.")
        if self.lr <= 0:
            raise FinetuningError(f"`lr` must be > 0, got {self.lr}.")
        if not 0.0 < self.validation_fraction < 1.0:
            raise FinetuningError(f"`validation_fraction` must be in (0, 1), got {self.validation_fraction}.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise FinetuningError(f"`lora_dropout` must be in [0, 1), got {self.lora_dropout}.")
        if not self.target_modules:
            raise FinetuningError("`lora_target_modules` names no module; the default is q_proj,v_proj.")
        if self.dataset is not None and self.train_file is not None:
            raise FinetuningError("Pass either --dataset (Hub name or file) or --train-file, not both.")
        if self.validation_file is not None and self.train_file is None:
            raise FinetuningError("--validation-file needs --train-file.")
        if self.label_column is None:
            self.label_column = "ner_tags" if self.task == "token-classification" else "label"

    @property
    def target_modules(self) -> list[str]:
        return [name.strip() for name in self.lora_target_modules.split(",") if name.strip()]

    @property
    def spec(self) -> TaskSpec:
        return TASKS[self.task]


def argument_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(FinetuningArguments))


def resolve_arguments(
    *, config_file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> FinetuningArguments:
    """Dataclass defaults, then a YAML / JSON `--config` file of FinetuningArguments keys, then `overrides`."""
    values: dict[str, Any] = {}
    if config_file is not None:
        values = run_arguments.load_config_file(config_file, error=FinetuningError)
    values.update(overrides or {})
    hints = typing.get_type_hints(FinetuningArguments)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise FinetuningError(f"Unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(hints))}.")
    typed = {
        name: run_arguments.coerce(name, value, hints[name], error=FinetuningError) for name, value in values.items()
    }
    return FinetuningArguments(**typed)


# ---------------------------------------------------------------------------------------------------------------------
# Embedded offline datasets: real text with labels derived from it, from the Python standard library
# ---------------------------------------------------------------------------------------------------------------------

# Packages read for every embedded dataset: in every CPython 3 since 3.4, about 1.3 MB of source, parsed in ~0.4 s.
EMBEDDED_PACKAGES = ("asyncio", "email", "logging", "xml")
_EMBEDDED_SEED = 0  # fixed: the embedded datasets are the same whatever the run's --seed
_EMBEDDED_VALIDATION = 0.2

EMBEDDED_DESCRIPTIONS = {
    "sequence-classification": "first paragraphs of docstrings in the standard library's asyncio, email, logging "
    "and xml packages, labelled with the package they come from (100 per package)",
    "token-classification": "single lines of standard-library source split into Python tokens (string literals "
    "into their words), tagged by the `tokenize` module: B-KW keywords, B-BUILTIN builtin names, B-NUM numbers, "
    "B-STR/I-STR string literals, O everything else",
    "question-answering": "`def name(params): first docstring paragraph` of standard-library functions, with "
    "questions about the function's name, its first parameter, a parameter's default value, or which parameter "
    "has a given default; the answer is the span in the context",
    "causal-lm": "the source of standard-library functions (at most 1,500 characters each)",
    "seq2seq": "standard-library function source without its docstring -> the docstring's first line (code "
    "summarisation)",
}


@dataclass(frozen=True)
class _Definition:
    package: str
    path: str  # relative to the standard library root
    lineno: int
    name: str
    kind: str  # "function" | "class"
    doc: str
    params: tuple[tuple[str, str | None], ...]  # (name, default source) of ordinary parameters, self/cls dropped
    source: str  # dedented, docstring included
    source_without_doc: str


def _package_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(package, path) for package in EMBEDDED_PACKAGES for path in sorted((root / package).rglob("*.py"))]


def _strip_lines(lines: list[str], start: int, stop: int) -> str:
    import textwrap

    return textwrap.dedent("".join(lines[:start] + lines[stop:])).rstrip() + "\n"


@lru_cache(maxsize=1)
def _stdlib_definitions() -> tuple[_Definition, ...]:
    """Every function and class with a docstring in EMBEDDED_PACKAGES, in file and line order."""
    import textwrap

    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for package, path in _package_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            doc = ast.get_docstring(node)
            if not doc or not doc.strip():
                continue
            params: list[tuple[str, str | None]] = []
            if not isinstance(node, ast.ClassDef):
                positional = node.args.posonlyargs + node.args.args
                defaults = [None] * (len(positional) - len(node.args.defaults)) + list(node.args.defaults)
                for argument, default in zip(positional, defaults, strict=True):
                    if argument.arg not in ("self", "cls"):
                        params.append((argument.arg, None if default is None else ast.unparse(default)))
            first, last = node.lineno - 1, node.end_lineno  # the def / class line (after decorators) .. end
            body = lines[first:last]
            doc_node = node.body[0]
            found.append(
                _Definition(
                    package=package,
                    path=path.relative_to(root).as_posix(),
                    lineno=node.lineno,
                    name=node.name,
                    kind="class" if isinstance(node, ast.ClassDef) else "function",
                    doc=doc,
                    params=tuple(params),
                    source=textwrap.dedent("".join(body)).rstrip() + "\n",
                    source_without_doc=_strip_lines(body, doc_node.lineno - 1 - first, doc_node.end_lineno - first),
                )
            )
    found.sort(key=lambda d: (d.path, d.lineno))
    return tuple(found)


def _first_paragraph(doc: str, limit: int = 300) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())[:limit]


def _sample(items: list, count: int) -> list:
    items = list(items)
    random.Random(_EMBEDDED_SEED).shuffle(items)
    return items[:count]


def _split(rows: list[dict]) -> datasets.DatasetDict:
    """Rows (already in a seeded order) -> train / validation, the last 20% held out."""
    held_out = max(1, round(len(rows) * _EMBEDDED_VALIDATION))
    columns = list(rows[0])
    return datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({column: [row[column] for row in part] for column in columns})
            for name, part in (("train", rows[:-held_out]), ("validation", rows[-held_out:]))
        }
    )


def _embedded_sequence_classification() -> datasets.DatasetDict:
    by_package: dict[str, list[str]] = {package: [] for package in EMBEDDED_PACKAGES}
    seen = set()
    for definition in _stdlib_definitions():
        text = _first_paragraph(definition.doc)
        if len(text.split()) >= 4 and text not in seen:
            seen.add(text)
            by_package[definition.package].append(text)
    rows = [{"text": text, "label": package} for package, texts in by_package.items() for text in _sample(texts, 100)]
    return _split(_sample(rows, len(rows)))


_BUILTIN_NAMES = frozenset(name for name in dir(builtins) if not name.startswith("_"))
_TOKEN_TYPES = {tokenize.NAME, tokenize.OP, tokenize.NUMBER, tokenize.STRING}
_SKIPPED_TOKEN_TYPES = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
_SKIPPED_TOKEN_TYPES.add(tokenize.COMMENT)


def python_token_tags(line: str) -> tuple[list[str], list[str]] | None:
    """One line of Python -> (words, BIO tags) from `tokenize`, or None for a line this tagging does not cover
    (continued or multi-line tokens, f-strings on Python >= 3.12, tokenizer errors).

    Keywords are B-KW, builtin names B-BUILTIN, numbers B-NUM; a string literal is split on whitespace into
    B-STR I-STR ...; other names and operators are O.
    """
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None
    words, tags = [], []
    for token in tokens:
        if token.type in _SKIPPED_TOKEN_TYPES:
            continue
        if token.type not in _TOKEN_TYPES or token.start[0] != token.end[0]:
            return None
        if token.type == tokenize.STRING:
            parts = token.string.split()
            words += parts
            tags += ["B-STR"] + ["I-STR"] * (len(parts) - 1)
            continue
        words.append(token.string)
        if token.type == tokenize.NUMBER:
            tags.append("B-NUM")
        elif token.type == tokenize.NAME and keyword.iskeyword(token.string):
            tags.append("B-KW")
        elif token.type == tokenize.NAME and token.string in _BUILTIN_NAMES:
            tags.append("B-BUILTIN")
        else:
            tags.append("O")
    return words, tags


def _embedded_token_classification() -> datasets.DatasetDict:
    candidates, seen = [], set()
    for definition in _stdlib_definitions():
        if definition.kind != "function":
            continue
        for line in definition.source_without_doc.splitlines()[1:]:  # the body, not the def line
            line = line.strip()
            if not line or line in seen or line.endswith(("\\", ",", "(", "[", "{")):
                continue
            seen.add(line)
            tagged = python_token_tags(line)
            if tagged and 3 <= len(tagged[0]) <= 24 and any(tag != "O" for tag in tagged[1]):
                candidates.append({"tokens": tagged[0], "ner_tags": tagged[1]})
    return _split(_sample(candidates, 500))


def _qa_example(definition: _Definition, turn: int) -> dict | None:
    """Context `def name(a, b=1): doc` and one question about it, the answer located while the context is built."""
    doc = _first_paragraph(definition.doc)
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
    functions = [d for d in _stdlib_definitions() if d.kind == "function" and d.params]
    rows = [row for turn, d in enumerate(_sample(functions, 400)) if (row := _qa_example(d, turn)) is not None]
    return _split(rows)


def _embedded_causal_lm() -> datasets.DatasetDict:
    functions = [d for d in _stdlib_definitions() if d.kind == "function" and len(d.source) <= 1500]
    return _split([{"text": d.source} for d in _sample(functions, 300)])


def _embedded_seq2seq() -> datasets.DatasetDict:
    rows = []
    for definition in _stdlib_definitions():
        summary = definition.doc.strip().splitlines()[0].strip()
        code = definition.source_without_doc
        if definition.kind == "function" and 3 <= len(summary.split()) <= 20 and len(code) <= 800:
            if code.count("\n") >= 2:  # a body beyond `pass`
                rows.append({"text": code, "summary": summary})
    return _split(_sample(rows, 400))


_EMBEDDED = {
    "sequence-classification": _embedded_sequence_classification,
    "token-classification": _embedded_token_classification,
    "question-answering": _embedded_question_answering,
    "causal-lm": _embedded_causal_lm,
    "seq2seq": _embedded_seq2seq,
}


def embedded_dataset(task: str) -> datasets.DatasetDict:
    """The task's offline default (see EMBEDDED_DESCRIPTIONS), train / validation, with the default column names:
    text + label, tokens + ner_tags, id + question + context + answers, text, text + summary.

    Built from the running interpreter's standard library, the same on every run of one installation (not across
    Python versions). A few hundred examples, built in about half a second.
    """
    if task not in _EMBEDDED:
        raise FinetuningError(f"Unknown task {task!r}: --task must be one of {', '.join(TASKS)}.")
    return _EMBEDDED[task]()


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------

# field name -> (flag, what it holds), for the missing-column message
_COLUMN_OPTIONS = {
    "text_column": ("--text-column", "the input text"),
    "text_pair_column": ("--text-pair-column", "the second text"),
    "label_column": ("--label-column", "the labels"),
    "tokens_column": ("--tokens-column", "the words"),
    "question_column": ("--question-column", "the questions"),
    "context_column": ("--context-column", "the contexts"),
    "answers_column": ("--answers-column", "the SQuAD-style answers"),
    "summary_column": ("--summary-column", "the target texts"),
}
_TASK_COLUMNS = {
    "sequence-classification": ("text_column", "text_pair_column", "label_column"),
    "token-classification": ("tokens_column", "label_column"),
    "question-answering": ("question_column", "context_column", "answers_column"),
    "causal-lm": ("text_column",),
    "seq2seq": ("text_column", "summary_column"),
}
_EMBEDDED_COLUMNS = {  # the embedded datasets' column -> the argument that names it in a run
    "text": "text_column",
    "label": "label_column",
    "tokens": "tokens_column",
    "ner_tags": "label_column",
    "question": "question_column",
    "context": "context_column",
    "answers": "answers_column",
    "id": "id_column",
    "summary": "summary_column",
}


def _builder(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in _DATA_BUILDERS:
        raise FinetuningError(
            f"Cannot read {path!r}: unknown extension {suffix or '(none)'!r}; expected {', '.join(_DATA_BUILDERS)}."
        )
    if not Path(path).is_file():
        raise FinetuningError(f"Data file {path!r} does not exist.")
    return _DATA_BUILDERS[suffix]


def _is_local(source: str) -> bool:
    """Whether load_task_data reads `--dataset` as a local file rather than a Hub dataset. Not the complement of
    model_card.is_hub_id: a Hub-shaped name with a data file's suffix (`train.csv`) is a file here, so a missing one
    gets the missing-file error rather than the Hub's."""
    return (
        Path(source).expanduser().exists()
        or source.startswith((".", "/", "~"))
        or Path(source).suffix in (_DATA_BUILDERS)
    )


def load_task_data(args: FinetuningArguments) -> tuple[datasets.DatasetDict, str]:
    """(train / validation splits with the columns the task needs, a description of the data for the card).

    No source given: the embedded default, its columns renamed to what the arguments name. Otherwise a Hub dataset
    or local files; a missing validation split is `validation_fraction` of the training split (seeded).
    """
    if args.dataset is None and args.train_file is None:
        splits = embedded_dataset(args.task)
        splits = splits.rename_columns(
            {c: getattr(args, _EMBEDDED_COLUMNS[c]) for c in splits["train"].column_names if c in _EMBEDDED_COLUMNS}
        )
        description = f"coreformer's embedded {args.task} default: {EMBEDDED_DESCRIPTIONS[args.task]}"
    else:
        try:
            if args.train_file is not None or _is_local(args.dataset):
                files = {"train": args.train_file or args.dataset}
                if args.validation_file is not None:
                    files["validation"] = args.validation_file
                builders = {_builder(path) for path in files.values()}
                if len(builders) > 1:
                    raise FinetuningError("--train-file and --validation-file must be the same kind of file.")
                loaded = datasets.load_dataset(builders.pop(), data_files=files)
                description = ", ".join(f"{split} `{Path(path).name}`" for split, path in files.items())
            else:
                loaded = datasets.load_dataset(args.dataset, args.dataset_config)
                description = f"`{args.dataset}`" + (f" ({args.dataset_config})" if args.dataset_config else "")
        except FinetuningError:
            raise
        except Exception as error:  # DatasetNotFoundError, ConnectionError offline, parse errors of a file, ...
            raise FinetuningError(
                f"Cannot load the data ({args.dataset or args.train_file!r}): {type(error).__name__}: {error}. Pass a "
                f"datasets Hub name, a local .csv/.json/.jsonl/.parquet file, or neither for the embedded default."
            ) from error
        if "train" not in loaded:
            raise FinetuningError(f"The data has no 'train' split; it has {sorted(loaded)}.")
        if "validation" not in loaded:
            held_out = loaded["train"].train_test_split(test_size=args.validation_fraction, seed=args.seed)
            loaded = datasets.DatasetDict({"train": held_out["train"], "validation": held_out["test"]})
        splits = datasets.DatasetDict({"train": loaded["train"], "validation": loaded["validation"]})
    check_columns(splits, args)
    if args.max_train_examples is not None:
        splits["train"] = splits["train"].select(range(min(args.max_train_examples, len(splits["train"]))))
    if args.max_eval_examples is not None:
        splits["validation"] = splits["validation"].select(
            range(min(args.max_eval_examples, len(splits["validation"])))
        )
    for name, split in splits.items():
        if len(split) == 0:
            raise FinetuningError(f"The {name} split is empty.")
    return splits, description


def check_columns(splits: datasets.DatasetDict, args: FinetuningArguments) -> None:
    """Every column the task reads is in both splits, or one error naming it, the columns there are, and the flag."""
    for argument in _TASK_COLUMNS[args.task]:
        column = getattr(args, argument)
        if column is None:  # an optional column left unset
            continue
        for name, split in splits.items():
            if column not in split.column_names:
                flag, what = _COLUMN_OPTIONS[argument]
                raise FinetuningError(
                    f"The {name} data has no column {column!r} ({what} for {args.task}); its columns are "
                    f"{split.column_names}. Pass {flag} with the column that holds {what}."
                )


def read_label_names(splits: datasets.DatasetDict, column: str, *, per_token: bool) -> tuple[list[str], Callable]:
    """(label names, raw value -> name). ClassLabel names as they are; otherwise the sorted distinct values of both
    splits (strings, or integers shown as strings). `per_token`: the column holds one label per word."""
    feature = splits["train"].features[column]
    if per_token:
        feature = getattr(feature, "feature", None)
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names), lambda value: feature.names[value]
    values = set()
    for split in splits.values():
        for value in split[column]:
            values.update(value if per_token else [value])
    if None in values:
        raise FinetuningError(f"Column {column!r} has empty labels; every example needs one.")
    if any(isinstance(value, float) and not value.is_integer() for value in values):
        raise FinetuningError(
            f"Column {column!r} holds non-integer numbers: regression is not supported; labels must be classes."
        )
    if all(isinstance(value, int | float) for value in values):
        names = [str(int(value)) for value in sorted(values)]
        return names, lambda value: str(int(value))
    return sorted(str(value) for value in values), str


# ---------------------------------------------------------------------------------------------------------------------
# Preprocessing: one function per task, examples -> model features
# ---------------------------------------------------------------------------------------------------------------------


def _classification_features(split, tokenizer, args, max_length: int, label_of: Callable) -> datasets.Dataset:
    def encode(batch: dict[str, list]) -> dict[str, list]:
        pairs = batch[args.text_pair_column] if args.text_pair_column else None
        encoded = tokenizer(batch[args.text_column], pairs, truncation=True, max_length=max_length)
        encoded["labels"] = [label_of(value) for value in batch[args.label_column]]
        return encoded

    return split.map(encode, batched=True, remove_columns=split.column_names)


def _token_classification_features(split, tokenizer, args, max_length: int, label_of: Callable) -> datasets.Dataset:
    """run_ner's alignment: the first sub-word of a word carries its tag, the rest and special tokens -100."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        for words, tags in zip(batch[args.tokens_column], batch[args.label_column], strict=True):
            if len(words) != len(tags):
                raise FinetuningError(
                    f"An example has {len(words)} words in {args.tokens_column!r} but {len(tags)} tags in "
                    f"{args.label_column!r}: {words[:8]}..."
                )
        encoded = tokenizer(batch[args.tokens_column], is_split_into_words=True, truncation=True, max_length=max_length)
        encoded["labels"] = []
        for row, tags in enumerate(batch[args.label_column]):
            labels, previous = [], None
            for word in encoded.word_ids(row):
                labels.append(IGNORE_INDEX if word is None or word == previous else label_of(tags[word]))
                previous = word
            encoded["labels"].append(labels)
        return encoded

    return split.map(encode, batched=True, remove_columns=split.column_names)


def _question_ids(split, args) -> list[str]:
    if args.id_column in split.column_names:
        return [str(value) for value in split[args.id_column]]
    return [str(index) for index in range(len(split))]


def _question_answering_features(split, tokenizer, args, max_length: int) -> datasets.Dataset:
    """run_qa's windows: question + a window of the context per feature (stride `doc_stride`), start / end token
    of the first answer (0, the first token, when the window does not hold it), and for evaluation the character
    offsets, which tokens are context, and the question id."""
    if not tokenizer.is_fast:
        raise FinetuningError("Question answering maps tokens back to characters: it needs a fast tokenizer.")
    tokenizer.padding_side = "right"  # logits line up with offsets only when padding comes after the tokens
    ids = _question_ids(split, args)
    split = split.add_column("_qid", ids)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        questions = [question.lstrip() for question in batch[args.question_column]]
        try:
            encoded = tokenizer(
                questions,
                batch[args.context_column],
                truncation="only_second",
                max_length=max_length,
                stride=args.doc_stride,
                return_overflowing_tokens=True,
                return_offsets_mapping=True,
            )
        except Exception as error:  # tokenizers: stride too large for what the question leaves of the window
            raise FinetuningError(
                f"Cannot cut the contexts into windows of {max_length} tokens with --doc-stride {args.doc_stride}: "
                f"{error}. Lower --doc-stride or raise --max-length."
            ) from error
        sample = encoded.pop("overflow_to_sample_mapping")
        encoded.update(start_positions=[], end_positions=[], example_id=[], context_mask=[])
        for index, offsets in enumerate(encoded["offset_mapping"]):
            sequence_ids = encoded.sequence_ids(index)
            context_mask = [int(s == 1) for s in sequence_ids]
            answers = batch[args.answers_column][sample[index]]
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


def _causal_lm_features(split, tokenizer, args, max_length: int) -> datasets.Dataset:
    """run_clm's grouping: the texts tokenized without special tokens, joined by eos, cut into full blocks."""
    if tokenizer.eos_token_id is None:
        raise FinetuningError("causal-lm joins documents with the eos token; the tokenizer has none.")
    tokenized = split.map(
        lambda batch: {"input_ids": tokenizer(batch[args.text_column], add_special_tokens=False)["input_ids"]},
        batched=True,
        remove_columns=split.column_names,
    )
    return pack_into_blocks(tokenized, max_length, eos_token_id=tokenizer.eos_token_id, batch_size=100_000)


def _seq2seq_features(split, tokenizer, args, max_length: int) -> datasets.Dataset:
    def encode(batch: dict[str, list]) -> dict[str, list]:
        sources = [args.source_prefix + text for text in batch[args.text_column]]
        encoded = tokenizer(sources, truncation=True, max_length=max_length)
        targets = tokenizer(text_target=batch[args.summary_column], truncation=True, max_length=args.max_target_length)
        encoded["labels"] = targets["input_ids"]
        return encoded

    return split.map(encode, batched=True, remove_columns=split.column_names)


# ---------------------------------------------------------------------------------------------------------------------
# Model, tokenizer, labels
# ---------------------------------------------------------------------------------------------------------------------


def load_model_config(path: str, task: str):
    """The config of a coreformer folder, checked to be a family that has the task's head."""
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:
        raise FinetuningError(
            f"Cannot load --model {path!r}: {type(error).__name__}: {error}. Pass a coreformer folder (from "
            f"training/pretrain.py, a fine-tuning run, or `coreformer convert`)."
        ) from error
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise FinetuningError(
            f"--model {path!r} is a {config.model_type!r} checkpoint, not a coreformer one; convert it first with "
            f"`coreformer convert {path} OUT`."
        )
    spec = TASKS[task]
    if family not in spec.families:
        raise FinetuningError(
            f"--task {task} needs a {' or '.join(spec.families)} model; {path!r} is a coreformer {family}."
        )
    return config, family


def load_finetuning_tokenizer(args: FinetuningArguments, model_path: str) -> PreTrainedTokenizerBase:
    source = args.tokenizer or model_path
    try:
        tokenizer = folder_tokenizer(source)
    except MissingTokenizerError as error:
        raise FinetuningError(f"{error} (--tokenizer FOLDER names another tokenizer.)") from None
    except Exception as error:
        raise FinetuningError(
            f"Cannot load a tokenizer from {source!r}: {type(error).__name__}: {error}. Pass --tokenizer FOLDER."
        ) from error
    if tokenizer.pad_token is None and args.task != "causal-lm":
        if tokenizer.eos_token is None:
            raise FinetuningError(f"The tokenizer of {source!r} has no pad or eos token to pad batches with.")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_labels(args: FinetuningArguments, config, names: list[str]) -> list[str]:
    """The label order the fine-tuned head uses; refuses a checkpoint head of another size.

    A checkpoint that already has this task's head with the same label names keeps its order (so a second
    fine-tuning does not shuffle the ids); otherwise the data's order.
    """
    has_head = any(name.endswith(args.spec.head_suffix) for name in config.architectures or [])
    if not has_head:
        return names
    existing = [config.id2label[index] for index in sorted(config.id2label)]
    if len(existing) != len(names):
        if args.ignore_mismatched_sizes:
            return names
        raise FinetuningError(
            f"--model {args.model!r} has a {config.architectures[0]} head for {len(existing)} labels ({existing}), but "
            f"the data has {len(names)} labels ({names}). Pass --ignore-mismatched-sizes to re-initialise the head "
            f"for {len(names)} labels, or fine-tune from the checkpoint without this head."
        )
    return existing if sorted(existing) == sorted(names) else names


def _attach_lora(model, args: FinetuningArguments):
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=getattr(TaskType, args.spec.peft_task_type),
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_modules,
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # target modules that do not exist
        raise FinetuningError(f"--lora-target-modules {args.lora_target_modules!r}: {error}") from error


# ---------------------------------------------------------------------------------------------------------------------
# Trainer wiring
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Prepared:
    """A task's data in model form, with the collator and metrics that go with it."""

    train: datasets.Dataset | None
    eval: datasets.Dataset
    eval_examples: datasets.Dataset
    collator: Any
    compute_metrics: Callable
    preprocess_logits_for_metrics: Callable | None = None
    label_names: list[str] | None = None
    contexts: dict[str, str] = field(default_factory=dict)


def prepare_task(
    args: FinetuningArguments,
    splits: datasets.DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    model,
    label_names: list[str] | None,
    label_of: Callable | None,
    *,
    with_train: bool = True,
) -> _Prepared:
    """Features of both splits, the collator, and compute_metrics from coreformer.evaluation for `args.task`."""
    max_length = min(args.max_length, input_length_limit(model, tokenizer))
    if model.config.position_embedding_type in ("learned", "sinusoidal"):
        max_length = min(max_length, model.config.max_position_embeddings - model.config.position_offset)
    task, label2id = args.task, {name: index for index, name in enumerate(label_names or [])}

    def to_id(value) -> int:
        name = label_of(value)
        if name not in label2id:
            raise FinetuningError(f"Label {name!r} is not one of the model's labels {label_names}.")
        return label2id[name]

    def build(split: datasets.Dataset) -> datasets.Dataset:
        if task == "sequence-classification":
            return _classification_features(split, tokenizer, args, max_length, to_id)
        if task == "token-classification":
            return _token_classification_features(split, tokenizer, args, max_length, to_id)
        if task == "question-answering":
            return _question_answering_features(split, tokenizer, args, max_length)
        if task == "causal-lm":
            return _causal_lm_features(split, tokenizer, args, max_length)
        return _seq2seq_features(split, tokenizer, args, max_length)

    if task in ("token-classification", "sequence-classification"):
        tokenizer.padding_side = "right"
    train = build(splits["train"]) if with_train else None
    evaluation = build(splits["validation"])
    for name, features in (("training", train), ("validation", evaluation)):
        if features is not None and len(features) == 0:
            raise FinetuningError(
                f"The {name} split gives no {task} example of --max-length {max_length} tokens; use more text or a "
                f"smaller --max-length."
            )
    prepared = _Prepared(train, evaluation, splits["validation"], None, None, label_names=label_names)
    if task == "sequence-classification":
        prepared.collator = transformers.DataCollatorWithPadding(tokenizer)
        prepared.compute_metrics = classification_metrics(average="macro")
    elif task == "token-classification":
        prepared.collator = transformers.DataCollatorForTokenClassification(tokenizer)
        prepared.compute_metrics = token_classification_metrics(dict(enumerate(label_names)))
    elif task == "question-answering":
        ids = _question_ids(splits["validation"], args)
        prepared.contexts = dict(zip(ids, splits["validation"][args.context_column], strict=True))
        references = {
            qid: list(answers["text"])
            for qid, answers in zip(ids, splits["validation"][args.answers_column], strict=True)
        }
        prepared.collator = transformers.DataCollatorWithPadding(tokenizer)
        windows = evaluation.select_columns(["example_id", "offset_mapping", "context_mask"])

        def qa_metrics(prediction: transformers.EvalPrediction) -> dict[str, float]:
            start_logits, end_logits = prediction.predictions[:2]
            answers = question_answering_predictions(
                windows, start_logits, end_logits, prepared.contexts, max_answer_length=args.max_answer_length
            )
            return squad_scores(answers, references)

        prepared.compute_metrics = qa_metrics
    elif task == "causal-lm":
        prepared.collator = PackedCausalLMCollator(eos_token_id=tokenizer.eos_token_id)
        prepared.compute_metrics, prepared.preprocess_logits_for_metrics = language_modeling_metrics(causal=True)
    else:
        prepared.collator = transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)
        prepared.compute_metrics = generation_metrics(tokenizer)
    return prepared


def _training_arguments(args: FinetuningArguments, output_dir: Path):
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type=args.lr_scheduler_type,
        num_train_epochs=args.num_train_epochs,
        max_steps=args.max_steps if args.max_steps is not None else -1,
        bf16=args.bf16,
        seed=args.seed,
        logging_steps=args.logging_steps,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        save_strategy="no",  # the final folder is written by this module, atomically
        report_to=args.report_to,
        label_names=list(args.spec.label_names),
        dataloader_num_workers=0,
        dataloader_pin_memory=_has_accelerator(),
        disable_tqdm=False,
    )
    if args.spec.generates:
        return transformers.Seq2SeqTrainingArguments(
            **settings,
            predict_with_generate=True,
            generation_max_length=args.generation_max_length or args.max_target_length,
            generation_num_beams=args.num_beams,
        )
    return transformers.TrainingArguments(**settings)


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def build_trainer(args: FinetuningArguments, model, tokenizer, prepared: _Prepared, output_dir: Path):
    """Trainer (Seq2SeqTrainer for seq2seq) over the prepared data; nothing is written until the caller saves."""
    trainer_class = transformers.Seq2SeqTrainer if args.spec.generates else transformers.Trainer
    return trainer_class(
        model=model,
        args=_training_arguments(args, output_dir),
        train_dataset=prepared.train,
        eval_dataset=prepared.eval,
        processing_class=tokenizer,
        data_collator=prepared.collator,
        compute_metrics=prepared.compute_metrics,
        preprocess_logits_for_metrics=prepared.preprocess_logits_for_metrics,
    )


def _prediction_rows(args: FinetuningArguments, prepared: _Prepared, output, tokenizer) -> list[dict]:
    """One JSON-able row per validation example from `Trainer.predict`'s output (causal-lm: none)."""
    task = args.task
    predictions = output.predictions
    if task == "sequence-classification":
        logits = predictions[0] if isinstance(predictions, tuple) else predictions
        return [{"prediction": prepared.label_names[int(i)]} for i in logits.argmax(-1)]
    if task == "token-classification":
        logits = predictions[0] if isinstance(predictions, tuple) else predictions
        rows = []
        for row_predictions, row_labels in zip(logits.argmax(-1), output.label_ids, strict=True):
            keep = row_labels != IGNORE_INDEX  # first sub-word of each word
            rows.append({"prediction": [prepared.label_names[int(i)] for i in row_predictions[keep]]})
        return rows
    if task == "question-answering":
        windows = prepared.eval.select_columns(["example_id", "offset_mapping", "context_mask"])
        answers = question_answering_predictions(
            windows, predictions[0], predictions[1], prepared.contexts, max_answer_length=args.max_answer_length
        )
        return [{"id": qid, "prediction_text": answers.get(qid, "")} for qid in prepared.contexts]
    if task == "seq2seq":
        generated = predictions[0] if isinstance(predictions, tuple) else predictions
        generated = np.where(generated == IGNORE_INDEX, tokenizer.pad_token_id, generated)
        return [{"prediction": text.strip()} for text in tokenizer.batch_decode(generated, skip_special_tokens=True)]
    return []


def _predict(trainer, args: FinetuningArguments, prepared: _Prepared, tokenizer) -> tuple[dict[str, float], list]:
    output = trainer.predict(prepared.eval, metric_key_prefix="eval")
    metrics = {key: float(value) for key, value in output.metrics.items()}
    if args.task == "causal-lm" and "eval_loss" in metrics:
        metrics.setdefault("eval_perplexity", float(np.exp(min(metrics["eval_loss"], 700))))
    metrics["eval_samples"] = len(prepared.eval_examples)
    return metrics, _prediction_rows(args, prepared, output, tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# Output folder
# ---------------------------------------------------------------------------------------------------------------------


def check_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse an existing non-empty folder unless it is a run and `overwrite` is set."""
    run_arguments.check_output_dir(
        output_dir, overwrite, markers=_RUN_MARKERS, error=FinetuningError, otherwise="choose another folder"
    )


_USAGE = {
    "sequence-classification": 'inputs = tokenizer("Return the header value.", return_tensors="pt")\n'
    "print(model.config.id2label[model(**inputs).logits.argmax(-1).item()])",
    "token-classification": 'inputs = tokenizer(["return", "len", "(", "x", ")"], is_split_into_words=True, '
    'return_tensors="pt")\nprint([model.config.id2label[i] for i in model(**inputs).logits.argmax(-1)[0].tolist()])',
    "question-answering": "from transformers import pipeline\n\n"
    'qa = pipeline("coreformer-question-answering", model=model, tokenizer=tokenizer)\n'
    'print(qa(question="What is the name of the function?", context="def quote(text): Quote a string."))',
    "causal-lm": 'inputs = tokenizer("def ", return_tensors="pt")\n'
    "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0]))",
    "seq2seq": 'inputs = tokenizer("def close(self):\\n    self.stream.close()", return_tensors="pt")\n'
    "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0], skip_special_tokens=True))",
}


def _card_info(args: FinetuningArguments, family: str, num_parameters: int, metrics: dict, data: str, adapter: bool):
    hub_dataset = args.dataset if args.dataset and is_hub_id(args.dataset) else None
    # A fine-tuned model is a derivative of its base: it carries the base's license, "other" when none is recorded.
    base_license = inherited_license(args.model) if Path(args.model).is_dir() else None
    limitations = "A small model fine-tuned briefly; the evaluation numbers above are its only measurement."
    if base_license is None:
        limitations += (
            f" The base model's license is not recorded here (`license: other`): the terms of {args.model} apply."
        )
    eval_results = {
        key.removeprefix("eval_"): value
        for key, value in metrics.items()
        if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second", "_time", "_samples"))
    }
    hyperparameters = [
        ("task", args.task),
        ("base model", args.model),
        ("steps", int(metrics.get("train_steps", 0))),
        ("epochs", round(float(metrics.get("epoch", 0.0)), 3)),
        ("batch size x accumulation", f"{args.batch_size} x {args.grad_accum}"),
        ("learning rate", f"{args.lr:g}, {args.lr_scheduler_type} schedule, {args.warmup_steps} warmup steps"),
        ("weight decay", args.weight_decay),
        ("max length", args.max_length),
        ("bf16", args.bf16),
        ("seed", args.seed),
    ]
    if args.peft == "lora":
        hyperparameters.append(
            (
                "LoRA",
                f"r {args.lora_r}, alpha {args.lora_alpha}, dropout {args.lora_dropout}, on {args.lora_target_modules}",
            )
        )
    what = "A LoRA adapter" if adapter else "A coreformer " + family + " model"
    summary = f"{what} fine-tuned for {args.task} with coreformer's `training/finetune.py` (transformers Trainer)"
    if args.peft == "lora" and not adapter:
        summary += "; LoRA adapters merged into the weights (the adapter alone is in `adapter/`)"
    return ModelCardInfo(
        kind="fine-tuned",
        title=f"coreformer {family} fine-tuned for {args.task}" + (" (LoRA adapter)" if adapter else ""),
        family=family,
        auto_class=args.spec.auto_class,
        summary=summary + ".",
        num_parameters=num_parameters,
        base_model=args.model,
        datasets=[hub_dataset] if hub_dataset else [],
        dataset_description=data,
        pipeline_tag=args.spec.pipeline_tag,
        task_type=args.spec.card_task_type,
        task_name=args.spec.card_task_name,
        eval_results=eval_results,
        eval_dataset=_eval_dataset_name(args),
        hyperparameters=hyperparameters,
        usage=_USAGE[args.task],
        intended_use=f"{args.task} on text like the fine-tuning data; a starting point for experiments.",
        limitations=limitations,
        tags=[args.task] + (["lora", "peft"] if args.peft == "lora" else []),
        license=base_license or "other",
    )


def _eval_dataset_name(args: FinetuningArguments) -> str:
    """What the model-index names the evaluation data: the Hub id, the validation file, or the embedded default."""
    if args.dataset is not None:
        return args.dataset if is_hub_id(args.dataset) else Path(args.dataset).name + " (held-out share)"
    if args.validation_file is not None:
        return Path(args.validation_file).name
    if args.train_file is not None:
        return Path(args.train_file).name + " (held-out share)"
    return f"coreformer embedded {args.task} data (validation split)"


def _write_card(folder: Path, info, path_hint: str) -> None:
    from .model_card import write_model_card

    write_model_card(folder, info, path_hint=path_hint)


# ---------------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------------


def _labels_for(args: FinetuningArguments, splits: datasets.DatasetDict, config) -> tuple[list[str] | None, Callable]:
    if args.task not in ("sequence-classification", "token-classification"):
        return None, None
    names, label_of = read_label_names(splits, args.label_column, per_token=args.task == "token-classification")
    return resolve_labels(args, config, names), label_of


def run_finetuning(args: FinetuningArguments) -> dict[str, Any]:
    """Fine-tune `args.model` on `args.task` and write the folder described in the module docstring.

    Every check (output folder, model, task / family, data, columns, labels) runs before anything is written; the
    folder appears complete or not at all.

    Returns:
        The metrics also written to all_results.json (train_* and eval_* keys, as the example scripts write them).
    """
    output_dir = Path(args.output_dir)
    check_output_dir(output_dir, args.overwrite)
    spec = args.spec
    config, family = load_model_config(args.model, args.task)
    tokenizer = load_finetuning_tokenizer(args, args.model)
    splits, data_description = load_task_data(args)
    label_names, label_of = _labels_for(args, splits, config)

    transformers.set_seed(args.seed)  # the new head's initialisation
    head_kwargs = {}
    if label_names is not None:
        head_kwargs = dict(
            num_labels=len(label_names),
            id2label=dict(enumerate(label_names)),
            label2id={name: index for index, name in enumerate(label_names)},
            ignore_mismatched_sizes=args.ignore_mismatched_sizes,
        )
    model = getattr(transformers, spec.auto_class).from_pretrained(args.model, **head_kwargs)
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id  # a decoder classifier finds the last token by padding
    prepared = prepare_task(args, splits, tokenizer, model, label_names, label_of)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    if args.peft == "lora":
        model = _attach_lora(model, args)

    # Trainer writes into a hidden sibling that replaces output_dir in one step at the end (coreformer.folders):
    # a crash or a kill at any moment leaves the previous run intact.
    # Under torchrun / accelerate launch every process trains into one staged folder (named after the launcher);
    # the main process alone writes the results and swaps the folder in.
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    main_process = int(os.environ.get("RANK", "0")) == 0
    launcher_pid = os.getppid() if multi_process else None
    with staged_folder(output_dir, main_process=main_process, launcher_pid=launcher_pid) as staging:
        trainer = build_trainer(args, model, tokenizer, prepared, staging)
        train_output = trainer.train()
        train_metrics = {key: float(value) for key, value in train_output.metrics.items()}
        train_metrics.update(train_steps=float(trainer.state.global_step), train_samples=float(len(prepared.train)))
        eval_metrics, rows = _predict(trainer, args, prepared, tokenizer)
        trainer.log(eval_metrics)
        metrics = {**train_metrics, **eval_metrics, "epoch": float(trainer.state.epoch or 0.0)}

        if trainer.is_world_process_zero():
            trained = trainer.model
            adapter_parameters = sum(p.numel() for p in trained.parameters() if p.requires_grad)  # LoRA + copied heads
            if args.peft == "lora":
                trained.save_pretrained(staging / ADAPTER_DIR)
                tokenizer.save_pretrained(staging / ADAPTER_DIR)
                trained = trained.merge_and_unload()
            save_with_pipeline(trained, tokenizer, staging)
            trainer.save_metrics("train", train_metrics)
            trainer.save_metrics("eval", eval_metrics)
            trainer.save_metrics("all", metrics, combined=False)
            trainer.state.save_to_json(str(staging / "trainer_state.json"))
            run_arguments.write_json(staging / RUN_CONFIG, dataclasses.asdict(args))
            if rows:
                with open(staging / PREDICTIONS, "w") as handle:
                    handle.writelines(json.dumps(row) + "\n" for row in rows)
            _write_card(
                staging, _card_info(args, family, num_parameters, metrics, data_description, False), str(output_dir)
            )
            if args.peft == "lora":
                adapter_info = _card_info(args, family, adapter_parameters, metrics, data_description, True)
                _write_card(staging / ADAPTER_DIR, adapter_info, str(output_dir / ADAPTER_DIR))
        trainer.accelerator.wait_for_everyone()  # the main process swaps only when every process is done
    return metrics


def evaluate_folder(folder: str | Path, args: FinetuningArguments) -> tuple[dict[str, float], list[dict]]:
    """Load a fine-tuned folder with the task's Auto class and its own tokenizer and labels, and evaluate it on the
    validation split `args` describes, exactly as `run_finetuning` does at the end of training.

    Returns:
        (eval metrics, prediction rows as in eval_predictions.jsonl). Nothing is written.
    """
    import tempfile

    folder = str(folder)
    args = dataclasses.replace(args, model=folder, tokenizer=None, peft="none")
    config, _ = load_model_config(folder, args.task)
    tokenizer = load_finetuning_tokenizer(args, folder)
    splits, _ = load_task_data(args)
    label_names, label_of = None, None
    if args.task in ("sequence-classification", "token-classification"):
        _, label_of = read_label_names(splits, args.label_column, per_token=args.task == "token-classification")
        label_names = [config.id2label[index] for index in sorted(config.id2label)]
    model = getattr(transformers, args.spec.auto_class).from_pretrained(folder)
    prepared = prepare_task(args, splits, tokenizer, model, label_names, label_of, with_train=False)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = build_trainer(args, model, tokenizer, prepared, Path(scratch))
        return _predict(trainer, args, prepared, tokenizer)
