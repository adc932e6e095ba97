"""Tokenizer training: each family's tokenizer trains fast, reloads offline with AutoTokenizer, has fixed ids and is
the same in every process."""

import json
import os
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

import coreformer as cf
from coreformer.training.data import iter_texts, load_embedded_corpus
from coreformer.training.tokenizer_training import SPECIAL_TOKENS, token_config_kwargs, train_tokenizer
from coreformer_settings.registries import FAMILY_NAMES

SNIPPET = 'def area(r: float) -> float:\n    """Circle area."""\n\treturn 3.14159 * r ** 2  # é, 中\n'
EXPECTED_IDS = {
    "encoder": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4},
    "decoder": {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3},
    "seq2seq": {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4},
}
CONFIGS = {
    "encoder": cf.CoreformerEncoderConfig,
    "decoder": cf.CoreformerDecoderConfig,
    "seq2seq": cf.CoreformerSeq2SeqConfig,
}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return list(iter_texts(load_embedded_corpus(seed=0, max_documents=40)["train"]))


@pytest.fixture(scope="module")
def saved(texts, tmp_path_factory) -> dict[str, tuple[str, float]]:
    """family -> (saved directory, training seconds), for a 500-token vocabulary."""
    out = {}
    for family in FAMILY_NAMES:
        output_dir = str(tmp_path_factory.mktemp(family))
        start = time.perf_counter()
        train_tokenizer(family, texts, vocab_size=500, output_dir=output_dir)
        out[family] = output_dir, time.perf_counter() - start
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tokenizer_trains_quickly_and_reloads_with_auto_tokenizer(saved, family):
    output_dir, seconds = saved[family]
    assert seconds < 10
    tokenizer = AutoTokenizer.from_pretrained(output_dir)  # the suite runs with HF_HUB_OFFLINE=1
    assert len(tokenizer) == 500
    assert {token: tokenizer.convert_tokens_to_ids(token) for token in EXPECTED_IDS[family]} == EXPECTED_IDS[family]
    for role, token in SPECIAL_TOKENS[family].items():
        assert getattr(tokenizer, role) == token


@pytest.mark.parametrize("family", ["decoder", "seq2seq"])
def test_byte_level_tokenizers_round_trip_losslessly(saved, family):
    tokenizer = AutoTokenizer.from_pretrained(saved[family][0])
    ids = tokenizer(SNIPPET)["input_ids"]
    assert tokenizer.unk_token_id not in ids  # every byte is in the alphabet
    assert tokenizer.decode(ids, skip_special_tokens=True) == SNIPPET
    if family == "decoder":
        assert tokenizer.decode(ids) == SNIPPET  # no special tokens added: packing places </s> itself
    else:
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        pair = tokenizer("first", "second")["input_ids"]
        assert tokenizer.convert_ids_to_tokens(pair).count("</s>") == 3  # <s> A </s></s> B </s>, as BART
        assert "token_type_ids" not in tokenizer("first")
        # <mask> swallows the space before it, as BART's does.
        assert tokenizer("a <mask> b")["input_ids"][1:3] == [tokenizer.convert_tokens_to_ids("a"), 4]


def test_encoder_adds_cls_sep_and_token_types(saved):
    tokenizer = AutoTokenizer.from_pretrained(saved["encoder"][0])
    encoded = tokenizer(SNIPPET.replace("é, 中", "done"))  # ASCII: WordPiece only knows characters it trained on
    ids = encoded["input_ids"]
    assert ids[0] == 2 and ids[-1] == 3 and 1 not in ids
    # Same text up to whitespace: the BERT pre-tokenizer splits on spaces and punctuation (WordPiece is not lossless).
    assert "".join(tokenizer.decode(ids, skip_special_tokens=True).split()) == "".join(
        SNIPPET.replace("é, 中", "done").split()
    )
    pair = tokenizer("first part", "second part")
    tokens = tokenizer.convert_ids_to_tokens(pair["input_ids"])
    first_sep = tokens.index("[SEP]")
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and tokens.count("[SEP]") == 2
    assert pair["token_type_ids"] == [0] * (first_sep + 1) + [1] * (len(tokens) - first_sep - 1)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_token_config_kwargs_match_the_family_config(saved, family):
    tokenizer = AutoTokenizer.from_pretrained(saved[family][0])
    kwargs = token_config_kwargs(tokenizer, family)
    config = CONFIGS[family](**kwargs)
    assert config.vocab_size == len(tokenizer) and config.pad_token_id == tokenizer.pad_token_id
    defaults = CONFIGS[family]()
    # The tokenizer layouts were chosen to equal each config's defaults, so an untouched config already agrees.
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        defaults.pad_token_id,
        defaults.bos_token_id,
        defaults.eos_token_id,
    )
    if family == "seq2seq":
        assert config.decoder_start_token_id == tokenizer.eos_token_id == 2


def test_bad_family_and_tiny_vocab_are_rejected(texts):
    with pytest.raises(ValueError, match="Unknown family 'gpt'"):
        train_tokenizer("gpt", texts, 500)
    with pytest.raises(ValueError, match="must exceed 260"):
        train_tokenizer("decoder", texts, 260)


def test_a_generator_of_texts_trains_the_encoder_tokenizer_its_list_trains(texts):
    # WordPiece reads its texts twice (its `##` pieces first), so a one-shot generator must not run dry after one pass.
    from_list = train_tokenizer("encoder", texts, vocab_size=500)
    from_generator = train_tokenizer("encoder", (text for text in texts), vocab_size=500)
    assert len(from_list) == 500 and from_generator.get_vocab() == from_list.get_vocab()


# Trains every family's tokenizer on the test corpus: {family: [vocabulary, ids of SNIPPET and 8 documents]}, printed
# as JSON by a child process.
TRAIN_EVERY_FAMILY = f"""
from coreformer.training.data import iter_texts, load_embedded_corpus
from coreformer.training.tokenizer_training import train_tokenizer
texts = list(iter_texts(load_embedded_corpus(seed=0, max_documents=40)["train"]))
tokenizers = {{family: train_tokenizer(family, texts, vocab_size=500) for family in {list(FAMILY_NAMES)!r}}}
trained = {{f: [t.get_vocab(), t([{SNIPPET!r}, *texts[:8]]).input_ids] for f, t in tokenizers.items()}}
"""


def trained_here(code: str) -> object:
    """`code` run in this process; returns the `trained` it defines."""
    namespace: dict = {}
    exec(code, namespace)
    return namespace["trained"]


@pytest.mark.slow
def test_every_family_trains_the_same_tokenizer_in_every_process():
    # tokenizers seeds its hash maps per process, and its WordPiece trainer numbers the `##` pieces (and so breaks merge
    # ties) in hash order unless told otherwise; a pretraining run from scratch needs the same ids in every process.
    # A fresh process (tokenizers' own hash seeds, and Python's other than this process's) against this one.
    python_hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONHASHSEED"] = python_hash_seed
    child = TRAIN_EVERY_FAMILY + "import json\nprint(json.dumps(trained))\n"
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    first = json.loads(json.dumps(trained_here(TRAIN_EVERY_FAMILY)))  # the JSON round trip the child's answer took
    second = json.loads(result.stdout)
    for family in FAMILY_NAMES:
        assert first[family][0] == second[family][0], f"{family}: the vocabularies differ"
        assert first[family][1] == second[family][1], f"{family}: the encodings differ"
