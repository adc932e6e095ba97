"""Pretraining data: the embedded corpus, text loading errors, and the MLM / packed causal LM / denoising collators."""

import json
from collections import Counter

import datasets
import pytest
import torch
from tiny import tiny_config
from transformers import AutoTokenizer
from transformers.masking_utils import find_packed_sequence_indices

import coreformer as cf
from coreformer.training.data import iter_texts, load_embedded_corpus, load_text_dataset, tokenize_dataset
from coreformer.training.objectives.causal_lm import PackedCausalLMCollator, pack_into_blocks
from coreformer.training.objectives.denoising import DenoisingCollator, infill_spans, permute_sentences
from coreformer.training.objectives.masked_lm import MaskedLMCollator
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer

datasets.disable_progress_bars()

# Ids shaped like the trained tokenizers': a few special ids first, ordinary tokens above them.
VOCAB = 100
PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4  # encoder layout
BOS, EOS = 1, 2  # decoder layout (pad 0)


# ---------------------------------------------------------------------------------------------------------------------
# Embedded corpus and load_text_dataset
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> datasets.DatasetDict:
    return load_embedded_corpus(seed=0)


def test_embedded_corpus_is_deterministic_per_seed(corpus):
    again = load_embedded_corpus(seed=0)
    other = load_embedded_corpus(seed=1)
    assert list(again["train"]["path"]) == list(corpus["train"]["path"])
    assert list(again["validation"]["text"]) == list(corpus["validation"]["text"])
    assert list(other["validation"]["path"]) != list(corpus["validation"]["path"])
    assert sorted(list(other["train"]["path"]) + list(other["validation"]["path"])) == sorted(
        list(corpus["train"]["path"]) + list(corpus["validation"]["path"])
    )  # another seed reorders and re-splits the same documents


def test_embedded_corpus_splits_by_document_without_overlap(corpus):
    train, validation = set(corpus["train"]["path"]), set(corpus["validation"]["path"])
    assert len(train) > 100 and len(validation) > 5
    assert not train & validation
    assert not set(corpus["train"]["text"]) & set(corpus["validation"]["text"])
    assert len(validation) == round(0.05 * (len(train) + len(validation)))
    assert all(text.strip() for text in corpus["validation"]["text"])
    for path in train | validation:
        parts = path.split("/")
        assert parts[-1].endswith(".py")
        assert not {"site-packages", "test", "tests", "idle_test", "encodings"} & set(parts[:-1]), path


def test_embedded_corpus_max_documents_is_a_seeded_sample():
    small = load_embedded_corpus(seed=3, max_documents=20, validation_fraction=0.1)
    assert (len(small["train"]), len(small["validation"])) == (18, 2)
    again = load_embedded_corpus(seed=3, max_documents=20, validation_fraction=0.1)
    assert list(again["train"]["path"]) == list(small["train"]["path"])
    texts = iter_texts(small["train"], batch_size=7)
    assert list(texts) == list(texts) == list(small["train"]["text"])  # re-iterable: WordPiece training reads it twice


def test_load_text_dataset_none_is_the_embedded_corpus():
    loaded, embedded = load_text_dataset(None, max_documents=10), load_embedded_corpus(max_documents=10)
    assert list(loaded["train"]["path"]) == list(embedded["train"]["path"])


@pytest.mark.parametrize("extension", ["jsonl", "csv", "txt", "parquet"])
def test_load_text_dataset_reads_local_files(tmp_path, extension):
    rows = [f"document number {i}" for i in range(20)]
    path = tmp_path / f"data.{extension}"
    if extension == "jsonl":
        path.write_text("".join(json.dumps({"body": row, "id": i}) + "\n" for i, row in enumerate(rows)))
    elif extension == "csv":
        path.write_text("id,body\n" + "".join(f"{i},{row}\n" for i, row in enumerate(rows)))
    elif extension == "txt":
        path.write_text("\n\n".join(rows) + "\n")  # blank lines between documents are dropped
    else:
        datasets.Dataset.from_dict({"body": rows}).to_parquet(str(path))
    column = "text" if extension == "txt" else "body"
    loaded = load_text_dataset(str(path), column, validation_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    assert loaded["train"].column_names == ["text"]
    assert (len(loaded["train"]), len(loaded["validation"])) == (18, 2)
    assert sorted(list(loaded["train"]["text"]) + list(loaded["validation"]["text"])) == sorted(rows)


def test_load_text_dataset_rejects_bad_sources_with_one_clear_error(tmp_path):
    cache = {"cache_dir": str(tmp_path / "cache")}
    with pytest.raises(ValueError, match="does not exist"):
        load_text_dataset(str(tmp_path / "missing.jsonl"), **cache)
    unknown = tmp_path / "data.xyz"
    unknown.write_text("some text\n")
    with pytest.raises(ValueError, match="unknown extension '.xyz'"):
        load_text_dataset(str(unknown), **cache)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_text_dataset(str(empty), **cache)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    with pytest.raises(ValueError, match="no non-blank text"):
        load_text_dataset(str(blank), **cache)
    wrong_column = tmp_path / "data.jsonl"
    wrong_column.write_text('{"body": "a", "title": "b"}\n')
    with pytest.raises(ValueError, match=r"no column 'text'; its columns are \['body', 'title'\]"):
        load_text_dataset(str(wrong_column), **cache)


# ---------------------------------------------------------------------------------------------------------------------
# MLM collator
# ---------------------------------------------------------------------------------------------------------------------


def _encoder_examples(rows: int = 40, length: int = 600, seed: int = 0) -> list[dict[str, list[int]]]:
    """`[CLS] tokens [SEP]` of decreasing length, so the batch has padding too."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for row in range(rows):
        body = torch.randint(MASK + 1, VOCAB, (length - 2 - 5 * row,), generator=generator).tolist()
        examples.append({"input_ids": [CLS, *body, SEP]})
    return examples


def _mlm_collator(**overrides) -> MaskedLMCollator:
    fields = dict(
        mask_token_id=MASK, pad_token_id=PAD, vocab_size=VOCAB, special_token_ids=(PAD, UNK, CLS, SEP, MASK), seed=0
    )
    return MaskedLMCollator(**{**fields, **overrides})


def test_mlm_masks_15_percent_as_80_10_10():
    examples = _encoder_examples()
    original = _mlm_collator(mlm_probability=0.0)(examples)["input_ids"]  # the padded batch, untouched
    batch = _mlm_collator()(examples)
    maskable = (original > MASK) & (batch["attention_mask"] == 1)
    selected = batch["labels"] != -100
    assert maskable.sum() > 20_000
    assert abs(selected.sum() / maskable.sum() - 0.15) < 0.01
    chosen = batch["input_ids"][selected]
    masked = (chosen == MASK).float().mean()
    unchanged = (chosen == original[selected]).float().mean()
    randomized = 1 - masked - unchanged
    # A random replacement can draw the original id back (1 in 95 here), which only blurs the last two by <0.2%.
    assert abs(masked - 0.8) < 0.03 and abs(randomized - 0.1) < 0.03 and abs(unchanged - 0.1) < 0.03
    assert ((chosen == MASK) | (chosen > MASK)).all()  # random replacements are never special ids


def test_mlm_never_selects_special_or_padding_and_labels_only_selected():
    examples = _encoder_examples(rows=8, length=64)
    original = _mlm_collator(mlm_probability=0.0)(examples)["input_ids"]
    batch = _mlm_collator(mlm_probability=0.9)(examples)
    selected = batch["labels"] != -100
    special = original <= MASK  # includes PAD
    assert not (selected & special).any()
    assert (batch["input_ids"][special] == original[special]).all()
    assert (batch["input_ids"][~selected] == original[~selected]).all()  # unselected tokens are never touched
    assert (batch["labels"][selected] == original[selected]).all()
    assert (batch["attention_mask"] == (original != PAD)).all()
    assert "token_type_ids" not in batch
    with_types = _mlm_collator(return_token_type_ids=True)(examples)
    assert (with_types["token_type_ids"] == 0).all() and with_types["token_type_ids"].shape == original.shape


def test_mlm_is_deterministic_per_seed():
    examples = _encoder_examples(rows=4, length=64)
    first, again, other = (
        _mlm_collator(seed=5)(examples),
        _mlm_collator(seed=5)(examples),
        _mlm_collator(seed=6)(examples),
    )
    assert torch.equal(first["input_ids"], again["input_ids"]) and torch.equal(first["labels"], again["labels"])
    assert not torch.equal(first["labels"], other["labels"])


# ---------------------------------------------------------------------------------------------------------------------
# Packing and the causal LM collator
# ---------------------------------------------------------------------------------------------------------------------


def _documents(count: int = 30, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 25, (count,), generator=generator)
    return [torch.randint(3, VOCAB, (int(n),), generator=generator).tolist() for n in lengths]


def test_data_preparation_progress_bars_say_what_they_do(tmp_path, capsys):
    source = tmp_path / "corpus.txt"
    source.write_text("def f():\n\n    return 1\n" * 20)
    datasets.enable_progress_bars()
    try:
        splits = load_text_dataset(str(source), validation_fraction=0.2)
        tokenizer = train_tokenizer("decoder", splits["train"]["text"], 300)
        tokenized = tokenize_dataset(splits["train"], tokenizer, add_special_tokens=False)
        pack_into_blocks(tokenized, 8, eos_token_id=tokenizer.eos_token_id)
        tokenize_dataset(splits["validation"], tokenizer, max_length=16)
    finally:
        datasets.disable_progress_bars()
    bars = capsys.readouterr().err
    for label in ("train: skip blank text", "tokenizing:", "packing into blocks of 8", "tokenizing into windows of 16"):
        assert label in bars
    assert "Map:" not in bars and "Filter:" not in bars


def test_the_same_tokenizer_from_another_folder_reads_the_cached_windows_and_any_change_tokenizes_again(tmp_path):
    # A text on disk is tokenized once whatever folder its tokenizer comes from (each rank's copy of the one the main
    # process trained, a checkpoint's on resume); another tokenizer, window or special-token setting is not served
    # the cached windows.
    texts = [f"def f{i}(x):\n    return x * {i} + len('{'abc' * i}')\n" * 8 for i in range(40)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    corpus, cache = str(tmp_path / "corpus.jsonl"), str(tmp_path / "cache")
    split = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
    trained = train_tokenizer("encoder", texts, 300)
    first = tokenize_dataset(split, trained, max_length=32)
    trained.save_pretrained(tmp_path / "rank-1")
    trained.model_max_length = 64  # what a run folder's (and so a checkpoint's) tokenizer carries
    trained.save_pretrained(tmp_path / "checkpoint")
    for folder in ("rank-1", "checkpoint"):
        again = tokenize_dataset(split, AutoTokenizer.from_pretrained(tmp_path / folder), max_length=32)
        assert first.cache_files and again.cache_files == first.cache_files, folder
        assert again["input_ids"] == first["input_ids"]
    other = train_tokenizer("encoder", [text.upper() for text in texts], 300)  # other merges
    for changed in (
        tokenize_dataset(split, other, max_length=32),
        tokenize_dataset(split, trained, max_length=16),
        tokenize_dataset(split, trained, max_length=32, add_special_tokens=False),
        tokenize_dataset(split, trained),
    ):
        assert changed.cache_files != first.cache_files and changed["input_ids"] != first["input_ids"]


@pytest.mark.parametrize("family", ["encoder", "seq2seq"])
def test_windows_keep_every_token_of_a_long_document_each_between_the_special_tokens(family, corpus, caplog):
    long_text = max(corpus["train"]["text"], key=len)
    tokenizer = train_tokenizer(family, [long_text], vocab_size=300, model_max_length=16)
    names = {"encoder": ("cls_token_id", "sep_token_id"), "seq2seq": ("bos_token_id", "eos_token_id")}[family]
    first, last = (getattr(tokenizer, name) for name in names)
    ids = tokenizer(long_text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
    documents = datasets.Dataset.from_dict({"text": [long_text, "x = 1"]})
    windows = tokenize_dataset(documents, tokenizer, max_length=16)["input_ids"]
    assert "longer than the specified maximum sequence length" not in caplog.text  # windowed: nothing to warn of
    assert len(ids) > 100 * 14  # a document of many windows
    assert len(windows) == -(-len(ids) // 14) + 1  # 14 ids between the two special tokens; the short text: one
    assert all(len(window) <= 16 and window[0] == first and window[-1] == last for window in windows)
    assert [token for window in windows[:-1] for token in window[1:-1]] == ids
    with pytest.raises(ValueError, match="leave no room beside the tokenizer's 2 special tokens"):
        tokenize_dataset(documents, tokenizer, max_length=2)


@pytest.mark.parametrize("batch_size", [1000, 7])
def test_packing_fills_every_block_and_loses_only_the_tail(batch_size):
    documents = _documents()
    block_size = 16
    packed = pack_into_blocks(
        datasets.Dataset.from_dict({"input_ids": documents, "text": ["x"] * len(documents)}),
        block_size,
        eos_token_id=EOS,
        batch_size=batch_size,
    )
    assert packed.column_names == ["input_ids"]
    assert all(len(block) == block_size for block in packed["input_ids"])
    # Each map batch of documents is its own stream; the blocks are that stream's prefix, short of < 1 block.
    blocks = iter(list(packed["input_ids"]))
    for start in range(0, len(documents), batch_size):
        stream = [token for document in documents[start : start + batch_size] for token in (*document, EOS)]
        full = len(stream) // block_size
        assert [token for _ in range(full) for token in next(blocks)] == stream[: full * block_size]
    assert next(blocks, None) is None


def test_packed_position_ids_restart_after_eos_as_transformers_reads_them():
    documents = _documents(count=12)
    packed = pack_into_blocks(datasets.Dataset.from_dict({"input_ids": documents}), 20, eos_token_id=EOS)
    batch = PackedCausalLMCollator(eos_token_id=EOS, return_position_ids=True)([packed[i] for i in range(4)])
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: the packing signal is positions
    assert torch.equal(batch["labels"], batch["input_ids"])
    ids, positions = batch["input_ids"], batch["position_ids"]
    assert (positions[:, 0] == 0).all()
    after_eos = ids[:, :-1] == EOS
    assert (positions[:, 1:][after_eos] == 0).all()
    assert (positions[:, 1:][~after_eos] == positions[:, :-1][~after_eos] + 1).all()
    # transformers' own reading: a new document index exactly where a new document starts.
    documents_index = find_packed_sequence_indices(positions)
    assert torch.equal(documents_index[:, 1:] != documents_index[:, :-1], after_eos)
    assert "position_ids" not in PackedCausalLMCollator(eos_token_id=EOS)([packed[0]])


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_documents_score_as_if_alone(attn_implementation):
    """With restarting position_ids, the decoder gives each packed document the logits it gets alone."""
    torch.manual_seed(0)
    config = tiny_config("decoder", position_embedding_type="rotary", vocab_size=VOCAB)
    model = cf.CoreformerDecoderForCausalLM(config).eval()
    model.set_attn_implementation(attn_implementation)
    first, second = [5, 6, 7, 8, EOS], [9, 10, 11, 12, 13, EOS]
    batch = PackedCausalLMCollator(eos_token_id=EOS, return_position_ids=True)([{"input_ids": first + second}])
    with torch.no_grad():
        # No cache: transformers only reads packed position_ids in a cache-free (training-like) forward.
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        alone = model(input_ids=torch.tensor([second])).logits
    torch.testing.assert_close(packed[:, len(first) :], alone, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# BART denoising
# ---------------------------------------------------------------------------------------------------------------------

S_BOS, S_PAD, S_EOS, S_MASK = 0, 1, 2, 4  # seq2seq layout
STOP = 5  # the "full stop" token of these tests


def _denoising_collator(**overrides) -> DenoisingCollator:
    fields = dict(
        mask_token_id=S_MASK, pad_token_id=S_PAD, bos_token_id=S_BOS, eos_token_id=S_EOS, sentence_end_ids=(STOP,)
    )
    return DenoisingCollator(**{**fields, **overrides})


def _sentences_example(sentences: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    body = []
    for length in torch.randint(2, 9, (sentences,), generator=generator).tolist():
        body += [*torch.randint(STOP + 1, VOCAB, (length,), generator=generator).tolist(), STOP]
    return [S_BOS, *body, S_EOS]


def _sentences(ids: list[int]) -> Counter:
    """The multiset of STOP-terminated sentences."""
    found, current = Counter(), []
    for token in ids:
        current.append(token)
        if token == STOP:
            found[tuple(current)] += 1
            current = []
    return found + Counter([tuple(current)] if current else [])


def test_infilling_hides_the_target_fraction_in_poisson_spans():
    generator = torch.Generator().manual_seed(0)
    hidden, spans, originals, sources = 0, 0, 0, 0
    for _ in range(100):
        ids = torch.randint(STOP + 1, VOCAB, (200,), generator=generator)
        source = infill_spans(ids, mask_token_id=S_MASK, mask_ratio=0.3, poisson_lambda=3.0, generator=generator)
        masks = int((source == S_MASK).sum())
        kept = source[source != S_MASK]
        hidden += len(ids) - len(kept)
        spans += masks
        originals += len(ids)
        sources += len(source)
        # The kept tokens are the original ones, in order: a subsequence.
        position = 0
        for token in kept.tolist():
            while ids[position] != token:
                position += 1
            position += 1
    assert abs(hidden / originals - 0.3) < 0.01
    assert 2.5 < hidden / spans < 3.2  # mean span length ~ lambda (trimming the last span shortens it a little)
    assert sources == originals - hidden + spans < originals  # each span collapsed into one mask: shorter source


def test_zero_length_spans_insert_masks():
    ids = torch.arange(STOP + 1, STOP + 101)
    generator = torch.Generator().manual_seed(0)
    source = infill_spans(ids, mask_token_id=S_MASK, mask_ratio=0.1, poisson_lambda=0.05, generator=generator)
    masks = int((source == S_MASK).sum())
    assert len(source) - masks == 90  # exactly ceil(0.1 * 100) tokens hidden
    assert masks > 10  # most spans are empty: insertions on top of the 10 hidden tokens
    assert len(source) > len(ids)


def test_sentence_permutation_preserves_the_multiset_of_sentences():
    ids = torch.tensor(_sentences_example(12, seed=0)[1:-1])
    generator = torch.Generator().manual_seed(0)
    permuted = permute_sentences(ids, torch.tensor([STOP]), generator)
    assert _sentences(permuted.tolist()) == _sentences(ids.tolist())
    assert not torch.equal(permuted, ids)


def test_denoising_collator_returns_source_and_original_labels():
    examples = [{"input_ids": _sentences_example(10 + i, seed=i)} for i in range(6)]
    batch = _denoising_collator(seed=0)(examples)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}  # the model shifts labels into decoder inputs
    for row, example in enumerate(examples):
        original = example["input_ids"]
        labels = batch["labels"][row]
        assert labels[: len(original)].tolist() == original and (labels[len(original) :] == -100).all()
        source = batch["input_ids"][row][batch["attention_mask"][row] == 1]
        assert (batch["input_ids"][row][batch["attention_mask"][row] == 0] == S_PAD).all()
        assert source[0] == S_BOS and source[-1] == S_EOS and (source[1:-1] != S_EOS).all()
        assert S_MASK in source and len(source) < len(original)
    again = _denoising_collator(seed=0)(examples)
    assert torch.equal(again["input_ids"], batch["input_ids"])
    assert not torch.equal(_denoising_collator(seed=1)(examples)["input_ids"], batch["input_ids"])


def test_permutation_only_keeps_every_token():
    example = _sentences_example(15, seed=3)
    batch = _denoising_collator(mask_ratio=0.0, seed=0)([{"input_ids": example}])
    source = batch["input_ids"][0].tolist()
    assert source[0] == S_BOS and source[-1] == S_EOS and source != example
    assert _sentences(source[1:-1]) == _sentences(example[1:-1])
    assert batch["labels"][0].tolist() == example


# ---------------------------------------------------------------------------------------------------------------------
# End to end: tokenizer -> dataset -> collator -> model loss, per family
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["encoder", "decoder", "seq2seq"])
def test_each_family_trains_on_its_collated_batches(family, corpus):
    small = datasets.Dataset.from_dict({"text": list(corpus["train"]["text"])[:8]})
    tokenizer = train_tokenizer(family, iter_texts(small), vocab_size=400)
    config_kwargs = {**token_config_kwargs(tokenizer, family), "max_position_embeddings": 64}
    torch.manual_seed(0)
    if family == "decoder":
        blocks = pack_into_blocks(
            tokenize_dataset(small, tokenizer, add_special_tokens=False), 64, eos_token_id=tokenizer.eos_token_id
        )
        collator = PackedCausalLMCollator(eos_token_id=tokenizer.eos_token_id, return_position_ids=True)
        model = cf.CoreformerDecoderForCausalLM(tiny_config(family, **config_kwargs))
        examples = [blocks[i] for i in range(4)]
    else:
        windows = tokenize_dataset(small, tokenizer, max_length=64)
        examples = [windows[i] for i in range(4)]
        if family == "encoder":
            collator = MaskedLMCollator.from_tokenizer(tokenizer, seed=0)
            model = cf.CoreformerEncoderForMaskedLM(tiny_config(family, **config_kwargs))
        else:
            collator = DenoisingCollator.from_tokenizer(tokenizer, seed=0)
            model = cf.CoreformerSeq2SeqForConditionalGeneration(tiny_config(family, **config_kwargs))
    loss = model(**collator(examples)).loss
    loss.backward()
    assert torch.isfinite(loss) and 4.0 < loss.item() < 8.0  # ~ln(400) at init
