"""Fine-tuning on transformers' `Trainer`: every registered task (tasks/) over any coreformer folder, each with an
offline default dataset.

    FinetuningArguments                every run setting (a CLI flag per field, plus run_glue / run_qa style aliases;
                                       declared in the torch-free coreformer_settings.finetuning)
    resolve_arguments(...)             dataclass defaults < --config file (YAML / JSON) < flags given
    run_finetuning(args) -> dict       prepare (checks, resume, data, labels, model + LoRA), train (the engine,
                                       evaluate before, Trainer, evaluate after), finish (save the folder)
    evaluate_folder(folder, args)      reload a saved folder with its Auto class and evaluate it on the same split

Metrics come from the shipped offline `evaluate` modules through `coreformer.training.tasks.metrics`'s builders; the
model is evaluated once before training too (`before_eval_*` beside `eval_*`), so a run shows what training bought.

An output folder, as a run leaves it (the final files are written into a hidden sibling folder, renamed into place
at the end, so a crash never leaves a half-written `output_dir`; only the checkpoints are written into it during
the run, each atomically: checkpoints.py):

    output_dir/
      config.json, model.safetensors, modeling code, tokenizer files [, generation_config.json]
      README.md                          model card (coreformer.hub.model_card, kind "fine-tuned")
      eval_results.json, train_results.json, all_results.json, trainer_state.json, run_config.json
      eval_predictions.jsonl             one line per validation example (tasks that predict rows)
      adapter/                           --peft lora only: the LoRA adapter (the folder itself holds the merged model)
      checkpoints/step-N/                every --save-every steps and at the end, the last --save-total-limit kept:
                                         Trainer's checkpoint + fine_tuning_run.json (--resume-from-checkpoint latest)

QA and seq2seq folders carry coreformer's custom pipeline (`save_with_pipeline`), so
`pipeline(model=output_dir, trust_remote_code=True)` works where transformers 5 has no QA / text2text pipeline.

The stages' parts live beside this file, in this package: arguments.py (the run's settings), data.py (data,
columns, labels, the base model's config and tokenizer), trainer.py (the Trainer, the evaluation before training, the
engine), checkpoints.py (Trainer's checkpoints, written atomically, and resume) and card.py (the model card).
"""

import dataclasses
import json
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from transformers import PreTrainedTokenizerBase

from coreformer_settings.base import CHECKPOINTS_DIR
from coreformer_settings.finetuning import ADAPTER_DIR

from ...hub.folders import link_into, staged_folder
from ...hub.model_card import write_model_card
from ...pipelines import save_with_pipeline
from ..arguments import RUN_CONFIG, FinetuningError, RunStoppedError, export_run, write_json
from ..checkpoints import stopped_message
from ..engine import CpuFsdp2Engine, Engine
from .arguments import FinetuningArguments, resolve_arguments
from .card import finetuned_card_info
from .checkpoints import resolve_resume, run_settings
from .data import (
    labels_for,
    load_finetuning_tokenizer,
    load_model_config,
    load_task_data,
    read_label_names,
)
from .trainer import (
    MetricsBeforeTraining,
    PreparedTask,
    build_trainer,
    predict_validation,
    prepare_task,
    run_engine,
)

PREDICTIONS = "eval_predictions.jsonl"
# What a run leaves in its output folder: a folder holding any of these is a previous run (--overwrite replaces it).

__all__ = ["FinetuningArguments", "evaluate_folder", "resolve_arguments", "run_finetuning"]


# ---------------------------------------------------------------------------------------------------------------------
# The model with its head
# ---------------------------------------------------------------------------------------------------------------------


def _attach_lora(model, args: FinetuningArguments):
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=getattr(TaskType, args.spec.peft_task_type),
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_modules,
    )
    try:
        with warnings.catch_warnings():  # PEFT reads transformers' deprecated alias; a FutureWarning on every run
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as error:  # target modules that do not exist
        raise FinetuningError(f"--lora-target-modules {args.lora_target_modules!r}: {error}") from error


# ---------------------------------------------------------------------------------------------------------------------
# The run: prepare, train, finish
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What `prepare` hands to training and to the save: everything checked, nothing written."""

    args: FinetuningArguments
    family: str
    tokenizer: PreTrainedTokenizerBase
    model: Any
    prepared: PreparedTask
    data_description: str
    num_parameters: int
    world_size: int
    resume: Path | None  # the checkpoint to continue from (--resume-from-checkpoint), None for a fresh start
    resume_record: dict[str, Any] | None  # the checkpoint's RUN_RECORD (its metrics before training, its engine)


class _NoLoadReport(logging.Filter):
    """Drops transformers' LOAD REPORT table (a row per tensor); load_with_head says the same in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def _modules(keys: list) -> str:
    """lm_head.dense.weight, lm_head.dense.bias -> lm_head.dense (mismatched keys come as (key, shapes...))."""
    names = [key[0] if isinstance(key, tuple) else key for key in keys]
    return ", ".join(sorted({name.rsplit(".", 1)[0] for name in names}))  # transformers gives them as a set


def load_with_head(auto_class, path: str, **kwargs):
    """`auto_class.from_pretrained(path)` with transformers' load report replaced by one line: the modules newly
    initialised (the task's head), re-initialised for a new size, and left unused (the pretraining head)."""
    source = logging.getLogger("transformers.modeling_utils")
    quiet = _NoLoadReport()
    source.addFilter(quiet)
    try:
        model, info = auto_class.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        source.removeFilter(quiet)
    parts = [
        f"{what}: {_modules(info[key])}"
        for key, what in (
            ("missing_keys", "newly initialised"),
            ("mismatched_keys", "re-initialised for the new size"),
            ("unexpected_keys", "not used from the checkpoint"),
        )
        if info[key]
    ]
    if parts:
        print(f"loaded {path} into {type(model).__name__}; {'; '.join(parts)}")
    return model


def prepare(args: FinetuningArguments, world_size: int = 1) -> _Run:
    """Every check (output folder, resume checkpoint, model, task / family, data, columns, labels) and the model with
    its new head."""
    resume, record = resolve_resume(args, world_size)
    config, family = load_model_config(args.model, args.task)
    tokenizer = load_finetuning_tokenizer(args, args.model)
    splits, data_description = load_task_data(args)
    label_names, label_of = labels_for(args, splits, config)

    transformers.set_seed(args.seed)  # the new head's initialisation
    head_kwargs = {}
    if label_names is not None:
        head_kwargs = dict(
            num_labels=len(label_names),
            id2label=dict(enumerate(label_names)),
            label2id={name: index for index, name in enumerate(label_names)},
            ignore_mismatched_sizes=args.ignore_mismatched_sizes,
        )
    model = load_with_head(getattr(transformers, args.spec.auto_class), args.model, **head_kwargs)
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id  # a decoder classifier finds the last token by padding
    prepared = prepare_task(args, splits, tokenizer, model, label_names, label_of)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    if args.peft == "lora":
        model = _attach_lora(model, args)
    return _Run(args, family, tokenizer, model, prepared, data_description, num_parameters, world_size, resume, record)


def _stopped(run: _Run, trainer) -> str:
    """Ctrl-C's one line: the step reached and how to go on (from a checkpoint of this run, or from the start)."""
    step, output_dir = trainer.state.global_step, Path(run.args.output_dir)
    if trainer.saved_checkpoints or run.resume is not None:
        return stopped_message(output_dir, step, f"continue with --resume-from-checkpoint {run.resume}")
    why = "no checkpoints are kept (--save-every 0)" if not run.args.save_every else "before the first checkpoint"
    return f"stopped at step {step}, {why}; run the command again to start over ({output_dir} is as it was before)"


def train(run: _Run, staging: Path) -> tuple[Any, Engine, dict[str, float], dict[str, float], list[dict]]:
    """The engine, the evaluation before training, Trainer over the prepared data (from the resumed checkpoint, if
    any), then the evaluation of the trained model: (trainer, engine, train metrics, eval metrics with the `before_`
    ones, prediction rows)."""
    record = {"args": run_settings(run.args), "world_size": run.world_size}
    if run.resume_record is not None:  # resumed: the metrics before training come from the checkpoint
        record["before"] = run.resume_record["before"]
    trainer = build_trainer(
        run.args,
        run.model,
        run.tokenizer,
        run.prepared,
        staging,
        resume=run.resume,
        run_record=record,
        evaluate_first=run.resume is None,
    )
    engine = run_engine(trainer, run.args, run.resume_record)
    record["engine"] = engine.record()
    trainer.add_callback(MetricsBeforeTraining(run.args.spec, record, announce=trainer.is_world_process_zero()))
    try:
        train_output = trainer.train(resume_from_checkpoint=str(run.resume) if run.resume is not None else None)
    except KeyboardInterrupt:
        for callback in trainer.callback_handler.callbacks:  # end the progress bar's line before the message
            if isinstance(callback, transformers.ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.close()
        raise RunStoppedError(_stopped(run, trainer)) from None
    train_metrics = {key: float(value) for key, value in train_output.metrics.items()}
    train_metrics.update(train_steps=float(trainer.state.global_step), train_samples=float(len(run.prepared.train)))
    eval_metrics, rows = predict_validation(trainer, run.args, run.prepared, run.tokenizer)
    trainer.log(eval_metrics)
    return trainer, engine, train_metrics, {**eval_metrics, **record.get("before", {})}, rows


def trained_model(trainer, engine: Engine):
    """The trained model as the final folder saves it: Trainer's, or under FSDP2 on CPU processes an unsharded copy
    on the main process (None elsewhere) with the weights gathered from every rank's shards (a collective: every
    process calls it)."""
    if isinstance(engine, CpuFsdp2Engine):
        return engine.unsharded_copy(trainer.accelerator, trainer.model)
    return trainer.model


def finish(
    run: _Run, trainer, engine: Engine, trained, staging: Path, metrics: dict[str, dict[str, float]], rows: list[dict]
) -> None:
    """The model (merged, with its adapter beside it under LoRA), tokenizer, results (with the engine that ran),
    predictions and cards."""
    args, output_dir, everything = run.args, Path(run.args.output_dir), metrics["all"]
    adapter_parameters = sum(p.numel() for p in trained.parameters() if p.requires_grad)  # LoRA + copied heads
    if args.peft == "lora":
        trained.save_pretrained(staging / ADAPTER_DIR)
        run.tokenizer.save_pretrained(staging / ADAPTER_DIR)
        trained = trained.merge_and_unload()
    if args.spec.generates:  # the saved generation config generates as the evaluation did, not to transformers' 20
        trained.generation_config.max_length = args.generation_max_length or args.max_target_length
        trained.generation_config.num_beams = args.num_beams
    save_with_pipeline(trained, run.tokenizer, staging)
    for split, values in metrics.items():
        recorded = {**values, "engine": engine.record()}  # what ran, as in pretraining's metrics.json
        trainer.save_metrics(split, recorded, combined=split != "all")
    trainer.state.save_to_json(str(staging / "trainer_state.json"))
    checkpoints = Path(args.output_dir).expanduser().resolve() / CHECKPOINTS_DIR
    if checkpoints.is_dir() and (
        trainer.saved_checkpoints or (run.resume is not None and run.resume.parent.resolve() == checkpoints)
    ):
        link_into(checkpoints, staging / CHECKPOINTS_DIR)  # this run's checkpoints stay (hard links: nothing copied)
    write_json(staging / RUN_CONFIG, dataclasses.asdict(args))
    if rows:
        with open(staging / PREDICTIONS, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    info = finetuned_card_info(args, run.family, run.num_parameters, everything, run.data_description, False)
    write_model_card(staging, info, path_hint=str(output_dir))
    if args.peft == "lora":
        adapter_info = finetuned_card_info(args, run.family, adapter_parameters, everything, run.data_description, True)
        write_model_card(staging / ADAPTER_DIR, adapter_info, path_hint=str(output_dir / ADAPTER_DIR))
    export_run(args.export, staging)


def run_finetuning(args: FinetuningArguments) -> dict[str, Any]:
    """Fine-tune `args.model` on `args.task` and write the folder described in the module docstring.

    Every check runs before anything is written (`prepare`); the folder appears complete or not at all.

    Returns:
        The metrics also written to all_results.json (train_* and eval_* keys, as the example scripts write them).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    run = prepare(args, world_size)
    # Trainer writes into a hidden sibling that replaces output_dir in one step at the end (coreformer.hub.folders):
    # a crash or a kill at any moment leaves the previous run intact.
    # Under torchrun / accelerate launch every process trains into one staged folder (named after the launcher);
    # the main process alone writes the results and swaps the folder in.
    multi_process = world_size > 1
    main_process = int(os.environ.get("RANK", "0")) == 0
    launcher_pid = os.getppid() if multi_process else None
    with staged_folder(Path(args.output_dir), main_process=main_process, launcher_pid=launcher_pid) as staging:
        trainer, engine, train_metrics, eval_metrics, rows = train(run, staging)
        everything = {**train_metrics, **eval_metrics, "epoch": float(trainer.state.epoch or 0.0)}
        trained = trained_model(trainer, engine)
        if trainer.is_world_process_zero():
            metrics = {"train": train_metrics, "eval": eval_metrics, "all": everything}
            finish(run, trainer, engine, trained, staging, metrics, rows)
        trainer.accelerator.wait_for_everyone()  # the main process swaps only when every process is done
    return everything


def evaluate_folder(folder: str | Path, args: FinetuningArguments) -> tuple[dict[str, float], list[dict]]:
    """Load a fine-tuned folder with the task's Auto class and its own tokenizer and labels, and evaluate it on the
    validation split `args` describes, exactly as `run_finetuning` does at the end of training.

    Returns:
        (eval metrics, prediction rows as in eval_predictions.jsonl). Nothing is written.
    """
    folder = str(folder)
    args = dataclasses.replace(args, model=folder, tokenizer=None, peft="none")
    config, _ = load_model_config(folder, args.task)
    tokenizer = load_finetuning_tokenizer(args, folder)
    splits, _ = load_task_data(args)
    label_names, label_of = None, None
    if args.spec.labels is not None:
        _, label_of = read_label_names(splits, args.label_column, per_token=args.spec.labels == "word")
        label_names = [config.id2label[index] for index in sorted(config.id2label)]
    model = getattr(transformers, args.spec.auto_class).from_pretrained(folder)
    prepared = prepare_task(args, splits, tokenizer, model, label_names, label_of, with_train=False)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = build_trainer(args, model, tokenizer, prepared, Path(scratch))
        return predict_validation(trainer, args, prepared, tokenizer)
