"""transformers pipelines over coreformer models, and the custom QA / text2text pipelines in coreformer/pipelines.py.

Every case runs three ways and must give the same result: from the model object, from its saved folder with coreformer
installed, and from the folder alone via trust_remote_code in a fresh process where coreformer cannot be imported.
Each result is also checked against the model called directly (its logits, hidden states or generate output).
"""

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from transformers import pipeline

import coreformer as cf
from coreformer.pipelines import (
    QUESTION_ANSWERING,
    TEXT2TEXT,
    CoreformerQuestionAnsweringPipeline,
    CoreformerText2TextPipeline,
    best_spans,
    save_with_pipeline,
)
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer

CITIES = ["Paris", "London", "Rome", "Berlin", "Madrid", "Vienna", "Prague", "Oslo"]
THINGS = ["tower", "bridge", "museum", "castle", "garden", "library", "market", "station"]
TEMPLATES = ["The {t} is in {c}.", "In {c} you find the {t}.", "Visitors see the old {t} of {c} every day."]
CORPUS = [template.format(t=t, c=c) for template in TEMPLATES for t in THINGS for c in CITIES] + [
    f"Where is the {t}?" for t in THINGS
]
CONFIG_CLASSES = {
    "encoder": cf.CoreformerEncoderConfig,
    "decoder": cf.CoreformerDecoderConfig,
    "seq2seq": cf.CoreformerSeq2SeqConfig,
}
SENTIMENT = {"id2label": {0: "NEG", 1: "POS"}, "label2id": {"NEG": 0, "POS": 1}}
TAGS = {"id2label": {0: "O", 1: "B-LOC", 2: "I-LOC"}, "label2id": {"O": 0, "B-LOC": 1, "I-LOC": 2}}
NLI = {
    "id2label": {0: "contradiction", 1: "neutral", 2: "entailment"},
    "label2id": {"contradiction": 0, "neutral": 1, "entailment": 2},
}
TEXT = "The old tower is in Paris."
QUESTION, CONTEXT = "Where is the tower?", "Visitors see the old tower of Rome every day."
ATOL = 1e-5


@pytest.fixture(scope="module")
def tokenizers():
    return {
        family: train_tokenizer(family, CORPUS, vocab_size=200 if family == "encoder" else 300)
        for family in CONFIG_CLASSES
    }


def build(head, family: str, tokenizer, seed: int = 0, **overrides):
    """A tiny model of `family` (hidden 32, 2 layers, 4 heads) sized to `tokenizer`, dropout off."""
    layers = dict(encoder_layers=2, decoder_layers=2) if family == "seq2seq" else dict(num_hidden_layers=2)
    config = CONFIG_CLASSES[family](
        **token_config_kwargs(tokenizer, family),
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        **layers,
        **overrides,
    )
    torch.manual_seed(seed)
    return head(config).eval()


def _encode(tokenizer, *texts):
    return tokenizer(*texts, return_tensors="pt")


def check_fill_mask(model, tokenizer, result):
    assert len(result) == 3 and all("[MASK]" not in row["sequence"] for row in result)
    logits = model(**_encode(tokenizer, f"The old {tokenizer.mask_token} is in Paris.")).logits[0]
    position = (
        _encode(tokenizer, f"The old {tokenizer.mask_token} is in Paris.")["input_ids"][0]
        .tolist()
        .index(tokenizer.mask_token_id)
    )
    probabilities, tokens = logits[position].softmax(-1).topk(3)
    assert [row["token"] for row in result] == tokens.tolist()
    assert [row["score"] for row in result] == pytest.approx(probabilities.tolist(), abs=ATOL)


def check_text_classification(model, tokenizer, result):
    assert sorted(row["label"] for row in result) == ["NEG", "POS"]
    assert [row["score"] for row in result] == sorted((row["score"] for row in result), reverse=True)
    probabilities = model(**_encode(tokenizer, TEXT)).logits[0].softmax(-1)
    for row in result:
        assert row["score"] == pytest.approx(probabilities[model.config.label2id[row["label"]]].item(), abs=ATOL)


def check_token_classification(model, tokenizer, result):
    encoding = _encode(tokenizer, TEXT)
    special = set(tokenizer.all_special_ids)
    kept = [i for i, token in enumerate(encoding["input_ids"][0].tolist()) if token not in special]
    assert [row["index"] for row in result] == kept  # ignore_labels=[]: every real token, O included
    predicted = model(**encoding).logits[0].argmax(-1)
    for row in result:
        assert row["entity"] == model.config.id2label[predicted[row["index"]].item()]
        assert 0 <= row["start"] < row["end"] <= len(TEXT)


def check_feature_extraction(model, tokenizer, result):
    output = model(**_encode(tokenizer, TEXT))
    expected = output.last_hidden_state  # seq2seq: the decoder's, over the input shifted right
    assert np.array(result).shape == (1, expected.shape[1], model.config.hidden_size)
    np.testing.assert_allclose(np.array(result), expected.numpy(), atol=ATOL)


def check_zero_shot(model, tokenizer, result):
    assert sorted(result["labels"]) == ["sport", "travel", "weather"]
    assert sum(result["scores"]) == pytest.approx(1.0) and result["scores"] == sorted(result["scores"], reverse=True)
    entailment = model.config.label2id["entailment"]
    logits = torch.stack(
        [
            model(**_encode(tokenizer, TEXT, f"This example is {label}.")).logits[0, entailment]
            for label in result["labels"]
        ]
    )
    assert result["scores"] == pytest.approx(logits.softmax(-1).tolist(), abs=ATOL)


def check_text_generation(model, tokenizer, result):
    ids = _encode(tokenizer, "The tower")["input_ids"]
    generated = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert result == [{"generated_text": tokenizer.decode(generated[0], skip_special_tokens=True)}]
    assert result[0]["generated_text"].startswith("The tower")


def check_question_answering(model, tokenizer, result):
    assert result["answer"] == CONTEXT[result["start"] : result["end"]] and result["answer"].strip() == result["answer"]
    assert 0 < result["score"] <= 1


def check_text2text(model, tokenizer, result):
    generated = model.generate(**_encode(tokenizer, TEXT), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert result == [{"generated_text": tokenizer.decode(generated[0], skip_special_tokens=True)}]


# name -> (task, family, head, config overrides, call args, call kwargs, check)
CASES = {
    "fill-mask/encoder": (
        "fill-mask",
        "encoder",
        cf.CoreformerEncoderForMaskedLM,
        {},
        ["The old [MASK] is in Paris."],
        {"top_k": 3},
        check_fill_mask,
    ),
    **{
        f"text-classification/{family}": (
            "text-classification",
            family,
            head,
            SENTIMENT,
            [TEXT],
            {"top_k": None},
            check_text_classification,
        )
        for family, head in [
            ("encoder", cf.CoreformerEncoderForSequenceClassification),
            ("decoder", cf.CoreformerDecoderForSequenceClassification),
            ("seq2seq", cf.CoreformerSeq2SeqForSequenceClassification),
        ]
    },
    **{
        f"token-classification/{family}": (
            "token-classification",
            family,
            head,
            TAGS,
            [TEXT],
            {"ignore_labels": []},
            check_token_classification,
        )
        for family, head in [
            ("encoder", cf.CoreformerEncoderForTokenClassification),
            ("decoder", cf.CoreformerDecoderForTokenClassification),
        ]
    },
    **{
        f"feature-extraction/{family}": ("feature-extraction", family, head, {}, [TEXT], {}, check_feature_extraction)
        for family, head in [
            ("encoder", cf.CoreformerEncoderModel),
            ("decoder", cf.CoreformerDecoderModel),
            ("seq2seq", cf.CoreformerSeq2SeqModel),
        ]
    },
    **{
        f"zero-shot-classification/{family}": (
            "zero-shot-classification",
            family,
            head,
            NLI,
            [TEXT],
            {"candidate_labels": ["travel", "sport", "weather"], "hypothesis_template": "This example is {}."},
            check_zero_shot,
        )
        for family, head in [
            ("encoder", cf.CoreformerEncoderForSequenceClassification),
            ("decoder", cf.CoreformerDecoderForSequenceClassification),
            ("seq2seq", cf.CoreformerSeq2SeqForSequenceClassification),
        ]
    },
    "text-generation/decoder": (
        "text-generation",
        "decoder",
        cf.CoreformerDecoderForCausalLM,
        {},
        ["The tower"],
        {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False},
        check_text_generation,
    ),
    f"{QUESTION_ANSWERING}/encoder": (
        QUESTION_ANSWERING,
        "encoder",
        cf.CoreformerEncoderForQuestionAnswering,
        {},
        [],
        {"question": QUESTION, "context": CONTEXT},
        check_question_answering,
    ),
    f"{TEXT2TEXT}/seq2seq": (
        TEXT2TEXT,
        "seq2seq",
        cf.CoreformerSeq2SeqForConditionalGeneration,
        {},
        [TEXT],
        {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False},
        check_text2text,
    ),
}
CUSTOM = {QUESTION_ANSWERING: CoreformerQuestionAnsweringPipeline, TEXT2TEXT: CoreformerText2TextPipeline}


def to_json(result):
    """Pipeline output as plain JSON values (numpy scalars and arrays included), for comparison across processes."""
    return json.loads(json.dumps(result, default=lambda value: np.asarray(value).tolist()))


def assert_same(actual, expected, path="result"):
    if isinstance(expected, dict):
        assert set(actual) == set(expected), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), path
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            assert_same(left, right, f"{path}[{index}]")
    elif isinstance(expected, float):
        assert actual == pytest.approx(expected, abs=ATOL), path
    else:
        assert actual == expected, path


@pytest.fixture(scope="module")
def saved(tokenizers, tmp_path_factory):
    """case name -> (model, tokenizer, folder, result from the model object); each folder saved with its pipeline."""
    out = {}
    root = tmp_path_factory.mktemp("pipelines")
    for name, (task, family, head, overrides, args, kwargs, _) in CASES.items():
        tokenizer = tokenizers[family]
        model = build(head, family, tokenizer, **overrides)
        with torch.no_grad():
            result = to_json(pipeline(task, model=model, tokenizer=tokenizer)(*args, **kwargs))
        folder = root / name.replace("/", "-")
        written = save_with_pipeline(model, tokenizer, folder, task=task)
        assert written == (task if task in CUSTOM else None)
        out[name] = model, tokenizer, str(folder), result
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_result_matches_the_model_called_directly(saved, name):
    model, tokenizer, _, result = saved[name]
    with torch.no_grad():
        CASES[name][-1](model, tokenizer, result)


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_from_the_saved_folder_with_coreformer_installed_matches(saved, name):
    task, _, _, _, args, kwargs, _ = CASES[name]
    _, _, folder, expected = saved[name]
    # Installed, the custom tasks use coreformer's own classes (trust_remote_code=True would run the folder's copy).
    options = {"pipeline_class": CUSTOM[task]} if task in CUSTOM else {}
    with torch.no_grad():
        assert_same(to_json(pipeline(task, model=folder, **options)(*args, **kwargs)), expected)


CHILD = textwrap.dedent(
    """
    import json, sys
    sys.modules["coreformer"] = None  # a machine without coreformer: only transformers and the saved folders
    try:
        import coreformer
    except ImportError:
        pass
    else:
        raise SystemExit("coreformer is importable in the child")
    import numpy as np
    from transformers import pipeline
    results = {}
    for name, case in json.load(open(sys.argv[1])).items():
        # A folder with a custom pipeline needs no task: its one custom task is picked from config.json.
        task = None if case["custom"] else case["task"]
        pipe = pipeline(task, model=case["folder"], trust_remote_code=True)
        assert type(pipe.model).__module__.startswith("transformers_modules"), type(pipe.model).__module__
        if case["custom"]:
            assert type(pipe).__module__.startswith("transformers_modules"), type(pipe).__module__
        result = pipe(*case["args"], **case["kwargs"])
        results[name] = json.loads(json.dumps(result, default=lambda value: np.asarray(value).tolist()))
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_every_pipeline_loads_from_its_folder_without_coreformer(saved, tmp_path):
    spec = {
        name: {"task": task, "custom": task in CUSTOM, "folder": saved[name][2], "args": args, "kwargs": kwargs}
        for name, (task, _, _, _, args, kwargs, _) in CASES.items()
    }
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "cases.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(results) == set(CASES)
    for name in CASES:
        assert_same(results[name], saved[name][3], name)


def test_save_with_pipeline_attaches_custom_pipelines_only_where_transformers_has_none(saved):
    for name, (task, *_) in CASES.items():
        folder = saved[name][2]
        config = json.loads(open(os.path.join(folder, "config.json")).read())
        has_code = os.path.isfile(os.path.join(folder, "pipelines.py"))
        if task in CUSTOM:
            assert set(config["custom_pipelines"]) == {task} and has_code
            assert "import coreformer" not in open(os.path.join(folder, "pipelines.py")).read()
        else:
            assert "custom_pipelines" not in config and not has_code
        assert os.path.isfile(os.path.join(folder, "tokenizer.json"))


def _qa_example(rng: random.Random) -> tuple[str, str, str]:
    thing, city, template = rng.choice(THINGS), rng.choice(CITIES), rng.choice(TEMPLATES)
    return f"Where is the {thing}?", template.format(t=thing, c=city), city


def test_question_answering_pipeline_finds_the_answer_of_a_trained_model(tokenizers):
    """Train a tiny QA model (100 steps, ~2 s) on "Where is the <thing>?" over three templates, then the pipeline
    must return the city, at its character offsets, on new combinations (batched, so padded rows are covered too).

    The encoder tokenizer's vocabulary (200) holds every corpus word whole: `tokenizers` breaks frequency ties in a
    different order from run to run, which with a smaller vocabulary changes how the cities are split."""
    tokenizer = tokenizers["encoder"]
    model = build(cf.CoreformerEncoderForQuestionAnswering, "encoder", tokenizer).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(100):
        batch = [_qa_example(rng) for _ in range(16)]
        encoding = tokenizer(
            [q for q, _, _ in batch], [c for _, c, _ in batch], padding=True, return_offsets_mapping=True
        )
        starts, ends = [], []
        for row, (_, context, city) in enumerate(batch):
            begin = context.index(city)
            inside = [
                i
                for i, (sequence, (start, end)) in enumerate(
                    zip(encoding.sequence_ids(row), encoding["offset_mapping"][row], strict=True)
                )
                if sequence == 1 and start >= begin and end <= begin + len(city)
            ]
            starts.append(inside[0])
            ends.append(inside[-1])
        inputs = {key: torch.tensor(value) for key, value in encoding.items() if key != "offset_mapping"}
        loss = model(**inputs, start_positions=torch.tensor(starts), end_positions=torch.tensor(ends)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    qa = pipeline(QUESTION_ANSWERING, model=model.eval(), tokenizer=tokenizer)
    assert isinstance(qa, CoreformerQuestionAnsweringPipeline)
    rng = random.Random(1)
    examples = [_qa_example(rng) for _ in range(20)]
    answers = qa(question=[q for q, _, _ in examples], context=[c for _, c, _ in examples], batch_size=4)
    for (_, context, city), answer in zip(examples, answers, strict=True):
        assert answer["answer"] == city and answer["start"] == context.index(city), (context, answer)


@pytest.mark.parametrize("tokenizer_family", ["encoder", "seq2seq"])
def test_question_answering_spans_are_context_substrings_under_truncation(tokenizers, tokenizer_family):
    """WordPiece and byte-level offsets (whose tokens carry their leading space), a context cut to fit 24 tokens."""
    tokenizer = tokenizers[tokenizer_family]
    model = build(cf.CoreformerEncoderForQuestionAnswering, "encoder", tokenizer, seed=3)
    qa = pipeline(QUESTION_ANSWERING, model=model, tokenizer=tokenizer)
    context = " ".join(CORPUS[:12])
    answers = qa(question=QUESTION, context=context, top_k=10, max_answer_length=4, max_seq_len=24)
    question_length = len(tokenizer(QUESTION)["input_ids"])
    seen = tokenizer(QUESTION, context, truncation="only_second", max_length=24, return_offsets_mapping=True)
    last_char = max(end for sequence, (_, end) in zip(seen.sequence_ids(), seen["offset_mapping"]) if sequence == 1)
    assert len(answers) == 10 and question_length < 24
    assert [answer["score"] for answer in answers] == sorted((answer["score"] for answer in answers), reverse=True)
    for answer in answers:
        assert answer["answer"] and answer["answer"] == context[answer["start"] : answer["end"]]
        assert answer["answer"] == answer["answer"].strip()
        assert answer["end"] <= last_char  # only what survived truncation can be an answer


def test_best_spans_by_hand():
    start = np.log(np.array([0.1, 0.6, 0.3, 0.0001]))
    end = np.log(np.array([0.2, 0.2, 0.6, 0.0001]))
    candidates = np.array([False, True, True, True])  # token 0 is the question
    spans = best_spans(start, end, candidates, max_answer_length=2, top_k=3)
    # Renormalised over tokens 1-3: p_start ~ (2/3, 1/3, 0), p_end ~ (1/4, 3/4, 0);
    # spans (1, 2) 2/3 * 3/4 = 1/2, (2, 2) 1/3 * 3/4 = 1/4, (1, 1) 2/3 * 1/4 = 1/6.
    assert [(s, e) for s, e, _ in spans] == [(1, 2), (2, 2), (1, 1)]
    assert [score for *_, score in spans] == pytest.approx([1 / 2, 1 / 4, 1 / 6], abs=1e-3)
    assert best_spans(start, end, candidates, max_answer_length=1, top_k=1)[0][:2] == (2, 2)


def test_text2text_batches_and_returns_several_sequences(saved):
    model, tokenizer, _, _ = saved[f"{TEXT2TEXT}/seq2seq"]
    text2text = pipeline(TEXT2TEXT, model=model, tokenizer=tokenizer, max_new_tokens=4)
    several = text2text([TEXT, "In Rome you find the bridge."], num_beams=2, num_return_sequences=2)
    assert [len(outputs) for outputs in several] == [2, 2]
    one_each = text2text([TEXT, "In Rome you find the bridge."], batch_size=2)
    assert len(one_each) == 2 and all(isinstance(output["generated_text"], str) for output in one_each)


def test_custom_pipelines_refuse_bad_input_with_one_clear_error(saved, tokenizers):
    model, tokenizer, _, _ = saved[f"{QUESTION_ANSWERING}/encoder"]
    qa = pipeline(QUESTION_ANSWERING, model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="question=... and context="):
        qa()
    with pytest.raises(ValueError, match="non-empty"):
        qa(question=QUESTION, context="  ")
    with pytest.raises(ValueError, match="2 questions for 3 contexts"):
        qa(question=[QUESTION, QUESTION], context=[CONTEXT] * 3)
    classifier = saved["text-classification/seq2seq"][0]
    with pytest.raises(ValueError, match="cannot generate"):
        pipeline(TEXT2TEXT, model=classifier, tokenizer=tokenizers["seq2seq"])


def test_fine_tuning_cards_tag_the_pipeline_of_their_heads_not_one_transformers_5_removed():
    # A seq2seq card once said `pipeline_tag: summarization`; transformers 5 has no such pipeline (its error points
    # to chat models). Each task's card tag is the Hub tag the family registry gives its Auto class.
    from transformers.pipelines import SUPPORTED_TASKS

    from coreformer.families import FAMILIES
    from coreformer.training.tasks import TASKS

    tags = {head.auto_class: head.pipeline_tag for family in FAMILIES.values() for head in family.heads}
    for task in TASKS.values():
        assert task.pipeline_tag == tags[task.auto_class], task.name
    assert "summarization" not in SUPPORTED_TASKS and TASKS["seq2seq"].pipeline_tag == "text2text-generation"
