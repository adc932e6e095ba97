"""Pretraining on token shards (`--data-dir`, coreformer.training.shard_examples): each objective's rows built from the
shards equal the rows its text path builds from the same documents, for every packing; a run trains on them with the
tokenizer saved beside them, and one stopped after a checkpoint resumes to the uninterrupted run's weights bit for
bit; ranks read disjoint shares whose union is the one-process run's; the held-out documents never reach training;
bad inputs are refused in one line. Tiny corpus (300 lines), 300-id tokenizers, blocks of 16: seconds in all."""

import random
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
from ranks import pretraining_killed_at_step
from safetensors.torch import load_file

import coreformer_cli
from coreformer.training.batches import GlobalBatches, strided_loader
from coreformer.training.objectives import OBJECTIVES
from coreformer.training.objectives.causal_lm import pack_into_blocks
from coreformer.training.pretraining import prepare, run_pretraining
from coreformer.training.pretraining.run import PretrainingArguments
from coreformer.training.shard_examples import ShardBlocks
from coreformer.training.shards import ShardedTokens, is_held_out, tokenizer_hash, write_shards
from coreformer.training.tokenizer_training import train_tokenizer
from coreformer.training.zero_shot import held_out_texts
from coreformer_settings.base import PretrainingError
from coreformer_settings.tokenizing import MANIFEST, TOKENIZER_DIR, TokenizeSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the whole file

datasets.disable_progress_bars()

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
FRACTION, SEED = 0.2, 0
FAMILY_OF = {"masked-lm": "encoder", "electra": "encoder", "causal-lm": "decoder", "denoising": "seq2seq"}
OBJECTIVE_PACKINGS = [(name, packing) for name in FAMILY_OF for packing in OBJECTIVES[name].packings]


@pytest.fixture(scope="module")
def lines() -> list[str]:
    """Documents of 1 to 60 words: most fit a window of 16 ids, some take several (and an empty-ish one-word one)."""
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(300)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, lines) -> dict[str, Path]:
    """family -> a shard folder of `lines` made with that family's tokenizer (trained here, 300 ids)."""
    root = tmp_path_factory.mktemp("shards")
    source = root / "corpus.txt"
    source.write_text("\n".join(lines) + "\n")
    folders = {}
    for family in ("encoder", "decoder", "seq2seq"):
        tokenizer_folder = root / f"tokenizer-{family}"
        tokenizer = train_tokenizer(family, lines, 300)
        tokenizer.save_pretrained(tokenizer_folder)
        folders[family] = root / family
        settings = TokenizeSettings(
            source=str(source), out=str(folders[family]), tokenizer=str(tokenizer_folder), shard_tokens=900,
            validation_fraction=FRACTION, seed=SEED,
        )  # fmt: skip
        write_shards(settings, tokenizer, progress=False)
    return folders


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder / TOKENIZER_DIR)


def _rows(table, key: str = "input_ids") -> list[list[int]]:
    return [list(map(int, row)) for row in table[range(len(table))][key]]


@pytest.mark.parametrize(("objective", "packing"), OBJECTIVE_PACKINGS)
def test_each_objectives_rows_from_shards_equal_its_rows_from_the_same_text(shards, lines, objective, packing):
    spec = OBJECTIVES[objective]
    folder = shards[FAMILY_OF[objective]]
    tokenizer = _tokenizer(folder)
    args = SimpleNamespace(block_size=16, packing=packing)
    # the training split as text: the source's lines that the held-out rule leaves in, in order
    text = datasets.Dataset.from_dict({"text": [line for line in lines if not is_held_out(line, FRACTION, SEED)]})
    if packing == "concatenated":  # one map batch: the text path drops only the corpus' tail, as the shards do
        tokenized = datasets.Dataset.from_dict({"input_ids": [tokenizer(t, add_special_tokens=False)["input_ids"]
                                                              for t in text["text"]]})  # fmt: skip
        expected = pack_into_blocks(tokenized, 16, eos_token_id=tokenizer.eos_token_id, batch_size=len(text))
    else:
        expected = spec.examples(text, tokenizer, args)
    table = spec.sharded_examples(ShardedTokens(folder), tokenizer, args)

    assert len(table) == len(expected) > 10
    assert _rows(table) == [list(row) for row in expected["input_ids"]]
    if packing == "packed":
        assert _rows(table, "lengths") == [list(row) for row in expected["lengths"]]


def test_packed_rows_pack_each_run_of_windows_as_the_text_path_packs_each_map_batch(shards, lines, monkeypatch):
    """More windows than one run holds: the rows of each run of windows, in order, as `pack_windows` batch by batch."""
    import coreformer.training.shard_examples as shard_examples
    from coreformer.training.data import pack_windows

    monkeypatch.setattr(shard_examples, "PACK_WINDOWS", 50)
    tokenizer = _tokenizer(shards["encoder"])
    args = SimpleNamespace(block_size=16, packing="padded")
    text = datasets.Dataset.from_dict({"text": [line for line in lines if not is_held_out(line, FRACTION, SEED)]})
    windows = OBJECTIVES["masked-lm"].examples(text, tokenizer, args)
    expected = pack_windows(windows, 16, batch_size=50)
    table = OBJECTIVES["masked-lm"].sharded_examples(
        ShardedTokens(shards["encoder"]), tokenizer, SimpleNamespace(block_size=16, packing="packed")
    )
    assert len(windows) > 150
    assert _rows(table) == [list(row) for row in expected["input_ids"]]
    assert _rows(table, "lengths") == [list(row) for row in expected["lengths"]]


def test_blocks_cut_the_whole_stream_of_documents_and_separators(shards):
    tokens = ShardedTokens(shards["decoder"])
    stream = np.concatenate([np.append(tokens[i].astype(np.int64), -1) for i in range(len(tokens))])
    blocks = ShardBlocks(tokens, 7, separator=-1)
    assert len(blocks) == len(stream) // 7
    assert np.array_equal(np.concatenate(blocks[range(len(blocks))]["input_ids"]), stream[: len(blocks) * 7])


class _Reads:
    """Which split's documents a ShardedTokens reads: every `document(i)` call, by split."""

    def __init__(self, monkeypatch):
        self.documents: dict[str, set[int]] = {"train": set(), "validation": set()}
        original = ShardedTokens.document

        def document(tokens, index):
            self.documents[tokens.split].add(index)
            return original(tokens, index)

        monkeypatch.setattr(ShardedTokens, "document", document)


def run_settings(data_dir: Path, output_dir: Path, **overrides) -> PretrainingArguments:
    model = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    model.update(hidden_dropout=0.0, attention_dropout=0.0, num_hidden_layers=2)
    settings = dict(family="decoder", model=model, data_dir=str(data_dir), block_size=16, batch_size=8)
    settings.update(max_steps=20, lr=3e-3, warmup_steps=3, eval_every=10, eval_batches=2, save_every=0)
    settings.update(report_to="none", preset="tiny-test", zero_shot_pairs=0, output_dir=str(output_dir), threads=1)
    return PretrainingArguments(**{**settings, **overrides})


def test_held_out_documents_never_reach_training_and_the_shards_tokenizer_is_the_runs(shards, tmp_path, monkeypatch):
    reads = _Reads(monkeypatch)
    run = prepare(run_settings(shards["decoder"], tmp_path / "run", packing="packed"))
    assert tokenizer_hash(run.tokenizer) == tokenizer_hash(_tokenizer(shards["decoder"]))  # no --tokenizer given
    assert len(run.held_out) == 62  # the zero-shot report's text: every held-out document, decoded
    reads.documents = {"train": set(), "validation": set()}
    run.train_examples[range(len(run.train_examples))]
    assert reads.documents["validation"] == set()  # every training row comes from training documents only
    assert reads.documents["train"] == set(range(len(ShardedTokens(shards["decoder"]))))  # all of them
    run.eval_examples[range(len(run.eval_examples))]
    assert reads.documents["validation"] == set(range(len(ShardedTokens(shards["decoder"], "validation"))))
    train = {run.tokenizer.decode(ShardedTokens(shards["decoder"])[i]) for i in reads.documents["train"]}
    assert train.isdisjoint(run.held_out)


def test_ranks_read_disjoint_shares_whose_union_is_the_one_process_runs_batches(shards, monkeypatch):
    tokenizer = _tokenizer(shards["encoder"])
    args = SimpleNamespace(block_size=16, packing="padded")
    table = OBJECTIVES["masked-lm"].sharded_examples(ShardedTokens(shards["encoder"]), tokenizer, args)
    read: list[list[int]] = []
    original = type(table).row
    monkeypatch.setattr(type(table), "row", lambda self, index: read[-1].append(index) or original(self, index))

    def micro_batches(start: int, step: int, count: int) -> list:
        read.append([])
        settings = SimpleNamespace(mlm_probability=0.15)
        collator = OBJECTIVES["masked-lm"].collator(
            tokenizer, SimpleNamespace(**vars(args), seed=0, objective_settings=settings)
        )
        batches = GlobalBatches(table, collator, 4, seed=0, stream="train", shuffle=True)
        loader = iter(strided_loader(batches, start, step, num_workers=0, pin_memory=False))
        return [next(loader) for _ in range(count)]

    one = micro_batches(0, 1, 12)  # one process, 12 micro-batches
    ranks = [micro_batches(rank, 2, 6) for rank in range(2)]  # 2 ranks, 6 each
    single, rank0, rank1 = (set(rows) for rows in read)
    assert rank0.isdisjoint(rank1) and rank0 | rank1 == single and len(single) == 48
    interleaved = [batch for pair in zip(*ranks) for batch in pair]
    assert [g for g, _ in interleaved] == [g for g, _ in one] == list(range(12))
    assert all(torch.equal(a[key], b[key]) for (_, a), (_, b) in zip(interleaved, one) for key in a)


def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_weights(shards, tmp_path):
    uninterrupted = run_pretraining(run_settings(shards["decoder"], tmp_path / "whole", save_every=5))
    # killed (SIGKILL) after step 12, the checkpoint of step 10 saved
    pretraining_killed_at_step(run_settings(shards["decoder"], tmp_path / "stopped", save_every=5), 12, tmp_path)
    assert not (tmp_path / "stopped" / "config.json").exists()
    resumed = run_pretraining(
        run_settings(shards["decoder"], tmp_path / "stopped", save_every=5, resume_from_checkpoint="latest")
    )
    assert resumed["resumed_from"].endswith("step-10")
    assert [r["loss"] for r in resumed["history"]["train"]] == [r["loss"] for r in uninterrupted["history"]["train"]]
    final, reference = (
        load_file(tmp_path / "stopped" / "model.safetensors"),
        load_file(tmp_path / "whole" / "model.safetensors"),
    )
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)


def test_a_run_on_shards_scores_its_decoded_held_out_text(shards, tmp_path):
    metrics = run_pretraining(
        run_settings(shards["encoder"], tmp_path / "run", family="encoder", max_steps=4, zero_shot_pairs=4)
    )
    assert (
        metrics["zero_shot"]["data"]
        == f"the held-out split of the run's training text (the shards in {shards['encoder']})"
    )
    assert metrics["zero_shot"]["minimal_pairs"]["pairs"] == 4
    texts, described = held_out_texts(tmp_path / "run")  # what `coreformer evaluate` of the folder reads
    assert described == f"the held-out split of the run's shards ({shards['encoder']}), decoded" and len(texts) == 62


def test_bad_shard_inputs_are_refused_in_one_line(shards, tmp_path, capsys):
    other = tmp_path / "other-tokenizer"
    train_tokenizer("decoder", [w.upper() for w in WORDS] * 20, 300).save_pretrained(other)
    with pytest.raises(PretrainingError, match=r"the shards were made by tokenizer .* not by .*other-tokenizer"):
        prepare(run_settings(shards["decoder"], tmp_path / "a", tokenizer=str(other)))
    with pytest.raises(PretrainingError, match=r"--data-dir .* --dataset .*: drop --dataset, or drop --data-dir"):
        run_settings(shards["decoder"], tmp_path / "b", dataset="corpus.txt")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    manifest = (shards["decoder"] / MANIFEST).read_text().replace('"complete": true', '"complete": false')
    (unfinished / MANIFEST).write_text(manifest)
    refusals = {
        unfinished: "is not complete: `coreformer tokenize` stopped before its last shard",
        tmp_path / "nowhere": "no such folder",
        tmp_path: "holds no manifest.json",
    }
    for folder, refusal in refusals.items():
        command = ["pretrain", "--family", "decoder", "--data-dir", str(folder), "--output-dir", str(tmp_path / "c")]
        assert coreformer_cli.main(command) == 2
        assert refusal in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
