"""Pretraining (coreformer.training.pretraining, training/pretrain.py): every family trains and reloads, 2 processes
match 1 process with --grad-accum 2, a run killed during a save resumes bit-identically, checkpoints are atomic, bad
inputs are refused with nothing overwritten, presets and launcher configs resolve.

Runs are tiny (hidden 32, 2 layers, vocab 384 trained on 12 documents, blocks of 32, 30 steps) and use one thread,
in this process and in every child, so that in-process and subprocess runs compute bit-identical numbers.
"""

import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import datasets
import pytest
import torch
from accelerate.utils.other import clean_state_dict_for_safetensors
from conftest import free_port, run_launch
from ranks import fork_python, launch_ranks
from safetensors.torch import load_file
from tiny import tiny_model
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM, AutoTokenizer

import coreformer as cf
from coreformer.training.arguments import RunStoppedError
from coreformer.training.batches import GlobalBatches
from coreformer.training.checkpoints import _quiet_about_ties, find_latest_checkpoint, list_checkpoints
from coreformer.training.objectives.masked_lm import MaskedLMCollator
from coreformer.training.pretraining import prepare, run_pretraining
from coreformer.training.pretraining.inputs import build_collator, build_model_config
from coreformer.training.pretraining.run import PretrainingArguments, resolve_arguments
from coreformer.training.pretraining.run_folder import check_world_size, resolve_resume
from coreformer_settings.base import PretrainingError
from coreformer_settings.pretraining import PRESETS
from coreformer_settings.registries import FAMILY_NAMES

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the whole file

datasets.disable_progress_bars()

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "training" / "pretrain.py"
CONFIGS = REPO / "training" / "configs"
ACCELERATE = Path(sys.executable).with_name("accelerate")

AUTO_CLASSES = {"encoder": AutoModelForMaskedLM, "decoder": AutoModelForCausalLM, "seq2seq": AutoModelForSeq2SeqLM}
MODEL_CLASSES = {
    "encoder": cf.CoreformerEncoderForMaskedLM,
    "decoder": cf.CoreformerDecoderForCausalLM,
    "seq2seq": cf.CoreformerSeq2SeqForConditionalGeneration,
}
SAMPLE = "def read(path):\n    with open(path) as handle:\n        return handle.read()\n"


def tiny_settings(family: str, **overrides) -> dict:
    """A tiny run of `family` as a config mapping (PretrainingArguments fields); `model` overrides merge."""
    model = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    model.update(hidden_dropout=0.0, attention_dropout=0.0)
    model.update(dict(encoder_layers=2, decoder_layers=2) if family == "seq2seq" else dict(num_hidden_layers=2))
    model.update(overrides.pop("model", {}))
    settings = dict(family=family, model=model, max_documents=12, vocab_size=384, block_size=32, batch_size=8)
    settings.update(max_steps=30, lr=3e-3, warmup_steps=3, eval_every=10, eval_batches=4, save_every=0)
    settings.update(report_to="none", preset="tiny-test")
    settings.update(overrides)
    return settings


def args_from(settings: dict, output_dir: Path, **extra) -> PretrainingArguments:
    return PretrainingArguments(**{**settings, **extra, "output_dir": str(output_dir)})


def tiny_args(family: str, output_dir: Path, **overrides) -> PretrainingArguments:
    return args_from(tiny_settings(family, **overrides), output_dir)


def child_env(tmp_path: Path) -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }


def cli_flags(settings: dict) -> list[str]:
    """The non-model settings as command-line flags (the model goes through a JSON --config)."""
    flags = []
    for key, value in settings.items():
        if key in ("model", "family", "preset"):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def train_losses(metrics: dict) -> list[float]:
    return [record["loss"] for record in metrics["history"]["train"]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """One finished tiny run per family (the decoder with the default tracker setting), with checkpoints."""
    runs = {}
    for family in FAMILY_NAMES:
        output_dir = tmp_path_factory.mktemp(f"run-{family}")
        report_to = "auto" if family == "decoder" else "none"
        prompt = "import " if family == "encoder" else "def "
        args = tiny_args(family, output_dir, save_every=10, keep_last=2, report_to=report_to, sample_prompt=prompt)
        runs[family] = (output_dir, run_pretraining(args))
    return runs


# ---------------------------------------------------------------------------------------------------------------------
# Each family trains and its output loads
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_family_lowers_held_out_loss_on_the_embedded_corpus(trained, family):
    _, metrics = trained[family]
    evals = [record["loss"] for record in metrics["history"]["eval"]]
    assert [record["step"] for record in metrics["history"]["eval"]] == [0, 10, 20, 30]
    assert metrics["initial_eval_loss"] == evals[0] and metrics["final_eval_loss"] == evals[-1]
    assert evals[-1] < evals[0] - 0.4, evals
    assert all(later < earlier for earlier, later in zip(evals, evals[1:])), evals
    assert metrics["final_eval_perplexity"] == pytest.approx(torch.tensor(evals[-1]).exp().item(), rel=1e-6)
    assert metrics["steps"] == 30 and metrics["world_size"] == 1 and len(metrics["history"]["train"]) == 30
    assert metrics["tokens_per_second"] > 0 and metrics["wall_time_s"] >= metrics["train_time_s"] > 0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_output_folder_loads_with_auto_classes_and_holds_card_metrics_plot(trained, family):
    output_dir, metrics = trained[family]
    model = AUTO_CLASSES[family].from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert type(model) is MODEL_CLASSES[family]
    assert model.config.vocab_size % 64 == 0 and len(tokenizer) <= model.config.vocab_size < len(tokenizer) + 64
    assert model.config.vocab_size == metrics["vocab_size"]
    assert (output_dir / f"modeling_{family}.py").is_file()
    assert set(json.loads((output_dir / "config.json").read_text())["auto_map"]) >= {"AutoConfig", "AutoModel"}
    assert (output_dir / "generation_config.json").is_file() == (family != "encoder")
    assert not (output_dir / ".final-tmp").exists()
    assert [path.name for path in sorted((output_dir / "checkpoints").iterdir())] == ["step-20", "step-30"]

    inputs = tokenizer(SAMPLE, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        if family == "seq2seq":
            generated = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        elif family == "decoder":
            generated = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
            assert torch.equal(generated[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])
        else:
            generated = model(**inputs).logits.argmax(-1)
    assert generated.numel() > 0

    card = (output_dir / "README.md").read_text()
    for expected in ("license: apache-2.0", "library_name: transformers", "- coreformer", "trust_remote_code=True"):
        assert expected in card, expected
    assert f"{metrics['final_eval_loss']:.4f}" in card and AUTO_CLASSES[family].__name__ in card
    saved = json.loads((output_dir / "metrics.json").read_text())
    assert saved["final_eval_loss"] == metrics["final_eval_loss"] and saved["world_size"] == 1
    assert saved["sample"] == metrics["sample"]
    assert (output_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 64
    # --sample-prompt: the final folder reloaded through the Auto classes, and what it makes of a prompt
    assert metrics["sample"].startswith("import " if family == "encoder" else "def ")
    assert len(metrics["sample"]) > len("import [MASK]")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_metrics_and_card_say_how_many_passes_over_the_training_rows_the_run_read(trained, family, tmp_path):
    output_dir, metrics = trained[family]
    rows = len(prepare(tiny_args(family, tmp_path / "same-data")).train_examples)  # the run's rows, built again
    assert rows > 0 and metrics["training_rows"] == rows
    assert metrics["epochs"] == pytest.approx(30 * 8 / rows)  # 30 steps of 8 rows
    assert json.loads((output_dir / "metrics.json").read_text())["epochs"] == metrics["epochs"]
    assert f"{metrics['epochs']:.3g} epochs" in (output_dir / "README.md").read_text()


def test_tracker_is_tensorboard_exactly_when_it_is_installed(trained):
    output_dir, metrics = trained["decoder"]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert metrics["tracker"] == "none"
    else:
        assert metrics["tracker"] == "tensorboard"
        assert list((output_dir / "logs" / "pretrain").glob("events.out.tfevents.*"))


REMOTE_CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["coreformer"] = None  # a machine without coreformer: only transformers and the saved folders
    try:
        import coreformer
    except ImportError:
        pass
    else:
        raise SystemExit("coreformer is importable in the child")
    import torch, transformers
    torch.set_num_threads(1)
    for case in torch.load(sys.argv[1]):
        model = getattr(transformers, case["auto_class"]).from_pretrained(case["folder"], trust_remote_code=True)
        # AutoTokenizer reads config.json first; trust_remote_code=True answers the custom-code question that
        # config's auto_map raises (docs/troubleshooting.md).
        tokenizer = transformers.AutoTokenizer.from_pretrained(case["folder"], trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        inputs = tokenizer(case["text"], return_tensors="pt", return_token_type_ids=False)
        with torch.no_grad():
            logits = model.eval()(**inputs).logits
        assert torch.equal(logits, case["logits"]), (case["folder"], (logits - case["logits"]).abs().max())
    print("remote-code loads:", len(torch.load(sys.argv[1])))
    """
)


@pytest.mark.slow
def test_outputs_load_through_remote_code_in_a_process_without_coreformer(trained, tmp_path):
    cases = []
    for family, (output_dir, _) in trained.items():
        model = AUTO_CLASSES[family].from_pretrained(output_dir).eval()
        inputs = AutoTokenizer.from_pretrained(output_dir)(SAMPLE, return_tensors="pt", return_token_type_ids=False)
        with torch.no_grad():
            logits = model(**inputs).logits
        cases.append(dict(auto_class=AUTO_CLASSES[family].__name__, folder=str(output_dir), text=SAMPLE, logits=logits))
    torch.save(cases, tmp_path / "cases.pt")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_CHILD, str(tmp_path / "cases.pt")],
        capture_output=True,
        text=True,
        env=child_env(tmp_path),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote-code loads: 3" in result.stdout


# ---------------------------------------------------------------------------------------------------------------------
# Data order: 2 processes == 1 process with --grad-accum 2
# ---------------------------------------------------------------------------------------------------------------------


def test_global_batch_holds_the_same_examples_and_masks_whoever_builds_it():
    examples = datasets.Dataset.from_dict({"input_ids": [[2, 10 + i, 20 + i, 30 + i, 3] for i in range(10)]})
    collator = MaskedLMCollator(mask_token_id=4, pad_token_id=0, vocab_size=64, mlm_probability=0.5)
    batches = GlobalBatches(examples, collator, 4, seed=7, stream="train", shuffle=True)
    again = GlobalBatches(examples, collator, 4, seed=7, stream="train", shuffle=True)
    forward = [batches[g][1] for g in range(6)]  # 24 positions: spans epochs 0, 1 and 2
    backward = [again[g][1] for g in reversed(range(6))][::-1]
    for one, other in zip(forward, backward):
        assert all(torch.equal(one[key], other[key]) for key in one)
    seen = torch.cat([batch["labels"].where(batch["labels"] != -100, batch["input_ids"]) for batch in forward[:3]])
    assert sorted(seen[:10, 1].tolist()) == list(range(10, 20))  # stream positions 0-9: epoch 0, each example once
    other_seed = GlobalBatches(examples, collator, 4, seed=8, stream="train", shuffle=True)
    assert not torch.equal(other_seed[0][1]["input_ids"], forward[0]["input_ids"])


def two_processes_and_one(settings: dict, tmp_path: Path, *, forked: bool = False) -> tuple[dict, dict]:
    """(metrics of a 2-process run launched with accelerate, metrics of the same run in this process with
    --grad-accum 2). Both use the tokenizer the 2-process run's main process trained and sent to the other; the
    one-process run reads it rather than training the same one again. With `forked`, the launch's ranks are forked
    as it would start them (ranks.py) instead of launched."""
    config = tmp_path / "tiny-test.json"
    config.write_text(json.dumps({"family": settings["family"], "model": settings["model"]}))
    two = tmp_path / "two-processes"
    launcher = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    launcher += ["--dynamo_backend", "no", "--main_process_port", str(free_port())]
    script = [str(PRETRAIN), "--config", str(config), *cli_flags({**settings, "output_dir": str(two), "grad_accum": 1})]
    env = {**child_env(tmp_path), "ACCELERATE_USE_CPU": "1"}
    if forked:
        log = tmp_path / "launch.log"
        assert launch_ranks(launcher, script, env, tmp_path, log).wait(timeout=300) == 0, log.read_text()[-4000:]
    else:
        result = run_launch([str(ACCELERATE), "launch", *launcher, *script], env=env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
    one = run_pretraining(args_from(settings, tmp_path / "one-process", grad_accum=2, tokenizer=str(two)))
    return json.loads((two / "metrics.json").read_text()), one


def assert_same_steps(two_metrics: dict, one: dict, steps: int) -> None:
    """The same examples per step, per-step training losses within 1e-4, the same held-out losses."""
    assert (two_metrics["world_size"], one["world_size"]) == (2, 1)
    assert two_metrics["examples_per_step"] == one["examples_per_step"]
    assert [r["tokens"] for r in two_metrics["history"]["train"]] == [r["tokens"] for r in one["history"]["train"]]
    difference = max(abs(a - b) for a, b in zip(train_losses(two_metrics), train_losses(one)))
    assert len(train_losses(two_metrics)) == steps and difference <= 1e-4, difference
    for mine, theirs in zip(one["history"]["eval"], two_metrics["history"]["eval"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-4)


def test_two_runs_from_scratch_give_identical_losses_and_weights_whichever_process_builds_the_batches(tmp_path):
    # What the pretraining guide promises: a run is reproducible from its seed, its WordPiece tokenizer's training
    # included (test_tokenizer_training checks that one across processes). The second run builds its batches in two
    # loader workers (--num-workers 2): each global batch's examples and masks follow its number, not its builder.
    settings = tiny_settings("encoder", model=dict(hidden_dropout=0.1), max_steps=6, eval_every=3, warmup_steps=2)
    first = run_pretraining(args_from(settings, tmp_path / "first"))
    second = run_pretraining(args_from(settings, tmp_path / "second", num_workers=2))
    assert train_losses(first) == train_losses(second) and len(train_losses(first)) == 6
    weights = [load_file(tmp_path / name / "model.safetensors") for name in ("first", "second")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])


@pytest.mark.slow
def test_two_processes_match_one_process_with_grad_accum_2(tmp_path):
    # MLM with dropout: the masks and dropout both follow the global batch number, not the process.
    settings = tiny_settings("encoder", model=dict(hidden_dropout=0.1), max_steps=12, eval_every=6, warmup_steps=2)
    two_metrics, one = two_processes_and_one(settings, tmp_path)
    assert one["examples_per_step"] == 16
    assert_same_steps(two_metrics, one, steps=12)
    engine = two_metrics["engine"]  # DDP on one machine, as it ran
    assert (engine["distributed_type"], engine["sharding"], engine["num_nodes"]) == ("MULTI_CPU", "DDP", 1)


def test_the_run_frees_its_model_before_it_destroys_the_process_group():
    # DDP's reducer holds the process group. Were the reducer the group's last holder, the group's destructor would
    # run with the GIL held and join gloo's worker threads, one of which may need the GIL to free the last barrier's
    # tensors: a launch that finished its run and never exited (caught with py-spy in a loop of two-process launches).
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from coreformer.training.pretraining.loop import end_training
    from coreformer.training.pretraining.run import _Training

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    training = _Training(model, optimizer, None, num_parameters=6, data=iter(()), eval_batches=[])
    model_in_training = weakref.ref(model)
    del model, optimizer
    alive_when_destroyed = []
    accelerator.end_training = lambda: alive_when_destroyed.append(model_in_training() is not None)
    end_training(accelerator, training)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert alive_when_destroyed == [False]


def test_launch_with_more_processes_than_accelerate_sees_is_refused():
    # `accelerate launch --multi_gpu --num_processes 2` without ACCELERATE_USE_CPU=1 on a CPU machine: WORLD_SIZE=2
    # in each process, but each sets up a run of its own.
    with pytest.raises(PretrainingError, match="started 2 processes but Accelerate set up 1"):
        check_world_size(1, {"WORLD_SIZE": "2"})
    check_world_size(2, {"WORLD_SIZE": "2"})
    check_world_size(1, {})


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints and exact resume
# ---------------------------------------------------------------------------------------------------------------------

KILLED_CHILD = textwrap.dedent(
    """
    import pathlib, runpy, sys, time
    import accelerate

    marker, script = pathlib.Path(sys.argv[1]), sys.argv[2]
    original = accelerate.Accelerator.save_state

    def save_state(self, output_dir=None, **kwargs):
        result = original(self, output_dir, **kwargs)
        if str(output_dir).endswith(".tmp-step-20"):  # the state is written, trainer_state.json and rename are not
            marker.write_text("saving step 20")
            time.sleep(300)  # the test kills us here
        return result

    accelerate.Accelerator.save_state = save_state
    sys.argv = [script] + sys.argv[3:]
    runpy.run_path(script, run_name="__main__")
    """
)


@pytest.mark.slow
def test_sigkill_during_a_save_then_resume_latest_is_bit_identical(tmp_path):
    # Denoising with dropout: data order, masks, dropout, optimizer and schedule must all come back exactly.
    settings = tiny_settings("seq2seq", model=dict(hidden_dropout=0.1), save_every=10, keep_last=3)
    config = tmp_path / "seq2seq-tiny-test.json"
    config.write_text(json.dumps({"family": "seq2seq", "model": settings["model"]}))
    killed = tmp_path / "killed"
    marker = tmp_path / "marker"
    child = fork_python(
        ["-c", KILLED_CHILD, str(marker), str(PRETRAIN), "--config", str(config)]
        + cli_flags({**settings, "output_dir": str(killed)}),
        child_env(tmp_path),
        tmp_path,
        tmp_path / "child.log",
    )
    uninterrupted = run_pretraining(args_from(settings, tmp_path / "uninterrupted"))
    child.kill_at_marker(marker)

    # The kill hit step 20's save: its temporary folder is there, half done, and `latest` is step 10.
    checkpoints = killed / "checkpoints"
    assert (checkpoints / ".tmp-step-20" / "model.safetensors").is_file()
    assert not (checkpoints / "step-20").exists()
    assert find_latest_checkpoint(killed) == checkpoints / "step-10"
    assert not (killed / "config.json").exists()

    resumed = run_pretraining(args_from(settings, killed, resume_from_checkpoint="latest"))
    assert resumed["resumed_from"] == str(checkpoints / "step-10")
    assert not (checkpoints / ".tmp-step-20").exists()
    assert train_losses(resumed) == train_losses(uninterrupted)  # exact, not approximate
    assert resumed["history"]["eval"] == uninterrupted["history"]["eval"]
    final, reference = weights(killed), weights(tmp_path / "uninterrupted")
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[name], reference[name]) for name in reference)
    assert [path.name for path in sorted(checkpoints.iterdir())] == ["step-10", "step-20", "step-30"]


INTERRUPTED_CHILD = textwrap.dedent(
    """
    import pathlib, runpy, sys, time
    import coreformer.training.pretraining.loop as pretraining_loop

    marker, script = pathlib.Path(sys.argv[1]), sys.argv[2]
    original = pretraining_loop.train_step

    def train_step(run, training):
        if training.step == 12:  # steps 1-12 done, the checkpoint of step 10 saved
            marker.write_text("in step 13")
            time.sleep(300)  # the test presses Ctrl-C here
        return original(run, training)

    pretraining_loop.train_step = train_step  # where `train` looks it up
    sys.argv = [script] + sys.argv[3:]
    runpy.run_path(script, run_name="__main__")
    """
)


@pytest.mark.slow
def test_ctrl_c_during_pretraining_is_one_line_naming_the_step_and_the_resume_flag(tmp_path):
    settings = tiny_settings("decoder", save_every=10, max_steps=30)
    config = tmp_path / "decoder-tiny-test.json"
    config.write_text(json.dumps({"family": "decoder", "model": settings["model"]}))
    marker, output_dir = tmp_path / "marker", tmp_path / "stopped"
    child = fork_python(
        ["-c", INTERRUPTED_CHILD, str(marker), str(PRETRAIN), "--config", str(config)]
        + cli_flags({**settings, "output_dir": str(output_dir)}),
        child_env(tmp_path),
        tmp_path,
        tmp_path / "stderr.log",
        stdout=Path(os.devnull),
    )
    returncode, stderr = child.interrupt_at_marker(marker)
    assert returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    expected = "pretrain.py: stopped at step 12; continue with --resume-from-checkpoint latest (from its checkpoint at "
    assert stderr.strip().splitlines()[-1] == expected + "step 10)"
    assert find_latest_checkpoint(output_dir) == output_dir / "checkpoints" / "step-10"


def test_pretrain_script_version_and_mistyped_folders_answer_in_one_line(tmp_path):
    def script(*flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(PRETRAIN), *flags]
        return subprocess.run(command, capture_output=True, text=True, env=child_env(tmp_path), cwd=tmp_path)

    version = script("--version")
    assert (version.returncode, version.stdout) == (0, f"coreformer {importlib.metadata.version('coreformer')}\n")
    for flag, value, fix in (
        ("--tokenizer", "./no-tokenizer", "or pass a Hub repo id"),
        ("--resume-from-checkpoint", "runs/step-10", "pass a local checkpoint folder"),
    ):
        result = script("--family", "decoder", flag, value, "--output-dir", str(tmp_path / "out"))
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.startswith(f"pretrain.py: error: no such folder: {value} ") and fix in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_checkpoints_of_a_tied_model_save_without_the_shared_tensor_warning(tmp_path, caplog):
    args = tiny_args("decoder", tmp_path / "run", max_steps=4, save_every=2, eval_every=0, warmup_steps=1)
    with caplog.at_level(logging.WARNING):
        run_pretraining(args)
    assert [path.name for path in list_checkpoints(tmp_path / "run")] == ["step-2", "step-4"]
    assert not [record for record in caplog.records if "shared tensor" in record.getMessage()]
    model = cf.CoreformerDecoderForCausalLM.from_pretrained(tmp_path / "run")
    assert model.lm_head.weight is model.get_input_embeddings().weight  # the tie the silenced warning was about
    # a shared tensor the model does not declare tied still warns
    caplog.clear()
    model.extra = torch.nn.Linear(2, 2)
    shared = {"lm_head.weight": model.lm_head.weight, "extra.weight": model.extra.weight}
    shared["extra.bias"] = shared["alias.bias"] = model.extra.bias
    with caplog.at_level(logging.WARNING), _quiet_about_ties(model):
        clean_state_dict_for_safetensors(dict(shared))
    assert "Removed shared tensor {'alias.bias'}" in caplog.text


@pytest.mark.slow
def test_resuming_a_finished_run_or_with_another_max_steps_says_so_in_one_line(tmp_path, capsys):
    settings = tiny_settings("decoder", max_steps=4, save_every=2, eval_every=0, warmup_steps=1)
    run_pretraining(args_from(settings, tmp_path / "run"))
    capsys.readouterr()
    run_pretraining(args_from(settings, tmp_path / "run", resume_from_checkpoint="latest"))
    out = capsys.readouterr().out
    assert "note: the checkpoint is at step 4 and --max-steps is 4: no step to train" in out
    assert "no steps this session" in out and "tokens/s" not in out.split("done:")[1]
    longer = run_pretraining(args_from(settings, tmp_path / "run", resume_from_checkpoint="latest", max_steps=6))
    out, err = capsys.readouterr()
    bar = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("decoder pretraining")][-1]
    # the bar's last state: steps done, elapsed<ETA, steps/s, the loss and the throughput
    assert re.match(r"decoder pretraining: 100%.* 6/6 \[[\d:]+<[\d:]+, .*step/s, loss=[\d.]+, .*tok_s=[\d,]+\]", bar)
    assert "note: the schedule changed on resume (--max-steps 4 -> 6, --warmup-steps 1 -> 1): from step 4" in out
    assert longer["steps"] == 6 and "tokens/s" in out.split("done:")[1]
    timed = [line for line in out.splitlines() if line.startswith("time: ")]  # the run's wall time, what it counts
    assert len(timed) == 1 and timed[0].endswith(
        " for this run (data, tokenizer, steps, evaluations, final save; not counting imports)"
    )


def test_pretrain_help_shows_the_presets_values_not_the_overridden_dataclass_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal's width, hyphens included
    spec = importlib.util.spec_from_file_location("training_pretrain", PRETRAIN)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = " ".join(script.build_parser().format_help().split())
    tiny = resolve_arguments(family="decoder", preset="tiny", configs_dir=CONFIGS)
    assert tiny.max_steps == 600 and PretrainingArguments.__dataclass_fields__["max_steps"].default == 1000
    assert (
        "optimizer steps (default: from the preset: encoder-tiny 1600, decoder-tiny 600, seq2seq-tiny 600, small "
        "10000, base 100000; a --config file" in text
    )  # the value a preset takes from the preset it extends is shown too
    # A family's preset that leaves a setting out runs with the default, and the help says so (it once said
    # "tiny muon" for every family, where an encoder tiny run records adamw and cosine).
    for name in ("optimizer", "lr_scheduler_type"):
        ran = {
            family: getattr(resolve_arguments(family=family, preset="tiny", configs_dir=CONFIGS), name)
            for family in FAMILY_NAMES
        }
        assert ran["encoder"] != ran["decoder"]
        assert ", ".join(f"{family}-tiny {value}" for family, value in ran.items()) in text
    assert "(default: 1000)" not in text
    assert "--seed SEED seed of the data order, masking, dropout and initialisation (default: 0)" in text  # no preset


def test_latest_checkpoint_ignores_temporary_and_incomplete_folders(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for name, complete in (("step-5", True), ("step-12", True), ("step-40", False), (".tmp-step-50", True)):
        (checkpoints / name).mkdir(parents=True)
        if complete:
            (checkpoints / name / "trainer_state.json").write_text("{}")
    (checkpoints / "step-99.txt").write_text("")
    assert find_latest_checkpoint(tmp_path) == checkpoints / "step-12"
    assert find_latest_checkpoint(tmp_path / "nothing-here") is None


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one clear error, nothing overwritten
# ---------------------------------------------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def previous_run(tmp_path) -> Path:
    """A folder that looks like a finished run, to be left untouched by every refused run."""
    folder = tmp_path / "previous-run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "run_config.json").write_text('{"family": "decoder"}')
    (folder / "config.json").write_text('{"model_type": "coreformer_decoder"}')
    return folder


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD_DATA = {
    "unknown Hub dataset": (lambda tmp: "no-such-user/no-such-dataset", "Cannot load dataset"),
    "missing file": (lambda tmp: str(tmp / "missing.jsonl"), "does not exist"),
    "empty file": (lambda tmp: _write(tmp / "empty.txt", ""), "is empty"),
    "blank texts": (lambda tmp: _write(tmp / "blank.jsonl", '{"text": " "}\n{"text": ""}\n'), "no non-blank text"),
    "missing text column": (lambda tmp: _write(tmp / "other.jsonl", '{"content": "x = 1"}\n'), "has no column 'text'"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_dataset_is_refused_before_the_output_dir_is_touched(case, tmp_path, previous_run):
    make_source, message = BAD_DATA[case]
    before = snapshot(previous_run)
    args = tiny_args("decoder", previous_run, dataset=make_source(tmp_path), max_documents=None, overwrite=True)
    with pytest.raises(PretrainingError, match=message):
        run_pretraining(args)
    assert snapshot(previous_run) == before


def test_output_dir_with_another_run_is_refused_without_overwrite(tmp_path, previous_run):
    before = snapshot(previous_run)
    with pytest.raises(PretrainingError, match="already holds a run. Pass --overwrite"):
        run_pretraining(tiny_args("decoder", previous_run))
    unrelated = tmp_path / "photos"
    unrelated.mkdir()
    (unrelated / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(PretrainingError, match="holds no previous run"):
        run_pretraining(tiny_args("decoder", unrelated, overwrite=True))  # --overwrite never deletes other folders
    assert snapshot(previous_run) == before and (unrelated / "cat.jpg").exists()


def test_resume_from_a_checkpoint_of_another_family_is_refused(trained, tmp_path):
    decoder_dir, _ = trained["decoder"]
    before = snapshot(decoder_dir)
    checkpoint = find_latest_checkpoint(decoder_dir)
    with pytest.raises(
        PretrainingError, match="belongs to a run of the decoder family; this run trains the encoder family"
    ):
        run_pretraining(tiny_args("encoder", decoder_dir, resume_from_checkpoint="latest"))
    with pytest.raises(PretrainingError, match="belongs to a run of the decoder family"):
        run_pretraining(tiny_args("seq2seq", tmp_path / "new", resume_from_checkpoint=str(checkpoint)))
    wider = tiny_args("decoder", decoder_dir, resume_from_checkpoint="latest", model=dict(hidden_size=64))
    with pytest.raises(PretrainingError, match="another model config .*hidden_size"):
        run_pretraining(wider)
    assert snapshot(decoder_dir) == before and not (tmp_path / "new").exists()


def test_resume_with_another_objective_is_refused(trained, tmp_path):
    encoder_dir, _ = trained["encoder"]
    before = snapshot(encoder_dir)
    with pytest.raises(PretrainingError, match="belongs to a run of the masked-lm objective; this run trains electra"):
        run_pretraining(tiny_args("encoder", encoder_dir, resume_from_checkpoint="latest", objective="electra"))
    assert snapshot(encoder_dir) == before


def load_cli():
    """training/pretrain.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("pretrain_cli", PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_help_documents_every_flag_and_errors_are_one_line(tmp_path, capsys):
    cli = load_cli()
    help_text = cli.build_parser().format_help()
    flags = "--family --preset --config --dataset --text-column --tokenizer --max-steps --batch-size --grad-accum --lr"
    flags += " --warmup-steps --mixed-precision --seed --output-dir --save-every --keep-last --eval-every"
    flags += " --resume-from-checkpoint --overwrite --block-size"
    for flag in flags.split():
        assert flag in help_text, flag
    assert "(default: 0.05)" in help_text  # defaults are shown
    argv = ["--family", "decoder", "--dataset", "nowhere/data.jsonl", "--output-dir", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "pretrain.py: error: Local data file 'nowhere/data.jsonl' does not exist."
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        cli.main(["--family", "decoder", "--preset", "tiny", "--config", "x.yaml"])  # argparse: one or the other
    assert "not allowed with argument" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Presets, config files, launcher configs
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_preset_resolves_and_pads_the_vocabulary_to_64(trained, family):
    tokenizer = AutoTokenizer.from_pretrained(trained[family][0])
    for preset in PRESETS:
        args = resolve_arguments(family=family, preset=preset, configs_dir=CONFIGS)
        assert args.family == family and args.preset == preset and args.pad_vocab_to_multiple_of == 64
        config = build_model_config(args, tokenizer)
        assert config.vocab_size % 64 == 0 and len(tokenizer) <= config.vocab_size < len(tokenizer) + 64
        assert args.block_size <= config.max_position_embeddings
        build_collator(tokenizer, args)
    if family == "decoder":  # the JSON example: a Llama-style block
        args = resolve_arguments(config_file=CONFIGS / "decoder-tiny-llama.json")
        config = build_model_config(args, tokenizer)
        assert (config.norm_type, config.gated_mlp, config.num_key_value_heads) == ("rmsnorm", True, 2)


def test_a_block_longer_than_the_position_table_is_refused_and_rotary_has_no_limit(trained):
    tokenizer = AutoTokenizer.from_pretrained(trained["encoder"][0])
    learned = PretrainingArguments(family="encoder", block_size=100, model=dict(max_position_embeddings=64))
    with pytest.raises(PretrainingError, match="--block-size 100 needs max_position_embeddings >= 100 with learned"):
        build_model_config(learned, tokenizer)
    rotary = dict(max_position_embeddings=64, position_embedding_type="rotary")
    assert build_model_config(PretrainingArguments(family="encoder", block_size=100, model=rotary), tokenizer)


def test_flags_override_the_config_file_which_overrides_defaults(tmp_path):
    args = resolve_arguments(
        family="decoder", preset="tiny", overrides={"lr": 0.5, "model": {"num_hidden_layers": 1}}, configs_dir=CONFIGS
    )
    assert args.lr == 0.5 and args.model["num_hidden_layers"] == 1 and args.model["hidden_size"] == 128
    assert args.warmup_steps == 30  # from the preset it extends (tiny-modern); the dataclass default is 100
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"family": "seq2seq", "lr": "1e-3", "max_steps": "20", "model": {"hidden_size": 64}}))
    args = resolve_arguments(config_file=config, overrides={"max_steps": 7})
    assert (args.family, args.lr, args.max_steps, args.preset) == ("seq2seq", 1e-3, 7, "run.json")
    with pytest.raises(PretrainingError, match="is for the seq2seq family"):
        resolve_arguments(family="encoder", config_file=config)
    config.write_text(json.dumps({"family": "decoder", "learning_rate": 1e-3}))
    with pytest.raises(PretrainingError, match="Unknown setting"):
        resolve_arguments(config_file=config)
    with pytest.raises(PretrainingError, match="Unknown decoder config field"):
        resolve_arguments(family="decoder", preset="tiny", overrides={"model": {"hidden_sise": 8}}, configs_dir=CONFIGS)
    with pytest.raises(PretrainingError, match="either --preset or --config"):
        resolve_arguments(family="decoder", preset="tiny", config_file=config)


def test_accelerate_launcher_configs_parse():
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {
        "cpu.yaml": "NO",
        "cpu-2proc.yaml": "MULTI_GPU",
        "ddp.yaml": "MULTI_GPU",
        "fsdp.yaml": "FSDP",
        "deepspeed-zero2.yaml": "DEEPSPEED",
        "deepspeed-zero3.yaml": "DEEPSPEED",
        "multi-node.yaml": "MULTI_GPU",
    }
    folder = CONFIGS / "accelerate"
    assert sorted(path.name for path in folder.glob("*.yaml")) == sorted(expected)
    for name, distributed_type in expected.items():
        config = load_config_from_file(str(folder / name))
        assert config.distributed_type.value == distributed_type, name
    assert load_config_from_file(str(folder / "cpu-2proc.yaml")).num_processes == 2
    assert load_config_from_file(str(folder / "multi-node.yaml")).num_machines == 2


def test_a_finished_run_is_not_resumed_over_and_copies_are_independent(trained, tmp_path):
    # A copy of a finished run resumes from its own last checkpoint (step 30 of 30): no step runs, the final folder
    # is rewritten with the same weights.
    source, metrics = trained["encoder"]
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    resumed = run_pretraining(tiny_args("encoder", copy, resume_from_checkpoint="latest"))
    assert resumed["steps"] == 30 and resumed["history"]["train"] == metrics["history"]["train"]
    assert all(torch.equal(a, b) for a, b in zip(weights(copy).values(), weights(source).values()))


KILLED_FINAL_SAVE = textwrap.dedent(
    """
    import pathlib, runpy, sys, time
    import coreformer.training.pretraining.loop

    marker, script = pathlib.Path(sys.argv[1]), sys.argv[2]

    def plot_losses(history, path, title):  # the new weights are in the staged folder; the swap has not happened
        marker.write_text("saving the final folder")
        time.sleep(300)  # the test kills us here

    coreformer.training.pretraining.loop.plot_losses = plot_losses  # where `finish` looks it up
    sys.argv = [script] + sys.argv[3:]
    runpy.run_path(script, run_name="__main__")
    """
)


@pytest.mark.slow
def test_sigkill_during_the_final_save_leaves_the_previous_final_model(tmp_path):
    # A finished run is continued to more steps and killed while writing its new final folder: the previous final
    # model stays loadable byte for byte, its checkpoints too, and the next resume finishes and cleans up.
    settings = tiny_settings("decoder", max_steps=10, save_every=10)
    output_dir = tmp_path / "run"
    run_pretraining(args_from(settings, output_dir))
    final_files = ("config.json", "model.safetensors", "README.md", "metrics.json", "tokenizer.json")
    before = {name: (output_dir / name).read_bytes() for name in final_files}

    config = tmp_path / "decoder-tiny-test.json"
    config.write_text(json.dumps({"family": "decoder", "model": settings["model"]}))
    marker = tmp_path / "marker"
    longer = {**settings, "max_steps": 20, "resume_from_checkpoint": "latest", "output_dir": str(output_dir)}
    child = fork_python(
        ["-c", KILLED_FINAL_SAVE, str(marker), str(PRETRAIN), "--config", str(config)] + cli_flags(longer),
        child_env(tmp_path),
        tmp_path,
        tmp_path / "child.log",
    )
    child.kill_at_marker(marker)

    assert {name: (output_dir / name).read_bytes() for name in final_files} == before
    assert find_latest_checkpoint(output_dir) == output_dir / "checkpoints" / "step-20"  # saved before the kill
    assert list(tmp_path.glob(".run.partial-*")), "the killed save's staged folder is what is left over"
    resumed = run_pretraining(args_from(settings, output_dir, max_steps=20, resume_from_checkpoint="latest"))
    assert resumed["steps"] == 20 and json.loads((output_dir / "metrics.json").read_text())["steps"] == 20
    assert not list(tmp_path.glob(".run.*"))
    assert [path.name for path in sorted((output_dir / "checkpoints").iterdir())] == ["step-10", "step-20"]


def test_a_tokenizer_folder_without_a_tokenizer_or_a_missing_path_is_one_clear_error(tmp_path):
    model_only = tmp_path / "model-only"
    model_only.mkdir()
    (model_only / "config.json").write_text("{}")
    with pytest.raises(PretrainingError, match=r"holds no tokenizer .* tokenizer.save_pretrained.* omit --tokenizer"):
        run_pretraining(tiny_args("decoder", tmp_path / "out", tokenizer=str(model_only)))
    with pytest.raises(PretrainingError, match=r"does not exist: pass a folder holding a tokenizer"):
        run_pretraining(tiny_args("decoder", tmp_path / "out", tokenizer=str(tmp_path / "nowhere")))
    assert not (tmp_path / "out").exists()


def test_objective_defaults_to_the_familys_and_one_that_trains_another_family_is_refused(tmp_path):
    defaults = {family: tiny_args(family, tmp_path).objective for family in FAMILY_NAMES}
    assert defaults == {"encoder": "masked-lm", "decoder": "causal-lm", "seq2seq": "denoising"}
    with pytest.raises(PretrainingError, match="The causal-lm objective trains decoder models; --family is encoder"):
        tiny_args("encoder", tmp_path, objective="causal-lm")
    with pytest.raises(PretrainingError, match="`objective` must be one of masked-lm, causal-lm, denoising"):
        tiny_args("encoder", tmp_path, objective="electro")


def test_run_summary_names_every_output_and_the_exact_next_commands(tmp_path):
    from coreformer.training.reports import run_summary

    output_dir = tmp_path / "demo"
    for step in (400, 600):
        (output_dir / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (output_dir / "checkpoints" / f"step-{step}" / "trainer_state.json").write_text("{}")
    (output_dir / "logs").mkdir()
    tiny_model(cf.CoreformerDecoderForCausalLM, "decoder").save_pretrained(output_dir)
    args = PretrainingArguments(family="decoder", output_dir=str(output_dir))
    lines = run_summary(args, output_dir).splitlines()
    assert f"  model        {output_dir}/  (AutoModelForCausalLM.from_pretrained('{output_dir}'))" in lines
    assert f"  model card   {output_dir}/README.md" in lines
    assert f"  metrics      {output_dir}/metrics.json, {output_dir}/loss.png, logs/ (TensorBoard)" in lines
    assert (
        f"  checkpoints  {output_dir}/checkpoints/ (step-400, step-600; go on with --resume-from-checkpoint latest)"
        in lines
    )
    finetune = f"coreformer finetune --task causal-lm --model {output_dir} --output-dir {output_dir}-causal-lm"
    assert f"  fine-tune    {finetune}" in lines
    assert f"  publish      coreformer publish {output_dir} --repo-id YOUR_NAME/demo" in lines
    assert f"  export       coreformer export {output_dir} {output_dir}-native --check" in lines
    tiny_model(cf.CoreformerEncoderForMaskedLM, "encoder").save_pretrained(tmp_path / "e")
    encoder = PretrainingArguments(family="encoder", objective="electra", output_dir=str(tmp_path / "e"), save_every=0)
    summary = run_summary(encoder, tmp_path / "e")
    assert "checkpoints  none (save_every is 0)" in summary and "--task sequence-classification" in summary


@pytest.mark.parametrize(
    "family, model_class, settings, export",
    [
        # no native twin (BART has learned positions), so the ONNX export, whose graphs hold it
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, dict(position_embedding_type="rotary"), "onnx"),
        # linear layers: no native twin, and their running state does not fit ONNX's key/value cache graphs
        ("decoder", cf.CoreformerDecoderForCausalLM, dict(layer_types=["linear", "full"]), None),
    ],
)
def test_run_summary_suggests_only_an_export_that_takes_the_model(tmp_path, family, model_class, settings, export):
    from coreformer.training.reports import run_summary

    model = tiny_model(model_class, family, **settings)
    model.save_pretrained(tmp_path / "run")
    with pytest.raises(ValueError, match="cannot export"):  # what `coreformer export --to native` answers
        cf.export.choose_target(model.config, model_class.__name__)
    summary = run_summary(PretrainingArguments(family=family, output_dir=str(tmp_path / "run")), tmp_path / "run")
    exports = [line for line in summary.splitlines() if line.startswith("  export ")]
    if export is None:
        assert exports == []
    else:
        assert exports == [
            f"  export       coreformer export {tmp_path / 'run'} {tmp_path / 'run'}-{export} --to {export} --check"
        ]


def test_time_line_says_minutes_and_seconds_and_whether_the_sample_is_counted():
    from coreformer.training.reports import time_line

    assert time_line(292.4, sampled=True) == (
        "time: 4 min 52 s for this run (data, tokenizer, steps, evaluations, final save, sample; not counting imports)"
    )
    assert time_line(38.25, sampled=False).startswith(
        "time: 38.2 s for this run (data, tokenizer, steps, evaluations, final save;"
    )


def test_resume_refusals_name_the_missing_checkpoint_and_the_run_without_one(tmp_path):
    args = PretrainingArguments(family="decoder", output_dir=str(tmp_path), resume_from_checkpoint="latest")
    assert resolve_resume(args, tmp_path / "new") is None  # nothing to resume yet: the same command starts the run
    (tmp_path / "metrics.json").write_text("{}")  # a run's folder, without any checkpoint
    with pytest.raises(PretrainingError, match=r"holds a run but no complete checkpoint under checkpoints/\. Pass"):
        resolve_resume(args, tmp_path)
    args.resume_from_checkpoint = str(tmp_path / "checkpoints" / "step-9")
    with pytest.raises(PretrainingError, match=r"--resume-from-checkpoint '.*step-9' does not exist\."):
        resolve_resume(args, tmp_path)


def test_a_dynamo_backend_in_the_environment_never_reaches_the_saved_keys(tmp_path, monkeypatch):
    # `accelerate launch` with a dynamo config, or a TrainingArguments(torch_compile=True) made earlier in the process,
    # sets ACCELERATE_DYNAMO_BACKEND; Accelerate's compile wrapper would then prefix every saved key with `_orig_mod.`.
    from safetensors.torch import load_file

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    run_pretraining(tiny_args("decoder", tmp_path / "run", max_steps=1, eval_every=0, warmup_steps=0))
    keys = set(load_file(tmp_path / "run" / "model.safetensors"))
    assert "model.decoder.embed_tokens.weight" in keys and not any(key.startswith("_orig_mod.") for key in keys)


def test_an_earlier_accelerators_compile_plugin_never_reaches_the_saved_keys(tmp_path):
    # Accelerate keeps one state per process: a Trainer built earlier with torch_compile=True left its dynamo plugin
    # there, and the run's own Accelerator reused it.
    from accelerate import Accelerator
    from safetensors.torch import load_file

    Accelerator(dynamo_backend="inductor")
    run_pretraining(tiny_args("decoder", tmp_path / "run", max_steps=1, eval_every=0, warmup_steps=0))
    keys = set(load_file(tmp_path / "run" / "model.safetensors"))
    assert "model.decoder.embed_tokens.weight" in keys and not any(key.startswith("_orig_mod.") for key in keys)


def test_a_run_whose_loss_stops_being_finite_stops_there_and_keeps_its_checkpoints(tmp_path, monkeypatch):
    from coreformer.training.pretraining import loop as pretraining_loop

    real_step = pretraining_loop.train_step

    def diverging_step(run, training):  # a step whose update turned the weights NaN
        loss, lr, tokens = real_step(run, training)
        return (float("nan") if training.step == 4 else loss), lr, tokens

    monkeypatch.setattr(pretraining_loop, "train_step", diverging_step)
    args = tiny_args("decoder", tmp_path / "run", max_steps=8, save_every=2, eval_every=0, mixed_precision="bf16")
    with pytest.raises(PretrainingError) as refusal:
        run_pretraining(args)
    message = str(refusal.value)
    assert message.startswith("the training loss became nan at step 5: the model diverged")
    assert "Lower --lr (now 0.003) or raise --warmup-steps (now 3), or train in fp32 (--mixed-precision no" in message
    assert [path.name for path in list_checkpoints(tmp_path / "run")] == ["step-2", "step-4"]
    assert not (tmp_path / "run" / "metrics.json").exists()  # no final folder of a diverged model


FINAL_FILES = ("config.json", "model.safetensors", "README.md", "metrics.json", "tokenizer.json")


def _stop_at_step(monkeypatch, stop: int) -> None:
    """Ctrl-C when step `stop` begins, in this process (where `train` looks `train_step` up)."""
    import coreformer.training.pretraining.loop as pretraining_loop

    original = pretraining_loop.train_step

    def train_step(run, training):
        if training.step == stop - 1:
            raise KeyboardInterrupt
        return original(run, training)

    monkeypatch.setattr(pretraining_loop, "train_step", train_step)


@pytest.mark.slow
def test_an_overwrite_rerun_stopped_before_it_saves_gives_the_folder_back_to_the_previous_run(tmp_path, monkeypatch):
    settings = tiny_settings("decoder", max_steps=6, eval_every=3)
    output_dir = tmp_path / "run"
    run_pretraining(args_from(settings, output_dir))
    before = {name: (output_dir / name).read_bytes() for name in FINAL_FILES}

    _stop_at_step(monkeypatch, 4)
    with pytest.raises(RunStoppedError, match=r"stopped at step 3, before the first checkpoint; the run it was replac"):
        run_pretraining(args_from(settings, output_dir, overwrite=True, seed=7))
    assert {name: (output_dir / name).read_bytes() for name in FINAL_FILES} == before
    assert not list(tmp_path.glob(".run.*"))
    assert AutoModelForCausalLM.from_pretrained(output_dir) is not None


@pytest.mark.slow
def test_an_overwrite_rerun_replaces_the_previous_run_once_it_has_a_checkpoint(tmp_path, monkeypatch):
    settings = tiny_settings("decoder", max_steps=6, eval_every=3)
    output_dir = tmp_path / "run"
    run_pretraining(args_from(settings, output_dir))

    _stop_at_step(monkeypatch, 4)
    with pytest.raises(RunStoppedError, match="continue with --resume-from-checkpoint latest"):
        run_pretraining(args_from(settings, output_dir, overwrite=True, save_every=2))
    assert not list(tmp_path.glob(".run.*")) and not (output_dir / "config.json").exists()
    assert find_latest_checkpoint(output_dir) == output_dir / "checkpoints" / "step-2"


def test_a_killed_overwrite_rerun_is_settled_when_the_next_run_opens_the_folder(tmp_path):
    from coreformer.hub.folders import set_aside, set_aside_path
    from coreformer.training.pretraining import settle_set_aside_run

    # killed before it saved: the previous run comes back
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    set_aside(folder)
    (folder / "run_config.json").write_text("{}")  # all the killed rerun wrote
    settle_set_aside_run(folder)
    assert (folder / "config.json").exists() and not (folder / "run_config.json").exists()
    assert not set_aside_path(folder).exists()

    # killed after it saved (between its save and dropping the previous run): the previous run goes
    set_aside(folder)
    (folder / "config.json").write_text('{"new": true}')
    settle_set_aside_run(folder)
    assert json.loads((folder / "config.json").read_text()) == {"new": True}
    assert not set_aside_path(folder).exists()


@pytest.mark.slow
def test_evaluating_an_unfinished_run_says_how_to_finish_it_and_that_advice_works(tmp_path, monkeypatch):
    from coreformer.training.zero_shot import EvaluationError, load_language_model

    settings = tiny_settings("decoder", max_steps=6, eval_every=3, save_every=2)
    output_dir = tmp_path / "run"
    _stop_at_step(monkeypatch, 4)
    with pytest.raises(RunStoppedError):
        run_pretraining(args_from(settings, output_dir))
    monkeypatch.undo()
    checkpoint = output_dir / "checkpoints" / "step-2"
    for folder, what in ((output_dir, "is a pretraining run"), (checkpoint, "is a checkpoint of")):
        with pytest.raises(EvaluationError, match=f"{what}.*latest.*--max-steps 2 .*step 2"):
            load_language_model(folder)
    # the advice: resuming to the checkpoint's own step writes the model as it is there, without training
    finished = run_pretraining(args_from(settings, output_dir, resume_from_checkpoint="latest", max_steps=2))
    assert finished["steps"] == 2
    model, _, family = load_language_model(output_dir)
    assert family == "decoder" and type(model).__name__ == "CoreformerDecoderForCausalLM"


def test_evaluating_a_run_stopped_before_its_first_checkpoint_says_it_holds_no_model(tmp_path):
    from coreformer.training.zero_shot import EvaluationError, load_language_model

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_config.json").write_text("{}")
    with pytest.raises(EvaluationError, match="stopped before its first checkpoint, so it holds no model"):
        load_language_model(tmp_path / "run")


def test_a_run_says_its_data_and_when_it_first_saves_before_the_first_step():
    from coreformer.training.reports import checkpoint_plan_line, data_line

    assert data_line({"train": 1234, "validation": 30}, 5678, 128) == (
        "data: 1,234 documents for training, 30 held out; 5,678 training examples of up to 128 tokens"
    )
    # the encoder's tiny preset: a Ctrl-C before step 800 keeps nothing, and the run says so up front
    assert checkpoint_plan_line(800, 1600, 0).startswith("checkpoints: every 800 steps, the next at step 800 (a Ctrl-C")
    assert "the next at step 1200" in checkpoint_plan_line(400, 1600, 800)  # resumed at 800
    assert checkpoint_plan_line(0, 600, 0) == "checkpoints: none (--save-every 0); only the final model is saved"
    assert checkpoint_plan_line(800, 600, 0).startswith("checkpoints: none before the final model")


def test_the_layer_types_config_of_the_guide_builds_the_model_it_names(tmp_path):
    # docs/guides/pretraining.md "Choosing layer types": the YAML of its block, resolved as `--config` resolves it
    page = (REPO / "docs" / "guides" / "pretraining.md").read_text()
    section = page.split("## Choosing layer types")[1].split("\n## ")[0]
    config_text = section.split("<<'YAML'\n")[1].split("\nYAML\n")[0]
    (tmp_path / "sliding-decoder.yaml").write_text(config_text)
    assert "coreformer pretrain --config sliding-decoder.yaml" in section
    args = resolve_arguments(config_file=tmp_path / "sliding-decoder.yaml", configs_dir=CONFIGS)
    tiny = resolve_arguments(family="decoder", preset="tiny", configs_dir=CONFIGS)
    assert (args.max_steps, args.optimizer) == (tiny.max_steps, tiny.optimizer)  # the preset it extends
    from coreformer.training.tokenizer_training import train_tokenizer

    tokenizer = train_tokenizer("decoder", ["def sliding(window):\n    return window\n"] * 20, vocab_size=300)
    config = build_model_config(args, tokenizer)
    assert config.layer_types == ["sliding", "sliding", "sliding", "full"] and config.sliding_window == 32
    model = cf.CoreformerDecoderForCausalLM(config)
    assert [layer.self_attn.layer_type for layer in model.model.decoder.layers] == config.layer_types
