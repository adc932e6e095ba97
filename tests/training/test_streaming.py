"""Pretraining on a streamed source (`--streaming`, coreformer.training.streaming): every objective and packing
builds from each chunk the rows it builds from shards of the same documents; worker processes give the batches of
none; processes read disjoint shares (whole files when the files divide among them); held-out documents never reach
training; a run stopped after a checkpoint resumes to the uninterrupted weights bit for bit, and on another number of
processes is refused; bad settings are refused in one line. Tiny corpus (two files, 320 lines), 300-id tokenizers."""

import json
import os
import random
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from conftest import free_port
from ranks import launch_ranks, pretraining_killed_at_step
from safetensors.torch import load_file

import coreformer.training.streaming as streaming
from coreformer.training.objectives import OBJECTIVES
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.run import PretrainingArguments
from coreformer.training.shard_examples import DocumentIds
from coreformer.training.shards import Encoder, is_held_out, token_dtype, vocabulary_size
from coreformer.training.streaming import StreamedBatches, StreamedText, StreamPosition
from coreformer.training.tokenizer_training import train_tokenizer
from coreformer_settings.base import PretrainingError
from coreformer_settings.objectives import objective_settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the whole file

datasets.disable_progress_bars()

PRETRAIN = Path(__file__).resolve().parents[2] / "training" / "pretrain.py"

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
FAMILY_OF = {"masked-lm": "encoder", "causal-lm": "decoder", "denoising": "seq2seq"}
OBJECTIVE_PACKINGS = [(name, packing) for name in FAMILY_OF for packing in OBJECTIVES[name].packings]
SETTINGS = dict(text_column="text", validation_fraction=0.2, seed=0, dataset_config=None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, list[list[str]]]:
    """Two JSON Lines files of 160 documents each (1 to 60 words); the glob and each file's texts."""
    folder = tmp_path_factory.mktemp("stream")
    rng = random.Random(0)
    files = []
    for part in range(2):
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(160)]
        (folder / f"part-{part}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        files.append(texts)
    return str(folder / "*.jsonl"), files


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, corpus) -> dict[str, Path]:
    folders = {}
    for family in ("encoder", "decoder", "seq2seq"):
        folders[family] = tmp_path_factory.mktemp(f"tokenizer-{family}")
        train_tokenizer(family, corpus[1][0], 300).save_pretrained(folders[family])
    return folders


def _training(texts: list[str]) -> list[str]:
    return [text for text in texts if not is_held_out(text, SETTINGS["validation_fraction"], SETTINGS["seed"])]


def _batches(source: str, objective: str, packing: str, tokenizer, *, rank=0, world=1, workers=0, position=None):
    args = SimpleNamespace(dataset=source, block_size=16, batch_size=4, packing=packing, **SETTINGS)
    args.objective_settings = objective_settings(objective, {})  # the objective's defaults
    collator = OBJECTIVES[objective].collator(tokenizer, args)
    return StreamedBatches(
        StreamedText(args, rank, world), OBJECTIVES[objective], tokenizer, collator, args, start=rank, step=world,
        position=position or StreamPosition(), num_workers=workers,
    )  # fmt: skip


def _rows(batches: StreamedBatches, count: int) -> list[tuple]:
    """The next `count` rows (before collation) the batches hand out."""
    return [tuple(int(i) for i in next(batches._rows)["input_ids"]) for _ in range(count)]


@pytest.mark.parametrize(("objective", "packing"), OBJECTIVE_PACKINGS)
def test_each_chunks_rows_are_the_shard_rows_of_its_documents_shuffled(
    corpus, tokenizers, objective, packing, monkeypatch
):
    from transformers import AutoTokenizer

    monkeypatch.setattr(streaming, "CHUNK_DOCUMENTS", 100)
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[FAMILY_OF[objective]])
    documents = _training(corpus[1][0]) + _training(corpus[1][1])  # one process reads the files in order
    encoder = Encoder(tokenizer, token_dtype(vocabulary_size(tokenizer)))
    args = SimpleNamespace(block_size=16, packing=packing)
    in_order = []  # each chunk's rows as the shards' tables lay them out, chunk after chunk
    for start in range(0, len(documents), 100):
        table = OBJECTIVES[objective].sharded_examples(
            DocumentIds(*encoder(documents[start : start + 100])), tokenizer, args
        )
        in_order += [tuple(int(i) for i in table.row(r)["input_ids"]) for r in range(len(table))]
    batches = _batches(corpus[0], objective, packing, tokenizer)
    first_pass = _rows(batches, len(in_order))
    assert Counter(first_pass) == Counter(in_order) and first_pass != in_order  # every row once, shuffled
    assert batches.next_position == StreamPosition(0, (len(documents) - 1) // 100, len(table))
    assert _rows(batches, 1)[0] in in_order and batches.next_position == StreamPosition(1, 0, 1)  # the next pass


def test_worker_processes_give_the_batches_of_none(corpus, tokenizers, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(streaming, "CHUNK_DOCUMENTS", 40)
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["encoder"])
    alone, pooled = (_batches(corpus[0], "masked-lm", "padded", tokenizer, workers=w) for w in (0, 2))
    for _ in range(30):
        (g, a), (h, b) = next(alone), next(pooled)
        assert g == h and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_processes_read_disjoint_shares_and_held_out_documents_never_reach_training(corpus):
    source, files = corpus
    everything = _training(files[0]) + _training(files[1])
    shares = [
        list(StreamedText(SimpleNamespace(dataset=source, **SETTINGS), r, 2).training_documents()) for r in (0, 1)
    ]
    assert shares == [_training(files[0]), _training(files[1])]  # two files, two processes: a file each
    one_file = source.replace("*", "part-0")
    halves = [
        list(StreamedText(SimpleNamespace(dataset=one_file, **SETTINGS), r, 2).training_documents()) for r in (0, 1)
    ]
    assert halves == [_training(files[0][0::2]), _training(files[0][1::2])]  # one file: every other document each
    held_out = StreamedText(SimpleNamespace(dataset=source, **SETTINGS), 0, 1).held_out()
    assert held_out == [t for t in files[0] + files[1] if t not in set(everything)] and len(held_out) > 20
    assert set(held_out).isdisjoint(everything)


def run_settings(source: str, tokenizer: Path | None, output_dir: Path, **overrides) -> PretrainingArguments:
    model = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    model.update(hidden_dropout=0.1, attention_dropout=0.0, num_hidden_layers=2)
    settings = dict(
        family="decoder", model=model, dataset=source, streaming=True, tokenizer=tokenizer and str(tokenizer)
    )
    settings.update(block_size=16, batch_size=4, max_steps=20, lr=3e-3, warmup_steps=3, eval_every=10)
    settings.update(eval_batches=2, save_every=5, report_to="none", preset="tiny-test", zero_shot_pairs=0)
    settings.update(validation_fraction=0.2, output_dir=str(output_dir), threads=1)
    return PretrainingArguments(**{**settings, **overrides})


def test_a_streamed_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_weights(
    corpus, tokenizers, tmp_path, monkeypatch
):
    monkeypatch.setattr(streaming, "CHUNK_DOCUMENTS", 5)  # the kill falls in a later chunk than the first
    settings = dict(packing="packed")
    uninterrupted = run_pretraining(run_settings(corpus[0], tokenizers["decoder"], tmp_path / "whole", **settings))
    # killed (SIGKILL) after step 12, the checkpoint of step 10 saved
    killed = run_settings(corpus[0], tokenizers["decoder"], tmp_path / "stopped", **settings)
    pretraining_killed_at_step(killed, 12, tmp_path, {"coreformer.training.streaming:CHUNK_DOCUMENTS": 5})
    state = json.loads((tmp_path / "stopped" / "checkpoints" / "step-10" / "trainer_state.json").read_text())
    assert state["stream_positions"][0]["chunk"] > 0
    resumed = run_pretraining(
        run_settings(
            corpus[0], tokenizers["decoder"], tmp_path / "stopped", resume_from_checkpoint="latest", **settings
        )
    )
    assert resumed["resumed_from"].endswith("step-10") and resumed["training_rows"] is None
    assert [r["loss"] for r in resumed["history"]["train"]] == [r["loss"] for r in uninterrupted["history"]["train"]]
    final = load_file(tmp_path / "stopped" / "model.safetensors")
    reference = load_file(tmp_path / "whole" / "model.safetensors")
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)

    # the same checkpoint on 2 processes would read other shares: refused, naming both counts
    state["world_size"] = 2
    (tmp_path / "stopped" / "checkpoints" / "step-20" / "trainer_state.json").write_text(json.dumps(state))
    resume = dict(resume_from_checkpoint="latest", max_steps=30, **settings)
    with pytest.raises(PretrainingError, match=r"resumes on the number of processes it ran on \(2; this run has 1\)"):
        run_pretraining(run_settings(corpus[0], tokenizers["decoder"], tmp_path / "stopped", **resume))
    # a checkpoint of a run that read its data whole records no stream position
    del state["stream_positions"]
    (tmp_path / "stopped" / "checkpoints" / "step-20" / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(PretrainingError, match=r"records no position in a stream: resume it without --streaming"):
        run_pretraining(run_settings(corpus[0], tokenizers["decoder"], tmp_path / "stopped", **resume))


def test_streaming_settings_that_cannot_work_are_refused_in_one_line(corpus, tokenizers, tmp_path):
    base = (corpus[0], tokenizers["decoder"], tmp_path / "run")
    with pytest.raises(PretrainingError, match=r"--streaming needs --tokenizer"):
        run_settings(corpus[0], None, tmp_path / "run")
    with pytest.raises(PretrainingError, match=r"--streaming reads --dataset as a stream, and none is given"):
        run_settings(None, tokenizers["decoder"], tmp_path / "run")
    with pytest.raises(PretrainingError, match=r"--max-documents cuts a dataset read whole"):
        run_settings(*base, max_documents=10)
    with pytest.raises(PretrainingError, match=r"no column 'body'; its columns are \['text'\]"):
        run_pretraining(run_settings(*base, text_column="body"))
    with pytest.raises(PretrainingError, match=r"No local data file matches"):
        run_pretraining(run_settings(str(tmp_path / "nowhere" / "*.jsonl"), tokenizers["decoder"], tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # nothing written for a refused run


@pytest.mark.slow
def test_two_processes_stream_their_shares_and_resume_each_from_its_own_position(corpus, tokenizers, tmp_path):
    """A 2-process streamed run (ranks forked as `accelerate launch` starts them) records both processes' positions,
    and resumed from step 5 on 2 processes trains steps 6-10 as the run that went on."""
    run = tmp_path / "two"
    config = tmp_path / "tiny-test.json"
    settings = run_settings(corpus[0], tokenizers["decoder"], run, max_steps=10, eval_every=5)
    config.write_text(json.dumps({"family": "decoder", "model": settings.model}))
    flags = ["--config", str(config), "--dataset", corpus[0], "--streaming", "--tokenizer", str(tokenizers["decoder"])]
    flags += ["--block-size", "16", "--batch-size", "4", "--max-steps", "10", "--save-every", "5", "--eval-every", "5"]
    flags += ["--eval-batches", "2", "--warmup-steps", "3", "--lr", "3e-3", "--report-to", "none", "--output-dir"]
    flags += [str(run), "--zero-shot-pairs", "0", "--keep-last", "3"]
    launcher = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    launcher += ["--dynamo_backend", "no", "--main_process_port", str(free_port())]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    script = [str(PRETRAIN), *flags]
    log = tmp_path / "launch.log"
    assert launch_ranks(launcher, script, environment, tmp_path, log).wait(timeout=300) == 0, log.read_text()[-4000:]
    whole = json.loads((run / "metrics.json").read_text())
    state = json.loads((run / "checkpoints" / "step-5" / "trainer_state.json").read_text())
    assert state["stream_positions"] == [{"passes": 0, "chunk": 0, "row": 5 * 4}] * 2  # each: 5 batches of 4 rows

    shutil.rmtree(run / "checkpoints" / "step-10")
    (run / "config.json").unlink()  # the folder as a run stopped after step 5's checkpoint leaves it
    launcher[-1] = str(free_port())
    resumed_log = tmp_path / "resumed.log"
    resumed = launch_ranks(
        launcher, script + ["--resume-from-checkpoint", "latest"], environment, tmp_path, resumed_log
    )
    assert resumed.wait(timeout=300) == 0, resumed_log.read_text()[-4000:]
    again = json.loads((run / "metrics.json").read_text())
    assert again["resumed_from"].endswith("step-5")
    assert [r["loss"] for r in again["history"]["train"]] == [r["loss"] for r in whole["history"]["train"]]
