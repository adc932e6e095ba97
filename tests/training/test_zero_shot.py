"""The zero-shot evaluation (coreformer.training.zero_shot, `coreformer evaluate`): a pair of identical lines is a
tie and counts wrong, a model that memorised a tiny text prefers its lines to their corruptions, an untrained model
sits near chance, and the --json report keeps its schema; an encoder's per-token pseudo-log-likelihood terms score
only the text after a context, and one that memorised which line follows which scores a line higher after its own."""

import json
import math
from pathlib import Path

import pytest
import torch

import coreformer as cf
from coreformer.training.corpora import read_source, stdlib_root
from coreformer.training.data import pad_sequences
from coreformer.training.objectives.masked_lm import MaskedLMCollator
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer
from coreformer.training.zero_shot import (
    CORRUPTIONS,
    EvaluationError,
    Pair,
    build_pairs,
    evaluate_folder,
    line_scores,
    masked_token_log_probs,
    pair_accuracy,
    unigram_entropy,
)
from coreformer_cli import COMMANDS

EVALUATE = COMMANDS["evaluate"]  # `coreformer evaluate`
LINES = [
    "def add(first, second): return first + second",
    "for item in sorted(values): print(item)",
    "if name is None: raise ValueError(message)",
    "while queue: handle(queue.pop())",
    "with open(path) as handle: data = handle.read()",
    "class Point(object): pass",
]
CONFIGS = {
    "decoder": (cf.CoreformerDecoderConfig, cf.CoreformerDecoderForCausalLM, dict(num_hidden_layers=2)),
    "encoder": (cf.CoreformerEncoderConfig, cf.CoreformerEncoderForMaskedLM, dict(num_hidden_layers=2)),
    "seq2seq": (
        cf.CoreformerSeq2SeqConfig,
        cf.CoreformerSeq2SeqForConditionalGeneration,
        dict(encoder_layers=2, decoder_layers=2),
    ),
}


@pytest.fixture(scope="module")
def stdlib_text() -> str:
    """Real held-out-like text: a few standard library files."""
    return "\n".join(read_source(stdlib_root() / name) for name in ("textwrap.py", "shlex.py", "fnmatch.py"))


def tiny_model(family: str, tokenizer, seed: int = 0) -> torch.nn.Module:
    config_class, model_class, layers = CONFIGS[family]
    torch.manual_seed(seed)
    config = config_class(
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **layers,
        **token_config_kwargs(tokenizer, family),
    )
    return model_class(config)


def save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def training_batch(family: str, tokenizer, collator) -> dict[str, torch.Tensor]:
    """LINES as one batch of the family's pretraining loss: next tokens after </s>, or masked tokens."""
    if family == "encoder":
        return collator([{"input_ids": tokenizer(line)["input_ids"]} for line in LINES])
    ids = [
        torch.tensor([tokenizer.eos_token_id] + tokenizer(line, add_special_tokens=False)["input_ids"])
        for line in LINES
    ]
    input_ids = pad_sequences(ids, tokenizer.pad_token_id)  # (B, T)
    attention_mask = pad_sequences([torch.ones_like(row) for row in ids], 0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.masked_fill(attention_mask == 0, -100),
    }


def memorise(family: str, tokenizer, steps: int) -> torch.nn.Module:
    """A tiny model trained on LINES alone."""
    model = tiny_model(family, tokenizer).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    collator = MaskedLMCollator.from_tokenizer(tokenizer, mlm_probability=0.3, seed=0) if family == "encoder" else None
    for _ in range(steps):
        loss = model(**training_batch(family, tokenizer, collator)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.mark.parametrize("family", ["decoder", "encoder", "seq2seq"])
def test_a_pair_of_identical_lines_is_a_tie_and_counts_wrong(stdlib_text, family):
    tokenizer = train_tokenizer(family, [stdlib_text], 320)
    model = tiny_model(family, tokenizer).eval()
    pairs = [Pair(LINES[0], LINES[0], "swap"), Pair(LINES[1], LINES[1].replace("item", "value"), "identifier")]
    scores = line_scores(model, tokenizer, family, [pair.original for pair in pairs])
    corrupted = line_scores(model, tokenizer, family, [pair.corrupted for pair in pairs])
    result = pair_accuracy(pairs, scores, corrupted)
    assert scores[0] == corrupted[0] and result["ties"] == 1
    assert result["by_kind"]["swap"] == {"accuracy": 0.0, "pairs": 1}
    assert result["accuracy"] == (1.0 if scores[1] > corrupted[1] else 0.0) / 2


def test_pairs_keep_the_token_count_and_every_kind_appears(stdlib_text):
    tokenizer = train_tokenizer("decoder", [stdlib_text], 320)
    pairs = build_pairs([stdlib_text], tokenizer, 60, seed=0)
    assert len(pairs) == 60 and {pair.kind for pair in pairs} == set(CORRUPTIONS)
    for pair in pairs:
        count = [
            len(tokenizer(line, add_special_tokens=False)["input_ids"]) for line in (pair.original, pair.corrupted)
        ]
        assert pair.original != pair.corrupted and count[0] == count[1]
    assert build_pairs([stdlib_text], tokenizer, 60, seed=0) == pairs  # seeded
    assert build_pairs([stdlib_text], tokenizer, 60, seed=1) != pairs


@pytest.mark.slow
@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_a_model_that_memorised_its_lines_prefers_them_to_their_corruptions(tmp_path, family, stdlib_text):
    tokenizer = train_tokenizer(family, [stdlib_text, *LINES], 320)
    model = memorise(family, tokenizer, steps=150)
    data = tmp_path / "lines.txt"
    data.write_text("\n".join(LINES) + "\n")
    report = evaluate_folder(save(model, tokenizer, tmp_path / family), data=(str(data),), batch_size=4)
    pairs = report["minimal_pairs"]
    assert pairs["pairs"] == len(LINES) and pairs["accuracy"] == 1.0 and pairs["ties"] == 0
    untrained = evaluate_folder(
        save(tiny_model(family, tokenizer), tokenizer, tmp_path / "untrained"), data=(str(data),)
    )
    assert report["held_out"]["loss"] < untrained["held_out"]["loss"] - 1.0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["decoder", "encoder", "seq2seq"])
def test_an_untrained_model_is_near_chance(tmp_path, family, stdlib_text):
    tokenizer = train_tokenizer(family, [stdlib_text], 320)
    data = tmp_path / "held_out.txt"
    data.write_text(stdlib_text)
    report = evaluate_folder(save(tiny_model(family, tokenizer), tokenizer, tmp_path / family), data=(str(data),))
    pairs = report["minimal_pairs"]
    assert pairs["pairs"] == 200 and 0.38 <= pairs["accuracy"] <= 0.62  # 200 fair coin flips: 0.5 +- 3.4 sd
    assert report["held_out"]["perplexity"] > 0.5 * len(tokenizer)  # about uniform over the vocabulary


def test_unigram_entropy_is_the_entropy_of_the_token_frequencies(stdlib_text):
    tokenizer = train_tokenizer("decoder", [stdlib_text], 320)
    decoded = (tokenizer.decode([index]) for index in range(len(tokenizer)))
    words = [word for word in decoded if len(tokenizer(word, add_special_tokens=False)["input_ids"]) == 1]
    first, second = words[-2:]  # two texts of one token each, from the merges
    assert unigram_entropy(tokenizer, [first] * 4) == pytest.approx(0.0)
    # two tokens of probability 1/2 each -> log 2 nats
    assert unigram_entropy(tokenizer, [first, second, first, second]) == pytest.approx(math.log(2))


def test_json_report_schema_and_one_line_errors(tmp_path, stdlib_text, capsys):
    tokenizer = train_tokenizer("decoder", [stdlib_text], 320)
    folder = save(tiny_model("decoder", tokenizer), tokenizer, tmp_path / "model")
    data = tmp_path / "held_out.txt"
    data.write_text(stdlib_text)
    assert EVALUATE.main([str(folder), "--data", str(data), "--json", "--pairs", "12", "--batches", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"folder", "family", "parameters", "data", "held_out", "minimal_pairs", "seed"}
    assert report["family"] == "decoder" and report["seed"] == 0 and report["folder"] == str(folder)
    assert set(report["held_out"]) == {"objective", "loss", "perplexity", "tokens", "unigram_entropy"}
    assert report["held_out"]["objective"] == "causal LM" and report["held_out"]["tokens"] > 0
    pairs = report["minimal_pairs"]
    assert set(pairs) == {"score", "accuracy", "pairs", "ties", "by_kind"} and pairs["pairs"] == 12
    assert sum(kind["pairs"] for kind in pairs["by_kind"].values()) == 12 and 0 <= pairs["accuracy"] <= 1
    assert EVALUATE.main([str(folder), "--data", str(data), "--pairs", "12", "--batches", "2"]) == 0
    printed = capsys.readouterr().out
    assert "minimal pairs      " in printed and "unigram entropy    " in printed
    assert EVALUATE.main([str(tmp_path / "missing")]) == 2  # checked by the command line, before torch
    assert capsys.readouterr().err.startswith(f"coreformer evaluate: error: no such folder: {tmp_path / 'missing'} ")
    assert EVALUATE.main([str(tmp_path)]) == 1  # a folder, but no model in it
    nothing = "holds no config.json; pass a pretrained folder (a run's --output-dir)."
    assert capsys.readouterr().err.strip().endswith(nothing)


def test_a_folder_without_a_language_model_head_is_refused(tmp_path, stdlib_text):
    tokenizer = train_tokenizer("encoder", [stdlib_text], 320)
    encoder = cf.CoreformerEncoderModel(tiny_model("encoder", tokenizer).config)  # what ELECTRA's folder holds
    with pytest.raises(EvaluationError, match="not the encoder language model .CoreformerEncoderForMaskedLM."):
        evaluate_folder(save(encoder, tokenizer, tmp_path / "electra"))


def test_a_run_reports_why_its_folder_was_not_scored_instead_of_failing(tmp_path, stdlib_text):
    from coreformer.training.pretraining.run import PretrainingArguments
    from coreformer.training.zero_shot import run_zero_shot

    tokenizer = train_tokenizer("encoder", [stdlib_text], 320)
    electra = save(cf.CoreformerEncoderModel(tiny_model("encoder", tokenizer).config), tokenizer, tmp_path / "electra")
    args = PretrainingArguments(family="encoder", objective="electra")
    assert "not the encoder language model" in run_zero_shot(electra, args, [stdlib_text])["skipped"]
    decoder = save(
        tiny_model("decoder", tokenizer := train_tokenizer("decoder", [stdlib_text], 320)), tokenizer, tmp_path / "d"
    )
    # `coreformer evaluate` on a folder whose recorded training text has moved names it and the way out
    (decoder / "run_config.json").write_text(json.dumps({"dataset": str(tmp_path / "moved.txt")}))
    with pytest.raises(EvaluationError) as error:
        evaluate_folder(decoder)
    assert str(error.value).startswith(f"Cannot load the run's training text '{tmp_path}/moved.txt'")
    assert run_zero_shot(decoder, PretrainingArguments(family="decoder", zero_shot_pairs=0), [stdlib_text]) is None


def test_masked_token_log_probs_score_only_the_text_and_sum_to_its_pseudo_log_likelihood(stdlib_text):
    tokenizer = train_tokenizer("encoder", [stdlib_text], 320)
    model = tiny_model("encoder", tokenizer).eval()
    alone = masked_token_log_probs(model, tokenizer, LINES[:3])
    assert [len(terms) for terms in alone] == [
        len(tokenizer(line, add_special_tokens=False)["input_ids"]) for line in LINES[:3]
    ]
    ids = torch.tensor(tokenizer(LINES[0])["input_ids"])
    by_hand = []  # each token of the line masked in turn, one forward each
    for position in range(1, len(ids) - 1):
        masked = ids.clone()
        masked[position] = tokenizer.mask_token_id
        with torch.no_grad():
            logits = model(input_ids=masked[None]).logits[0, position]
        by_hand.append(torch.log_softmax(logits.float(), -1)[ids[position]].item())
    assert alone[0].tolist() == pytest.approx(by_hand, abs=1e-5)
    assert line_scores(model, tokenizer, "encoder", LINES[:1]).item() == pytest.approx(sum(by_hand), abs=1e-4)
    after = masked_token_log_probs(model, tokenizer, LINES[:3], contexts=LINES[3:6], max_length=64)
    assert [len(terms) for terms in after] == [len(terms) for terms in alone]  # the context's tokens are not scored
    context_ids = tokenizer(LINES[3], LINES[0], truncation=True, max_length=64)["input_ids"]
    first = len(context_ids) - len(ids) + 1  # where the line's first token sits after [CLS] context [SEP]
    masked = torch.tensor(context_ids)
    masked[first] = tokenizer.mask_token_id
    with torch.no_grad():
        logits = model(input_ids=masked[None]).logits[0, first]
    assert after[0][0].item() != pytest.approx(alone[0][0].item(), abs=1e-3)  # the context changes the term
    assert after[0][0].item() == pytest.approx(torch.log_softmax(logits.float(), -1)[ids[1]].item(), abs=1e-5)
    truncated = masked_token_log_probs(model, tokenizer, [LINES[0]], contexts=[LINES[1]], max_length=12)
    assert 0 < len(truncated[0]) < len(alone[0]) and len(truncated[0]) <= 12 - 3  # [CLS], [SEP], [SEP] kept


@pytest.mark.slow
def test_an_encoder_that_memorised_which_line_follows_which_scores_the_true_next_line_higher_after_its_line(
    stdlib_text,
):
    tokenizer = train_tokenizer("encoder", [stdlib_text, *LINES], 320)
    model = tiny_model("encoder", tokenizer).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    collator = MaskedLMCollator.from_tokenizer(tokenizer, mlm_probability=0.3, seed=0)
    pairs = [
        {"input_ids": tokenizer(first, second, truncation=True, max_length=64)["input_ids"]}
        for first, second in zip(LINES, LINES[1:])
    ]
    for _ in range(200):
        loss = model(**collator(pairs)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    texts = LINES[1:]
    after_own = masked_token_log_probs(model, tokenizer, texts, contexts=LINES[:-1], max_length=64)
    others = LINES[-1:] + LINES[:-2]  # each text after another line than its own
    after_other = masked_token_log_probs(model, tokenizer, texts, contexts=others, max_length=64)
    for own, other in zip(after_own, after_other, strict=True):
        kept = min(len(own), len(other))  # the tokens both inputs kept after truncation
        assert own[:kept].mean() > other[:kept].mean()  # the line before it tells the model more
