"""Fine-tuning checkpoints: transformers' Trainer writes them, this module makes them atomic and resumable.

    CHECKPOINTING_TRAINERS[generates]      Trainer / Seq2SeqTrainer whose `checkpoint-N` saves are atomic
    resolve_resume(args, ...)              --resume-from-checkpoint -> (checkpoint, its run record) or (None, None)
    RUN_RECORD                             what a checkpoint adds to Trainer's files: settings, processes, "before"

Trainer (5.23) writes `checkpoint-N` in place, file by file, and its `get_last_checkpoint` takes the highest number
whatever the folder holds, so a kill during a save leaves a half-written newest checkpoint that a resume would pick.
Here Trainer still decides when to save (save_strategy "steps", save_steps) and writes everything it writes (model,
tokenizer, optimizer, scheduler, every process's RNG, trainer_state.json), but into a hidden folder that is renamed
into place when every process is done, under the layout and names pretraining uses (checkpoints.py):

    output_dir/checkpoints/
      .saving/checkpoint-N/      Trainer's save in progress (a kill leaves it; the next save deletes it)
      step-N/                    complete: Trainer's files + fine_tuning_run.json, renamed in one step
      step-M/ ...                the last --save-total-limit of them (Trainer's rotate_checkpoints)

Resuming goes through Trainer's own `train(resume_from_checkpoint=step-N)`: weights, optimizer, schedule, RNG of
every process and the data position (it skips the batches already trained).

FSDP2 on CPU processes (`shard_with(engine)`, engine.py's CpuFsdp2Engine): the model is sharded by `fully_shard` before
training and handed to Trainer as a model "sharded at load time" (`is_distributed_loading_by_transformers`, the flag
transformers 5.23 sets on `from_pretrained(distributed_config=...)` models): Trainer then leaves placement and
gradient reduction to FSDP (no DDP wrap, `set_requires_gradient_sync(False)` while accumulating) and calls its model
save on every rank. Trainer refuses checkpoints for such models (its `__init__`: "their optimizer state cannot be
checkpointed"), because its `_save_optimizer_and_scheduler` pickles `optimizer.state_dict()` on the main process
alone, which under FSDP2 holds only rank 0's shards. Here that part is the engine's instead: every rank writes its
shards of the model and optimizer as a torch.distributed.checkpoint folder (`dcp/`, as pretraining does) and reads
them back on resume. Trainer's model save is given an unsharded copy with the gathered weights (`_save`); Trainer
still writes the RNG states and trainer_state.json:

    checkpoints/step-N/   config.json, model.safetensors (gathered)   Trainer's save_model, of the unsharded copy
                          dcp/.metadata, __0_0.distcp, __1_0.distcp   model + optimizer shards, one file per rank
                          scheduler.pt, random_states_R.pkl           the engine's
                          rng_state_R.pth, trainer_state.json         Trainer's (R: every rank)
"""

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from coreformer_settings.finetuning import RUN_MARKERS, check_run_folder

from ...hub.folders import replace_folder
from ..arguments import RUN_CONFIG, FinetuningError, holds_run, write_json
from ..checkpoints import check_unchanged, requested_checkpoint
from ..engine import CpuFsdp2Engine

RUN_RECORD = "fine_tuning_run.json"  # {"args": settings, "world_size": processes, "before": metrics before training}
_SAVING = ".saving"
_STEP_PREFIX = "step"  # checkpoints/step-N, as pretraining names them

# Settings that do not change what training computes (where things go, what is logged or evaluated, how often it
# saves): a resume may change them. Every other setting must be the one the checkpoint was saved with.
RESUME_FREE = frozenset(
    {
        "output_dir",
        "overwrite",
        "resume_from_checkpoint",
        "report_to",
        "logging_steps",
        "eval_steps",
        "eval_batch_size",
        "max_eval_examples",
        "generation_max_length",
        "num_beams",
        "max_answer_length",
        "save_every",
        "save_total_limit",
    }
)


class _AtomicCheckpoints:
    """Trainer mixin: each checkpoint is written by Trainer into checkpoints/.saving/checkpoint-N and renamed to
    checkpoints/step-N once complete on every process; the previous run's checkpoints go at the first save of a
    fresh run (not before: a run stopped before its first save leaves the folder as it was)."""

    checkpoint_root: Path  # output_dir/checkpoints
    run_record: dict[str, Any]  # written into every checkpoint (RUN_RECORD)
    fresh_start: bool  # not resumed: older checkpoints under checkpoint_root belong to a previous run
    saved_checkpoints: int = 0
    _writing: bool = False
    sharded_by: CpuFsdp2Engine | None = None  # FSDP2 applied here, its checkpoints DCP (module docstring)

    def shard_with(self, engine: CpuFsdp2Engine) -> None:
        """Shard the model in place with `engine` (one FSDP2 unit per block, then the root) before Trainer prepares
        it, and have Trainer treat it as already distributed (module docstring)."""
        from torch.distributed.fsdp import register_fsdp_forward_method

        engine.shard(self.model)
        if hasattr(self.model, "generate"):
            # generate() calls the encoder and the LM head without the root's forward, which is what all-gathers the
            # root unit (embeddings, tied head): registered, it gathers too (as Trainer does under Accelerate's FSDP).
            register_fsdp_forward_method(self.model, "generate")
        self.sharded_by = engine
        self.is_distributed_loading_by_transformers = True  # read from here on by train / save (module docstring)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.sharded_by is None:
            return super()._save(output_dir, state_dict)
        # save_pretrained gathers FSDP2 shards only for models transformers sharded itself (config.distributed_config),
        # and would write FSDP's own source files for this one's FSDP<Class> class: the main process saves an
        # unsharded copy (its weights gathered on every process) through Trainer's own _save instead.
        copy = self.sharded_by.unsharded_copy(self.accelerator, self.model)
        if copy is not None:
            sharded, self.model = self.model, copy
            try:
                super()._save(output_dir)
            finally:
                self.model = sharded

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharded_by is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.sharded_by.save_state(self.accelerator, self.model, self.optimizer, self.lr_scheduler, Path(output_dir))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.sharded_by is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # The weights come back with the optimizer, from the DCP shards, in _load_optimizer_and_scheduler.

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.sharded_by is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.sharded_by.load_state(self.accelerator, self.model, self.optimizer, self.lr_scheduler, Path(checkpoint))

    def _get_output_dir(self, trial) -> str:
        # Trainer's "run folder" is where its checkpoints go; while saving, the hidden folder they are built in.
        return str(self.checkpoint_root / _SAVING if self._writing else self.checkpoint_root)

    def _save_checkpoint(self, model, trial) -> None:
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        saving, final = (
            self.checkpoint_root / _SAVING,
            self.checkpoint_root / f"{_STEP_PREFIX}-{self.state.global_step}",
        )
        if self.args.should_save:
            if self.fresh_start and not self.saved_checkpoints:
                shutil.rmtree(self.checkpoint_root, ignore_errors=True)  # the previous run's (--overwrite)
            shutil.rmtree(saving, ignore_errors=True)  # a save that a kill interrupted
        self.accelerator.wait_for_everyone()
        self._writing = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._writing = False
        self.accelerator.wait_for_everyone()  # every process's RNG state is in
        if self.args.should_save:
            write_json(saving / name / RUN_RECORD, self.run_record)
            replace_folder(saving / name, final)  # final exists when re-saving a step after resuming an older one
            saving.rmdir()
            rotate_checkpoints(str(self.checkpoint_root), self.args.save_total_limit, checkpoint_prefix=_STEP_PREFIX)
        self.saved_checkpoints += 1
        self.accelerator.wait_for_everyone()


class CheckpointingTrainer(_AtomicCheckpoints, transformers.Trainer):
    pass


class CheckpointingSeq2SeqTrainer(_AtomicCheckpoints, transformers.Seq2SeqTrainer):
    def evaluation_loop(self, *args, **kwargs):
        # Seq2SeqTrainer's evaluate / predict set gather_function to accelerator.gather ("we don't want to drop
        # samples"), which keeps the copies Accelerate's even_batches adds to fill the last batch of every process:
        # on 2 processes 8 validation examples came back as 16 generations (DDP and FSDP2 alike), one per prediction
        # row and in the metrics. gather_for_metrics drops exactly those copies, as Trainer itself gathers.
        self.gather_function = functools.partial(
            self.accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
        )
        return super().evaluation_loop(*args, **kwargs)


CHECKPOINTING_TRAINERS = {False: CheckpointingTrainer, True: CheckpointingSeq2SeqTrainer}  # by task.generates


def run_settings(args) -> dict[str, Any]:
    """The settings a resume must keep (everything but RESUME_FREE)."""
    settings = dataclasses.asdict(args)
    settings.update(settings.pop("task_settings", {}))  # the task's own, by their names as flags and configs give them
    return {key: value for key, value in settings.items() if key not in RESUME_FREE}


def _finished_here(output_dir: Path, record: dict, state: dict, run_config: str) -> bool:
    """Whether `output_dir` holds the final model of the run the checkpoint belongs to (its settings, its last
    step), not that of a previous run the checkpoint's run was killed before replacing."""
    config, final_state = output_dir / run_config, output_dir / "trainer_state.json"
    if not (config.is_file() and final_state.is_file()):
        return False
    settings = json.loads(config.read_text())
    same_run = all(settings.get(key) == value for key, value in record["args"].items())
    return same_run and json.loads(final_state.read_text())["global_step"] >= state["global_step"]


def resolve_resume(args, world_size: int) -> tuple[Path | None, dict[str, Any] | None]:
    """(checkpoint, its run record) to resume, or (None, None) to start fresh, with pretraining's refusals: a missing
    or incomplete checkpoint, a folder that holds a run but no checkpoint, other settings; and a finished run (its
    final folder, with RUN_CONFIG and trainer_state.json, in output_dir)."""
    output_dir = Path(args.output_dir)
    if args.resume_from_checkpoint is None:
        check_run_folder(output_dir, args.overwrite)
        return None, None
    is_run = output_dir.is_dir() and holds_run(output_dir, RUN_MARKERS)
    checkpoint, state = requested_checkpoint(
        args.resume_from_checkpoint, output_dir, holds_run=is_run, error=FinetuningError
    )
    if checkpoint is None:
        check_run_folder(output_dir, args.overwrite)
        return None, None
    if output_dir.resolve() not in checkpoint.resolve().parents:  # continuing another run's checkpoint elsewhere
        check_run_folder(output_dir, args.overwrite)
    if not (checkpoint / RUN_RECORD).is_file():
        raise FinetuningError(
            f"{str(checkpoint)!r} is not a fine-tuning checkpoint (no {RUN_RECORD}): pass a checkpoints/step-N folder "
            f"of a `coreformer finetune` run."
        )
    record = json.loads((checkpoint / RUN_RECORD).read_text())
    saved, current = record["args"], run_settings(args)
    if saved.get("task") != args.task:  # another task owns other settings: the task is the difference to name
        saved, current = {"task": saved.get("task")}, {"task": args.task}
    check_unchanged(
        checkpoint,
        saved,
        current,
        what="other settings",
        fix="resume with the settings it was started with, listed in its " + RUN_RECORD,
        error=FinetuningError,
    )
    if record["world_size"] != world_size:
        # Trainer's resume skips the batches already trained counted per process (steps x batch x accumulation of
        # THIS world size) and restores rng_state_R.pth by rank: on another number of processes it would train other
        # examples from another random state. The weights (DDP: full; FSDP2: DCP, which reshards) would load.
        raise FinetuningError(
            f"Checkpoint {str(checkpoint)!r} was saved by {record['world_size']} process(es) and this run has "
            f"{world_size}: Trainer continues the data order and random state exactly only on the same number of "
            f"processes. Resume with {record['world_size']} process(es) (the launcher line it was started with), or "
            f"fine-tune from the checkpoint's weights as a new run: --model {str(checkpoint)!r} without "
            f"--resume-from-checkpoint."
        )
    if state["global_step"] >= state["max_steps"] and _finished_here(output_dir, record, state, RUN_CONFIG):
        raise FinetuningError(
            f"Checkpoint {str(checkpoint)!r} is the end of a finished run (step {state['global_step']} of "
            f"{state['max_steps']}), whose model is in {str(output_dir)!r}: nothing to resume. Pass --overwrite "
            f"without --resume-from-checkpoint to train again, or choose another --output-dir."
        )
    return checkpoint, record
