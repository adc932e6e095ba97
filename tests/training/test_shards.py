"""Tests of coreformer.training.shards (`coreformer tokenize`'s work): the shards hold each document's tokenizer ids
between exact boundaries, in the narrowest dtype; the held-out split is stable and disjoint from training; a rerun
after a lost, damaged or interrupted shard writes the files of a run never stopped; two processes write the bytes of
one; shards of another tokenizer are refused naming both. Tiny corpora and a 300-id tokenizer: seconds in all."""

import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from coreformer.training import shards
from coreformer.training.shards import ShardedTokens, check_tokenizer, token_dtype, tokenizer_hash, write_shards
from coreformer.training.tokenizer_training import train_tokenizer
from coreformer_settings.tokenizing import ShardsError, TokenizeSettings

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _lines(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Three .txt files (blank lines between some documents, which are not documents) and a .jsonl file."""
    folder = tmp_path_factory.mktemp("corpus")
    for index in range(3):
        lines = _lines(index, 80)
        (folder / f"part-{index}.txt").write_text(
            "\n".join(line + ("\n" if i % 7 == 0 else "") for i, line in enumerate(lines)) + "\n"
        )
    rows = [{"body": line, "id": i} for i, line in enumerate(_lines(9, 40))]
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.fixture(scope="module")
def tokenizer_folders(tmp_path_factory) -> dict[str, Path]:
    """A decoder tokenizer saved twice (the same content in two folders) and another trained on other text."""
    folders = {}
    texts = _lines(0, 200)
    for name, train_on in (("tok", texts), ("tok-copy", texts), ("other", [text.upper() for text in texts])):
        folders[name] = tmp_path_factory.mktemp(name)
        train_tokenizer("decoder", train_on, 300).save_pretrained(folders[name])
    return folders


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folders):
    return AutoTokenizer.from_pretrained(tokenizer_folders["tok"])


def _settings(corpus: Path, out: Path, **overrides) -> TokenizeSettings:
    values = dict(source=str(corpus / "*.txt"), out=str(out), tokenizer="tok", shard_tokens=400)
    return TokenizeSettings(**{**values, **overrides})


def _documents(corpus: Path) -> list[str]:
    """The documents as the format promises them, read without `datasets`: each non-blank line, files in name order."""
    return [line for path in sorted(corpus.glob("*.txt")) for line in path.read_text().splitlines() if line.strip()]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (the tokenizer's copy included) by its relative path."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_shards_hold_each_documents_ids_between_exact_boundaries(corpus, tokenizer, tmp_path):
    manifest = write_shards(_settings(corpus, tmp_path / "out"), tokenizer, progress=False)
    train, validation = ShardedTokens(tmp_path / "out"), ShardedTokens(tmp_path / "out", "validation")
    expected = [_ids(tokenizer, text) for text in _documents(corpus)]
    # Each split keeps the source's order; together they are every document once.
    got = {"train": [list(doc) for doc in (train[i] for i in range(len(train)))], "validation": []}
    got["validation"] = [list(validation[i]) for i in range(len(validation))]
    heads = {"train": 0, "validation": 0}
    for ids in expected:
        split = "train" if got["train"][heads["train"] : heads["train"] + 1] == [ids] else "validation"
        assert got[split][heads[split]] == ids
        heads[split] += 1
    assert heads == {"train": len(got["train"]), "validation": len(got["validation"])} and heads["validation"] > 0
    assert manifest["documents"] == len(expected) and manifest["tokens"] == sum(map(len, expected))

    # The raw format, read without ShardedTokens: ids back to back, .idx the cumulative ends; whole documents per
    # shard, each shard closed at the first document that takes it to --shard-tokens.
    out, records = tmp_path / "out", manifest["splits"]["train"]["shards"]
    assert len(records) > 2
    stream, position = [], 0
    for shard in records:
        ids = np.fromfile(out / shard["file"], dtype="<u2")
        ends = np.fromfile(out / shard["index"], dtype="<u8")
        documents = got["train"][position : position + len(ends)]
        assert ids.tolist() == sum(documents, []) and ends.tolist() == np.cumsum([len(d) for d in documents]).tolist()
        assert shard is records[-1] or ends[-2] < 400 <= ends[-1]
        stream += ids.tolist()
        position += len(ends)
    # A reader pickles without its maps (a DataLoader worker opens its own), not with a copy of the ids.
    assert (
        len(pickle.dumps(train)) < 4 * manifest["tokens"]
        and list(pickle.loads(pickle.dumps(train))[5]) == got["train"][5]
    )
    # Windows run across shards; document starts are the boundaries inside them.
    starts = np.cumsum([0] + [len(d) for d in got["train"]])[:-1]
    for index in (0, 3, train.num_windows(97) - 1):
        assert train.window(index, 97).tolist() == stream[index * 97 : (index + 1) * 97]
        inside = starts[(starts >= index * 97) & (starts < (index + 1) * 97)]
        assert train.document_starts(index * 97, (index + 1) * 97).tolist() == inside.tolist()


def test_a_jsonl_source_reads_rows_of_the_text_column(corpus, tokenizer, tmp_path):
    settings = _settings(corpus, tmp_path / "out", source=str(corpus / "rows.jsonl"), text_column="text")
    with pytest.raises(ShardsError, match=r"no column 'text'; its columns are \['body', 'id'\]"):
        write_shards(settings, tokenizer, progress=False)
    assert not (tmp_path / "out").exists()  # nothing written, so the rerun below is not refused as another recipe
    settings = _settings(corpus, tmp_path / "out", source=str(corpus / "rows.jsonl"), text_column="body")
    write_shards(settings, tokenizer, progress=False)
    rows = [json.loads(line)["body"] for line in (corpus / "rows.jsonl").read_text().splitlines()]
    documents = [list(doc) for split in ("train", "validation") for doc in ShardedTokens(tmp_path / "out", split)]
    assert sorted(documents) == sorted(_ids(tokenizer, row) for row in rows)


def test_token_dtype_is_uint16_while_every_id_fits_and_uint32_beyond():
    assert token_dtype(300) == np.dtype("<u2") and token_dtype(65536) == np.dtype("<u2")  # ids 0 .. 65535
    assert token_dtype(65537) == np.dtype("<u4") and token_dtype(2**32) == np.dtype("<u4")
    with pytest.raises(ShardsError, match="does not fit in uint32"):
        token_dtype(2**32 + 1)


def test_a_vocabulary_beyond_uint16_writes_and_reads_uint32(corpus, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "vocabulary_size", lambda tokenizer: 70_000)
    manifest = write_shards(_settings(corpus, tmp_path / "out"), tokenizer, progress=False)
    tokens = ShardedTokens(tmp_path / "out")
    assert manifest["dtype"] == "uint32" and tokens.dtype == np.dtype("<u4")
    first = manifest["splits"]["train"]["shards"][0]
    assert (tmp_path / "out" / first["file"]).stat().st_size == 4 * first["tokens"]
    assert list(tokens[0]) == _ids(tokenizer, _documents(corpus)[0])


def test_the_held_out_split_is_stable_across_runs_and_disjoint_from_training(corpus, tokenizer, tmp_path):
    def split_documents(out: Path, **overrides) -> dict[str, set]:
        write_shards(_settings(corpus, out, validation_fraction=0.2, **overrides), tokenizer, progress=False)
        return {split: {tuple(doc) for doc in ShardedTokens(out, split)} for split in ("train", "validation")}

    first = split_documents(tmp_path / "a")
    again = split_documents(tmp_path / "b", shard_tokens=150, num_proc=2)  # other shards, other processes
    assert first == again
    assert not first["train"] & first["validation"]
    assert 0.1 < len(first["validation"]) / (len(first["train"]) + len(first["validation"])) < 0.3
    assert split_documents(tmp_path / "c", seed=1)["validation"] != first["validation"]  # the seed salts the hash


@pytest.fixture(scope="module")
def reference(corpus, tokenizer, tmp_path_factory) -> Path:
    """The shards of a run never stopped."""
    out = tmp_path_factory.mktemp("reference") / "out"
    write_shards(_settings(corpus, out), tokenizer, progress=False)
    return out


def _count_tokenized(monkeypatch) -> list[int]:
    counted = []
    encode = shards.Encoder.__call__
    monkeypatch.setattr(
        shards.Encoder, "__call__", lambda self, texts: counted.append(len(texts)) or encode(self, texts)
    )
    return counted


@pytest.mark.parametrize("damage", ["deleted", "corrupted", "truncated"])
def test_a_rerun_after_a_lost_or_damaged_shard_writes_the_same_files(
    corpus, tokenizer, reference, tmp_path, monkeypatch, damage
):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    manifest = json.loads((out / "manifest.json").read_text())
    last = manifest["splits"]["train"]["shards"][-2]["file"]  # a shard before the split's last
    if damage == "deleted":
        (out / last).unlink()
    elif damage == "corrupted":
        data = bytearray((out / last).read_bytes())
        data[10] ^= 1  # one bit: the size still matches, the checksum does not
        (out / last).write_bytes(bytes(data))
    else:
        (out / last).write_bytes((out / last).read_bytes()[:-2])
    tokenized = _count_tokenized(monkeypatch)
    write_shards(_settings(corpus, out), tokenizer, progress=False)
    assert _files(out) == _files(reference)
    assert 0 < sum(tokenized) < manifest["documents"]  # resumed: the shards before it were not tokenized again


def test_a_run_interrupted_mid_shard_resumes_to_the_same_files(corpus, tokenizer, reference, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "CHUNK_DOCUMENTS", 16)  # several chunks, so the stop falls between them
    append, calls = shards._append, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        append(*args)

    monkeypatch.setattr(shards, "_append", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        write_shards(_settings(corpus, out), tokenizer, progress=False)
    assert any(path.name.endswith(".tmp") for path in out.iterdir())  # a shard was open
    stopped = json.loads((out / "manifest.json").read_text())
    assert not stopped["complete"] and stopped["splits"]["train"]["shards"]
    monkeypatch.setattr(shards, "_append", append)
    write_shards(_settings(corpus, out), tokenizer, progress=False)
    assert _files(out) == _files(reference)


def test_two_processes_write_the_same_bytes_as_one(corpus, tokenizer, reference, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "CHUNK_DOCUMENTS", 8)  # many chunks in flight, finishing in any order
    write_shards(_settings(corpus, tmp_path / "out", num_proc=2), tokenizer, progress=False)
    assert _files(tmp_path / "out") == _files(reference)


def test_shards_of_another_tokenizer_are_refused_naming_both(corpus, tokenizer_folders, reference, tmp_path):
    manifest = json.loads((reference / "manifest.json").read_text())
    copy = AutoTokenizer.from_pretrained(tokenizer_folders["tok-copy"])
    copy("a b", truncation=True, max_length=1)  # leaves truncation set on the backend: call state, not content
    check_tokenizer(manifest, copy)  # the same tokenizer from another folder
    assert tokenizer_hash(copy) == manifest["tokenizer"]["hash"]

    other = AutoTokenizer.from_pretrained(tokenizer_folders["other"])
    with pytest.raises(ShardsError) as refused:
        check_tokenizer(reference, other, name="other-tokenizer")
    message = str(refused.value)
    assert "'tok'" in message and "'other-tokenizer'" in message and tokenizer_hash(other)[:19] in message
    with pytest.raises(ShardsError, match="made by tokenizer 'tok'"):
        ShardedTokens(reference, tokenizer=other)

    out = tmp_path / "out"
    shutil.copytree(reference, out)
    with pytest.raises(ShardsError, match="made by tokenizer 'tok' .*, not by 'other'"):
        write_shards(_settings(corpus, out, tokenizer="other"), other, progress=False)
    assert _files(out) == _files(reference)  # refused before anything was touched


def test_a_rerun_with_other_settings_or_changed_files_is_refused_naming_both(corpus, tokenizer, reference, tmp_path):
    with pytest.raises(ShardsError, match="tokenized with --shard-tokens 400, not 150: rerun with --shard-tokens 400"):
        write_shards(_settings(corpus, reference, shard_tokens=150), tokenizer, progress=False)
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    write_shards(_settings(copy, tmp_path / "out"), tokenizer, progress=False)
    with open(copy / "part-1.txt", "a") as grown:
        grown.write("one more document\n")
    with pytest.raises(ShardsError, match=r"files of .* changed since .*part-1.txt: \d+ -> \d+ bytes"):
        write_shards(_settings(copy, tmp_path / "out"), tokenizer, progress=False)
