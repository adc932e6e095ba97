"""Resuming pretraining on another number of processes (coreformer.training.engine, pretraining.py): an FSDP2 run's
DCP checkpoint, saved by 2 processes, continues on 4 (DCP reshards the model and optimizer shards; the data position
is kept in global batches) with the uninterrupted run's per-step losses; a single process, which cannot read the
shards' format, is refused in one message naming both process counts.

The launches reuse test_distributed's tiny decoder runs (hidden 32, 2 layers, 12 steps, blocks of 32) and launcher.
"""

import shutil

import pytest
import torch
from conftest import free_port
from test_distributed import LOSS_TOLERANCE, STEPS, Launches, fsdp_launcher, tiny_settings, train_losses

from coreformer.training.data import iter_texts
from coreformer.training.pretraining import PretrainingArguments, PretrainingError, load_dataset_splits, run_pretraining
from coreformer.training.tokenizer_training import train_tokenizer

# Its own xdist worker: the launches below would otherwise share the two cores with another module's launches.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resharded_resume")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 FSDP2 processes x 2 accumulated micro-batches for 12 steps (checkpoints at 6 and 12), then its step-6
    checkpoint resumed by 4 FSDP2 processes x 1 micro-batch: the same 4 micro-batches (32 examples) per step."""
    tmp = tmp_path_factory.mktemp("resharded")
    launches = Launches(tmp)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = PretrainingArguments(**tiny_settings("decoder"), output_dir=str(tmp / "unused"))
        tokenizer = train_tokenizer("decoder", iter_texts(load_dataset_splits(args)["train"]), args.vocab_size)
        tokenizer.save_pretrained(tmp / "tokenizer")
        settings = tiny_settings("decoder", tokenizer=str(tmp / "tokenizer"), grad_accum=2)
        launches.start("two", settings, fsdp_launcher(free_port()))
        assert launches.finish("two") == 0, launches.log("two")[-4000:]
        checkpoint = tmp / "saved-by-two" / "step-6"
        shutil.copytree(tmp / "two" / "checkpoints" / "step-6", checkpoint)  # kept whatever the later runs prune
        four = fsdp_launcher(free_port())
        four[four.index("--num_processes") + 1] = "4"
        launches.start("four", settings, four, grad_accum=1, resume_from_checkpoint=str(checkpoint))
        assert launches.finish("four") == 0, launches.log("four")[-4000:]
        yield launches, settings, checkpoint
    finally:
        launches.close()
        torch.set_num_threads(previous)


def test_a_dcp_checkpoint_of_2_processes_resumes_on_4_to_the_uninterrupted_losses(runs):
    launches, _, _ = runs
    two, four = launches.metrics("two"), launches.metrics("four")
    assert four["engine"]["world_size"] == 4 and four["resumed_from"].endswith("step-6")
    assert two["examples_per_step"] == four["examples_per_step"] == 32
    losses, reference = train_losses(four), train_losses(two)
    assert len(losses) == len(reference) == STEPS
    assert losses[:6] == reference[:6]  # the history the checkpoint carries
    assert max(abs(a - b) for a, b in zip(losses[6:], reference[6:])) <= LOSS_TOLERANCE  # trained on 4 processes
    assert "resumed from" in launches.log("four")


def test_a_dcp_checkpoint_resumed_by_one_process_is_refused_naming_both_process_counts(runs, tmp_path):
    _, settings, checkpoint = runs
    args = PretrainingArguments(
        **{**settings, "grad_accum": 4}, output_dir=str(tmp_path / "out"), resume_from_checkpoint=str(checkpoint)
    )
    message = (
        r"holds dcp state \(written by a FSDP2 full shard run\); this run is NO \(none\) and reads accelerate "
        r"checkpoints \(saved by 2 process\(es\), this run has 1\)\. Resume with the launcher config the run was "
        r"started with \(FSDP2 shards of DCP checkpoints load on any number of processes from 2\)\."
    )
    with pytest.raises(PretrainingError, match=message):
        run_pretraining(args)
    assert not (tmp_path / "out").exists()
