"""The transformers `Trainer` a fine-tuning run trains and evaluates with (the driver's `train` stage).

    prepare_task(args, splits, ...)    features of both splits, the collator and compute_metrics of the task
    build_trainer(args, model, ...)    Trainer (Seq2SeqTrainer for tasks that generate) over the prepared data,
                                       writing only its atomic checkpoints (checkpoints.py); under
                                       --padding-free its training batches are flattened rows (PaddingFreeTraining)
    MetricsBeforeTraining, BEFORE      the evaluation before the first step, kept as `before_eval_*`
    run_engine(trainer, args, ...)     the engine that runs (engine.py), checked against a resumed checkpoint
    predict_validation(trainer, ...)   the metrics and prediction rows of the validation split
    with_examples(rows, args, ...)     prediction rows beside the inputs and gold answers they came from

Only the checkpoints are written while training; the final folder is the driver's `finish`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import transformers
from transformers import PreTrainedTokenizerBase

from ...pipelines import input_length_limit
from ..arguments import FinetuningError
from ..checkpoints import CHECKPOINTS_DIR, check_unchanged
from ..engine import CpuFsdp2Engine, Engine, requested_engine, resolve_engine
from ..families import longest_input
from ..tasks import Evaluation, Task
from ..threads import choose_threads
from .arguments import FinetuningArguments
from .checkpoints import CHECKPOINTING_TRAINERS, CheckpointingTrainer


@dataclass
class PreparedTask:
    """A task's data in model form, with the collator and metrics that go with it."""

    train: datasets.Dataset | None
    evaluation: Evaluation
    collator: Any
    compute_metrics: Callable
    preprocess_logits_for_metrics: Callable | None
    label_names: list[str] | None
    training_collator: Any = None  # --padding-free: the task's flattening collator (None: `collator` trains too)

    @property
    def eval(self) -> datasets.Dataset:
        return self.evaluation.features


def _max_length(args: FinetuningArguments, model, tokenizer: PreTrainedTokenizerBase) -> int:
    """--max-length capped by the tokenizer and by the model's learned / sinusoidal positions."""
    limits = (args.max_length, input_length_limit(model, tokenizer), longest_input(model.config))
    return min(limit for limit in limits if limit is not None)


def prepare_task(
    args: FinetuningArguments,
    splits: datasets.DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    model,
    label_names: list[str] | None,
    label_of: Callable | None,
    *,
    with_train: bool = True,
) -> PreparedTask:
    """Features of both splits, the collator, and compute_metrics of `args.task`."""
    task, max_length = args.spec, _max_length(args, model, tokenizer)
    label2id = {name: index for index, name in enumerate(label_names or [])}

    def to_id(value) -> int:
        name = label_of(value)
        if name not in label2id:
            raise FinetuningError(f"Label {name!r} is not one of the model's labels {label_names}.")
        return label2id[name]

    if task.pads_right:
        tokenizer.padding_side = "right"
    features = {
        name: task.features(splits[name], tokenizer, args, max_length, to_id if label_names is not None else None)
        for name in (("train", "validation") if with_train else ("validation",))
    }
    for name, split in features.items():
        if len(split) == 0:
            raise FinetuningError(
                f"The {'training' if name == 'train' else name} split gives no {args.task} example of --max-length "
                f"{max_length} tokens; use more text or a smaller --max-length."
            )
    evaluation = Evaluation(examples=splits["validation"], features=features["validation"])
    compute_metrics, preprocess = task.metrics(args, evaluation, tokenizer, label_names)
    training_collator = task.padding_free_collator(tokenizer) if args.padding_free else None
    return PreparedTask(
        features.get("train"),
        evaluation,
        task.collator(tokenizer),
        compute_metrics,
        preprocess,
        label_names,
        training_collator,
    )


def _training_arguments(args: FinetuningArguments, output_dir: Path, evaluate_first: bool):
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type=args.lr_scheduler_type,
        num_train_epochs=args.num_train_epochs,
        max_steps=args.max_steps if args.max_steps is not None else -1,
        bf16=args.bf16,
        torch_compile=args.compile,
        seed=args.seed,
        logging_steps=args.logging_steps,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        eval_on_start=evaluate_first,  # inside train(), after the model is wrapped for DDP (MetricsBeforeTraining)
        # Checkpoints: Trainer's, made atomic by checkpoints.py (the final folder is written by this module)
        save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or None,
        save_total_limit=args.save_total_limit,
        report_to=args.report_to,
        label_names=list(args.spec.label_names),
        dataloader_num_workers=0,
        dataloader_pin_memory=_has_accelerator(),
        disable_tqdm=False,
    )
    if args.spec.generates:
        return transformers.Seq2SeqTrainingArguments(
            **settings,
            predict_with_generate=True,
            generation_max_length=args.generation_max_length or args.max_target_length,
            generation_num_beams=args.num_beams,
        )
    return transformers.TrainingArguments(**settings)


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


class PaddingFreeTraining(CheckpointingTrainer):
    """--padding-free: the training batches come from `training_collator` (one flattened row); evaluation keeps
    Trainer's `data_collator`, padded with a row per example, which the metrics and prediction rows read as examples."""

    training_collator: Any = None

    def get_train_dataloader(self):
        padded = self.data_collator
        self.data_collator = self.training_collator
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = padded


def build_trainer(
    args: FinetuningArguments,
    model,
    tokenizer,
    prepared: PreparedTask,
    output_dir: Path,
    *,
    resume: Path | None = None,
    run_record: dict | None = None,
    evaluate_first: bool = False,
):
    """Trainer (Seq2SeqTrainer for seq2seq) over the prepared data; it writes only its checkpoints (into
    args.output_dir/checkpoints, atomically: checkpoints.py), the caller saves the rest."""
    padding_free = prepared.training_collator is not None  # no task that generates allows it (FinetuningArguments)
    trainer_class = PaddingFreeTraining if padding_free else CHECKPOINTING_TRAINERS[args.spec.generates]
    trainer = trainer_class(
        model=model,
        args=_training_arguments(args, output_dir, evaluate_first),
        train_dataset=prepared.train,
        eval_dataset=prepared.eval,
        processing_class=tokenizer,
        data_collator=prepared.collator,
        compute_metrics=prepared.compute_metrics,
        preprocess_logits_for_metrics=prepared.preprocess_logits_for_metrics,
    )
    trainer.checkpoint_root = Path(args.output_dir).expanduser().resolve() / CHECKPOINTS_DIR
    trainer.training_collator = prepared.training_collator
    trainer.fresh_start, trainer.run_record = resume is None, run_record or {}
    return trainer


def predict_validation(
    trainer, args: FinetuningArguments, prepared: PreparedTask, tokenizer
) -> tuple[dict[str, float], list]:
    """(eval metrics, prediction rows with their examples) of the validation split, as the run reports them."""
    output = trainer.predict(prepared.eval, metric_key_prefix="eval")
    metrics = args.spec.final_metrics({key: float(value) for key, value in output.metrics.items()})
    metrics["eval_samples"] = len(prepared.evaluation.examples)
    rows = args.spec.prediction_rows(output, args, prepared.evaluation, tokenizer, prepared.label_names)
    return metrics, with_examples(rows, args, prepared.evaluation.examples)


def _readable(examples: datasets.Dataset, column: str) -> list:
    """A column's values, class ids as their names (ClassLabel, or a sequence of ClassLabel)."""
    feature, values = examples.features[column], examples[column]
    if isinstance(feature, datasets.ClassLabel):
        return [feature.int2str(value) for value in values]
    inner = getattr(feature, "feature", None)
    if isinstance(inner, datasets.ClassLabel):
        return [[inner.int2str(value) for value in row] for row in values]
    return list(values)


def with_examples(rows: list[dict], args: FinetuningArguments, examples: datasets.Dataset) -> list[dict]:
    """Prediction rows with the input and the gold answer of their validation example (the task's `shown` columns)
    before the prediction. Rows with an "id" (question answering: one per question) find their example by id."""
    if not rows:
        return rows
    columns = {key: args.setting(name) for key, name in args.spec.shown if args.setting(name)}
    values = {key: _readable(examples, column) for key, column in columns.items() if column in examples.column_names}
    if "id" in rows[0]:
        id_column = args.setting("id_column")  # rows with an id: the task that gives them has an id column
        ids = examples[id_column] if id_column in examples.column_names else range(len(examples))
        first = {}
        for index, qid in enumerate(ids):
            first.setdefault(str(qid), index)
        positions = [first[row["id"]] for row in rows]
    else:
        positions = range(len(rows))
        if len(rows) != len(examples):
            raise ValueError(f"{len(rows)} prediction rows for {len(examples)} validation examples")
    return [
        {**({"id": row["id"]} if "id" in row else {}), **{key: value[i] for key, value in values.items()}, **row}
        for i, row in zip(positions, rows)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# The evaluation before training, the engine
# ---------------------------------------------------------------------------------------------------------------------


BEFORE = "before_"  # the prefix of the metrics of the model before training: before_eval_accuracy, ...
_NOT_METRICS = ("_runtime", "_per_second", "_time", "_samples")


class MetricsBeforeTraining(transformers.TrainerCallback):
    """Keeps the metrics of Trainer's evaluation before the first step (`eval_on_start`) as `before_eval_*`, prints
    them in one line, and puts them in the run record every checkpoint carries (a resumed run reports them too).

    Trainer's own `eval_on_start`, not an evaluate() call before train(): under DDP that call prepares the model
    for evaluation, and Accelerate then never wraps the already-"prepared" model in DistributedDataParallel, so each
    process would train alone (checked with 2 gloo processes: no gradient all-reduce, different weights per rank).

    The evaluation leaves training as it would be without it: every DataLoader iterator draws its base seed from
    the global torch RNG, so the random states are taken when training begins and put back after the evaluation
    (the same per-step losses as a run without it, checked against the code before this evaluation existed)."""

    def __init__(self, task: Task, record: dict, announce: bool) -> None:
        self.task, self.record, self.announce = task, record, announce
        self.random_states = None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if "before" not in self.record:
            self.random_states = _random_states()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs) -> None:
        if state.global_step != 0 or "before" in self.record:
            return
        _set_random_states(self.random_states)
        values = self.task.final_metrics({k: float(v) for k, v in metrics.items() if k.startswith("eval_")})
        self.record["before"] = {BEFORE + key: value for key, value in values.items() if not key.endswith(_NOT_METRICS)}
        if self.announce:
            print(f"before training: {_shown(self.record['before'])}")


def _random_states() -> tuple:
    """Python's, NumPy's, torch's CPU and (where there is one) accelerator RNG states of this process."""
    import random

    import numpy as np
    import torch

    devices = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), devices


def _set_random_states(states: tuple) -> None:
    import random

    import numpy as np
    import torch

    python, numpy, cpu, devices = states
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if devices is not None:
        torch.cuda.set_rng_state_all(devices)


def _shown(metrics: dict[str, float]) -> str:
    return ", ".join(f"{key.removeprefix(BEFORE)} {value:.4g}" for key, value in metrics.items())


def run_engine(trainer, args: FinetuningArguments, resume_record: dict | None) -> Engine:
    """The engine that runs, decided as pretraining decides it (engine.py): what Accelerate set up under Trainer, or
    FSDP2 by `fully_shard` on CPU processes (an FSDP config that Accelerate 1.15 turns into DDP there), applied to
    the model here, before Trainer prepares it (checkpoints.py: `shard_with`). An engine asked for but not set
    up is refused with one FinetuningError, as is a checkpoint written in another engine's format. Printed in one
    line; recorded in train_results.json / all_results.json and every checkpoint."""
    engine = resolve_engine(
        trainer.accelerator, requested_engine(), "bf16" if args.bf16 else "no", error=FinetuningError
    )
    if resume_record is not None:
        check_unchanged(
            Path(args.resume_from_checkpoint),
            {"checkpoint format": resume_record.get("engine", {}).get("checkpoint_format", "accelerate")},
            {"checkpoint format": engine.checkpoint_format},
            what=f"another engine's checkpoint format (this run is {engine.distributed_type}, {engine.sharding})",
            fix="resume with the launcher config the run was started with",
            error=FinetuningError,
        )
    if isinstance(engine, CpuFsdp2Engine):
        if args.peft == "lora":
            raise FinetuningError(
                "--peft lora under FSDP2 on CPU processes is not supported (not built); launch with --multi_gpu for "
                "data parallelism, or drop --peft."
            )
        trainer.shard_with(engine)
    threads = choose_threads(args.threads).apply()
    if trainer.is_world_process_zero():
        print(engine.line(threads))
    return engine
