"""Pipelines that transformers 5.23 no longer ships, for coreformer checkpoints, saved next to the weights.

    task                            class                                 Auto class                      returns
    coreformer-question-answering   CoreformerQuestionAnsweringPipeline   AutoModelForQuestionAnswering   answer span
    coreformer-text2text            CoreformerText2TextPipeline           AutoModelForSeq2SeqLM           generated text

Importing this module registers both tasks with transformers' `PIPELINE_REGISTRY`, so with coreformer installed

    pipe = pipeline("coreformer-question-answering", model=model, tokenizer=tokenizer)

works for a model object. `save_with_pipeline(model, tokenizer, folder)` saves the model, its tokenizer and this file,
and writes `custom_pipelines` into config.json (transformers' `Pipeline.save_pretrained` for registered pipelines), so
that anywhere with only transformers installed

    pipe = pipeline(model=folder, trust_remote_code=True)      # the folder's one custom task is picked

builds the same pipeline from the folder's code. Folders of the other heads get no custom pipeline: transformers' own
fill-mask, text-classification, token-classification, feature-extraction, zero-shot-classification and
text-generation pipelines load them through the Auto classes.

This file is copied next to checkpoints: it imports only numpy, torch, transformers and its single-dot sibling
`compat.py` (copied with it), never coreformer.
"""

import os

import numpy as np
import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    GenerationConfig,
    Pipeline,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers import pipeline as build_pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from .compat import pipeline_generate_kwargs

QUESTION_ANSWERING = "coreformer-question-answering"
TEXT2TEXT = "coreformer-text2text"


def input_length_limit(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """The longest input the pair accepts: the tokenizer's `model_max_length` (often "unbounded", 1e30) capped by the
    model's `max_position_embeddings`."""
    limit = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    return int(min(limit, tokenizer.model_max_length))


def best_spans(
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    candidates: np.ndarray,
    *,
    max_answer_length: int = 30,
    top_k: int = 1,
) -> list[tuple[int, int, float]]:
    """The `top_k` most probable answer spans (start token, end token inclusive, probability), best first.

    Start and end are each a softmax over the candidate tokens only (the context; the question and special tokens are
    excluded), and a span scores p_start(i) * p_end(j) for i <= j < i + max_answer_length, as transformers'
    former question-answering pipeline did.

    Args:
        start_logits, end_logits: (T,) logits of one sequence.
        candidates: (T,) bool, True where an answer may start or end.
    """
    if not candidates.any():
        raise ValueError("No context token is left to answer from: shorten the question or raise max_seq_len.")
    if max_answer_length < 1 or top_k < 1:
        raise ValueError(f"max_answer_length and top_k must be >= 1, got {max_answer_length} and {top_k}.")

    def masked_softmax(logits: np.ndarray) -> np.ndarray:
        logits = np.where(candidates, logits.astype(np.float64), -np.inf)
        exp = np.exp(logits - logits.max())
        return exp / exp.sum()

    scores = np.outer(masked_softmax(start_logits), masked_softmax(end_logits))  # (T start, T end)
    length = len(candidates)
    offset = np.arange(length)[None, :] - np.arange(length)[:, None]  # end - start
    scores = np.where((offset >= 0) & (offset < max_answer_length), scores, 0.0)
    order = np.argsort(-scores, axis=None, kind="stable")[:top_k]
    starts, ends = np.unravel_index(order, scores.shape)
    return [(int(s), int(e), float(scores[s, e])) for s, e in zip(starts, ends, strict=True) if scores[s, e] > 0]


class CoreformerQuestionAnsweringPipeline(Pipeline):
    """Extractive question answering: the most probable span of `context` that answers `question`.

    Call it as `pipe(question=..., context=...)` (strings, or lists of equal length), or with a dict / list of dicts
    with "question" and "context". Each answer is `{"answer": str, "score": float, "start": int, "end": int}` where
    `context[start:end] == answer`; `top_k > 1` gives a list of them, best first.

    Truncation is simple: question and context are encoded as one pair of at most `max_seq_len` tokens (default: the
    model's limit) and only the context is cut, so an answer past the cut cannot be found (no sliding window).
    """

    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False

    def __call__(self, question=None, context=None, **kwargs):
        if context is None:
            if question is None:
                raise ValueError("Pass question=... and context=..., or a dict with 'question' and 'context'.")
            inputs = question  # dict(s) with both fields
        elif isinstance(question, str) and isinstance(context, str):
            inputs = {"question": question, "context": context}
        else:
            questions = [question] * len(context) if isinstance(question, str) else list(question)
            contexts = [context] * len(questions) if isinstance(context, str) else list(context)
            if len(questions) != len(contexts):
                raise ValueError(f"Got {len(questions)} questions for {len(contexts)} contexts.")
            inputs = [{"question": q, "context": c} for q, c in zip(questions, contexts, strict=True)]
        return super().__call__(inputs, **kwargs)

    def _sanitize_parameters(self, top_k=None, max_answer_length=None, max_seq_len=None, **kwargs):
        if kwargs:
            raise ValueError(f"Unknown question-answering options: {sorted(kwargs)}.")
        preprocess = {} if max_seq_len is None else {"max_seq_len": max_seq_len}
        postprocess = {}
        if top_k is not None:
            postprocess["top_k"] = top_k
        if max_answer_length is not None:
            postprocess["max_answer_length"] = max_answer_length
        return preprocess, {}, postprocess

    def preprocess(self, inputs: dict, max_seq_len: int | None = None) -> dict:
        if not isinstance(inputs, dict) or not {"question", "context"} <= inputs.keys():
            raise ValueError(f"Each input needs a 'question' and a 'context', got {inputs!r}.")
        question, context = inputs["question"], inputs["context"]
        if not isinstance(question, str) or not question.strip() or not isinstance(context, str) or not context.strip():
            raise ValueError("question and context must be non-empty strings.")
        if not self.tokenizer.is_fast:
            raise ValueError("Question answering maps tokens back to characters: it needs a fast tokenizer.")
        encoding = self.tokenizer(
            question,
            context,
            truncation="only_second",
            max_length=max_seq_len or input_length_limit(self.model, self.tokenizer),
            return_offsets_mapping=True,
            return_tensors="pt",
        )
        context_tokens = torch.tensor([index == 1 for index in encoding.sequence_ids(0)])[None]  # (1, T)
        offsets = encoding.pop("offset_mapping")  # (1, T, 2) character spans, into the context where context_tokens
        model_inputs = {key: value for key, value in encoding.items() if key in self.tokenizer.model_input_names}
        return {**model_inputs, "context_tokens": context_tokens, "offsets": offsets, "context": [context]}

    def _forward(self, inputs: dict) -> dict:
        extras = {key: inputs.pop(key) for key in ("context_tokens", "offsets", "context")}
        output = self.model(**inputs)
        return {"start_logits": output.start_logits, "end_logits": output.end_logits, **extras}

    def postprocess(self, outputs: dict, top_k: int = 1, max_answer_length: int = 30) -> dict | list[dict]:
        context = outputs["context"][0]
        offsets = outputs["offsets"][0].tolist()
        spans = best_spans(
            outputs["start_logits"][0].float().numpy(),
            outputs["end_logits"][0].float().numpy(),
            outputs["context_tokens"][0].numpy().astype(bool),
            max_answer_length=max_answer_length,
            top_k=top_k,
        )
        answers = []
        for start_token, end_token, score in spans:
            start, end = offsets[start_token][0], offsets[end_token][1]
            # Byte-level tokens carry their leading space in the offsets: trim it so the answer is the words only.
            text = context[start:end]
            start += len(text) - len(text.lstrip())
            end -= len(text) - len(text.rstrip())
            answers.append({"score": score, "start": start, "end": max(start, end), "answer": context[start:end]})
        return answers[0] if top_k == 1 else answers


class CoreformerText2TextPipeline(Pipeline):
    """Sequence-to-sequence generation (summarisation, translation, any text -> text) with `model.generate`.

    `pipe("text", max_new_tokens=20, num_beams=4)` returns `[{"generated_text": str}]` (one per returned sequence);
    a list of texts returns one such list per text, flattened to one dict per text when each has one sequence.
    Inputs longer than the model's limit are truncated. Generation options go to `generate` (at construction or call).
    """

    _pipeline_calls_generate = True
    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _default_generation_config = GenerationConfig(max_new_tokens=256)  # as transformers' former text2text pipeline

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.model.can_generate():
            raise ValueError(f"{type(self.model).__name__} cannot generate: text2text needs a seq2seq LM head.")

    def __call__(self, inputs, **kwargs):
        result = super().__call__(inputs, **kwargs)
        if isinstance(inputs, list) and all(len(outputs) == 1 for outputs in result):
            return [outputs[0] for outputs in result]
        return result

    def _sanitize_parameters(self, truncation=None, clean_up_tokenization_spaces=None, **generate_kwargs):
        preprocess = {} if truncation is None else {"truncation": truncation}
        postprocess = {}
        if clean_up_tokenization_spaces is not None:
            postprocess["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        return preprocess, generate_kwargs, postprocess

    def preprocess(self, text: str, truncation: bool = True) -> dict:
        if not isinstance(text, str):
            raise ValueError(f"text2text takes a string or a list of strings, got {type(text).__name__}.")
        encoding = self.tokenizer(
            text,
            truncation=truncation,
            max_length=input_length_limit(self.model, self.tokenizer) if truncation else None,
            return_tensors="pt",
        )
        return {key: value for key, value in encoding.items() if key in ("input_ids", "attention_mask")}

    def _forward(self, inputs: dict, **generate_kwargs) -> dict:
        generate_kwargs = pipeline_generate_kwargs(self, generate_kwargs)
        batch = inputs["input_ids"].shape[0]
        output_ids = self.model.generate(**inputs, **generate_kwargs)  # (B * num_return_sequences, T_out)
        return {"output_ids": output_ids.reshape(batch, -1, output_ids.shape[-1])}

    def postprocess(self, outputs: dict, clean_up_tokenization_spaces: bool = False) -> list[dict]:
        return [
            {
                "generated_text": self.tokenizer.decode(
                    ids, skip_special_tokens=True, clean_up_tokenization_spaces=clean_up_tokenization_spaces
                )
            }
            for ids in outputs["output_ids"][0]
        ]


# Auto class name -> the custom task that serves its heads (filled by `_register`).
CUSTOM_TASKS: dict[str, str] = {}


def _register(task: str, pipeline_class: type[Pipeline], model_class: type) -> None:
    """Register `task` once per process, as the custom task of the `model_class` Auto class. Each folder's copy of
    this file is its own module with its own classes: a copy loaded later through remote code only learns its task
    name (which `save_pretrained` writes into config.json) and leaves the registered classes alone."""
    if task not in PIPELINE_REGISTRY.supported_tasks:
        PIPELINE_REGISTRY.register_pipeline(task, pipeline_class=pipeline_class, pt_model=model_class, type="text")
    else:
        pipeline_class._registered_impl = {task: {"impl": pipeline_class, "pt": (model_class,), "type": "text"}}
    CUSTOM_TASKS[model_class.__name__] = task


_register(QUESTION_ANSWERING, CoreformerQuestionAnsweringPipeline, AutoModelForQuestionAnswering)
_register(TEXT2TEXT, CoreformerText2TextPipeline, AutoModelForSeq2SeqLM)


def default_pipeline_task(model: PreTrainedModel) -> str | None:
    """The custom task a folder of this model should carry: QA heads and seq2seq LMs; None for the other heads.
    Read from the Auto class the model's class is registered for (when the package is imported, or when an Auto
    class loaded it with remote code)."""
    return CUSTOM_TASKS.get(getattr(type(model), "_auto_class", None))


def save_with_pipeline(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: str | os.PathLike,
    task: str | None = None,
) -> str | None:
    """Save model, tokenizer and (for QA and seq2seq LM heads) the custom pipeline that serves them.

    Args:
        task: the pipeline to attach; default `default_pipeline_task(model)`. Any transformers task name works too
            (it is checked against the model, and saves as `model.save_pretrained` + `tokenizer.save_pretrained`).

    Returns:
        The custom task written into config.json's `custom_pipelines`, or None when the folder needs none.
    """
    task = task or default_pipeline_task(model)
    if task is None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return None
    pipe = build_pipeline(task, model=model, tokenizer=tokenizer, device=model.device)
    pipe.save_pretrained(folder)
    return task if task in getattr(model.config, "custom_pipelines", {}) else None
