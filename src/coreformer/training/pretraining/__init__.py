"""Pretraining on Accelerate: one loop for every objective (objectives/), atomic checkpoints, exact resume.

    PretrainingArguments             every run setting (a CLI flag per field; declared in the torch-free
                                     coreformer_settings.pretraining), validated in __post_init__
    resolve_arguments(...)           dataclass defaults < preset or config file < explicit overrides
    run_pretraining(args) -> dict    prepare (checks) -> open_run_folder -> build (model, data) -> train -> finish

The objective (`--objective`, the family's default when not given) decides the examples, the collator, the model,
the loss, what the final folder holds and what its card says:

    objective    family    examples                                 collator
    masked-lm    encoder   windows of at most block_size ids         MaskedLMCollator (15%, 80/10/10)
    causal-lm    decoder   documents packed into full blocks         PackedCausalLMCollator (no padding)
    denoising    seq2seq   windows of at most block_size ids         DenoisingCollator (infilling + permutation)
    electra      encoder   windows of at most block_size ids         MaskedLMCollator (85% [MASK], the rest kept:
                                                                     a small generator fills the masks, the model
                                                                     tells replaced tokens from originals)

--packing changes the rows (data.py draws them): `padded` one window per row, `packed` whole windows packed into rows
of block_size with position_ids restarting at each document (every objective), `concatenated` the causal LM's blocks.

An output directory, as a run leaves it:

    output_dir/
      run_config.json                    the resolved arguments (written when the run starts)
      tokenizer.json, tokenizer_config.json
      checkpoints/step-N/                the engine's state (accelerator.save_state, or DCP shards under
                                         coreformer's FSDP2: engine.py) + trainer_state.json + tokenizer/
      logs/pretrain/                     TensorBoard events (when tensorboard is installed)
      config.json, model.safetensors, generation_config.json, modeling code,
      README.md, metrics.json, loss.png  the final model, written at the end

Runs are exact (batches.py says why): every micro-batch's examples, masks and dropout follow its global batch
number, and each micro-batch loss is a sum over label tokens divided by the label tokens of the whole optimizer step
(all micro-batches, all ranks: transformers' `num_items_in_batch`), so gradient accumulation and data parallelism
compute the same token-weighted mean. The final model goes through a temporary folder; its files are moved into
`output_dir` with config.json, the file every loader reads first, moved last, so a folder that has a config.json
holds a complete model.

The stages' parts live beside this file, in this package: run.py (the arguments and the run's state), inputs.py
(tokenizer, data, collator, model config, checked before the first write), run_folder.py (the output folder, resume,
launch), tracking.py (the tracker) and loop.py (the train step, the loop, the held-out evaluation, checkpoints, the
final folder).
"""

import dataclasses
import time
from pathlib import Path
from typing import Any

from ...compat import enable_activation_checkpointing
from ...hub.folders import drop_set_aside, restore_set_aside, set_aside, set_aside_path
from ..arguments import RUN_CONFIG, PretrainingError, RunStoppedError, write_json
from ..batches import GlobalBatches
from ..checkpoints import find_latest_checkpoint, read_trainer_state, remove_stale_temporaries, stopped_message
from ..engine import Engine, requested_engine, resolve_engine
from ..optimizers import build_optimizer, build_schedule, check_run_optimizer
from ..reports import checkpoint_plan_line
from ..threads import choose_threads
from ..tokenizer_training import tokenizer_name, train_tokenizer
from .inputs import (
    BatchShare,
    Corpus,
    build_collator,
    build_model_config,
    load_tokenizer,
    open_corpus,
    shared_tokenizer,
)
from .loop import finish, train
from .run import PretrainingArguments, _Run, _Training, resolve_arguments
from .run_folder import check_checkpoint_engine, check_world_size, resolve_resume
from .tracking import tracker_choice, tracker_hparams

__all__ = ["PretrainingArguments", "resolve_arguments", "run_pretraining"]


def _accelerator(args: PretrainingArguments) -> tuple[Any, Engine, str | None, str]:
    """The Accelerator of the run (checked to hold every launched process), the engine that runs (the one the
    launcher asked for, or a refusal), its tracker and a line saying which."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import ProjectConfiguration

    output_dir = Path(args.output_dir)
    log_with, tracker_line = tracker_choice(args.report_to)
    # The run's Accelerator is the one its settings describe. Accelerate keeps one state per process, and an earlier
    # Accelerator's (a Trainer's with torch_compile=True) would be reused, its compile plugin wrapping this model; the
    # process group (PartialState) stays. transformers' TrainingArguments resets the state the same way.
    AcceleratorState._reset_state()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        mixed_precision=args.mixed_precision,
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        # One scheduler step per optimizer step, whatever the number of processes (Accelerate would otherwise step
        # it once per process, for a schedule written in single-process samples).
        step_scheduler_with_optimizer=False,
        # --compile compiles the model in place (see `build`); Accelerate's own compile wraps it, and the
        # wrapper's `_orig_mod.` prefix would reach every checkpoint. Its backend comes from ACCELERATE_DYNAMO_BACKEND,
        # which `accelerate launch` with a dynamo config, or any TrainingArguments(torch_compile=True) made earlier in
        # the process, sets for the whole process.
        dynamo_backend="no",
    )
    check_world_size(accelerator.num_processes)
    engine = resolve_engine(accelerator, requested_engine(), args.mixed_precision)
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None:  # DeepSpeed reads these from its own config, not from the loop
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = args.batch_size
        deepspeed.deepspeed_config["gradient_accumulation_steps"] = args.grad_accum
        deepspeed.deepspeed_config["gradient_clipping"] = args.max_grad_norm
    return accelerator, engine, log_with, tracker_line


def _run_tokenizer(args: PretrainingArguments, accelerator, resume: Path | None, state, corpus: Corpus):
    """(tokenizer, how the card names it): the checkpoint's, --tokenizer, the one saved with the shards, or one
    trained on the training split; checked to be one that reads the corpus."""
    if resume is not None:
        tokenizer, name = load_tokenizer(str(resume / "tokenizer"), args.spec), state["tokenizer"]
    elif args.tokenizer is not None:
        tokenizer, name = load_tokenizer(args.tokenizer, args.spec), args.tokenizer
    elif corpus.saved_tokenizer is not None:
        tokenizer, name = load_tokenizer(corpus.saved_tokenizer, args.spec), corpus.saved_tokenizer
    else:
        tokenizer = shared_tokenizer(
            accelerator, lambda: train_tokenizer(args.family, corpus.tokenizer_texts(), args.vocab_size)
        )
        name = f"{tokenizer_name(args.family)} trained on the training split"
    corpus.check_tokenizer(tokenizer)
    return tokenizer, name


def prepare(args: PretrainingArguments) -> _Run:
    """Every check of the inputs (output folder, resume checkpoint, dataset, tokenizer, blocks), on every process,
    before the first write: a bad input raises `PretrainingError` with nothing written or overwritten."""
    accelerator, engine, log_with, tracker_line = _accelerator(args)
    resume = resolve_resume(args, Path(args.output_dir))
    state = read_trainer_state(resume) if resume is not None else None
    if resume is not None:
        check_checkpoint_engine(resume, state, engine)
    check_run_optimizer(args, engine, state)
    corpus = open_corpus(args, accelerator)
    tokenizer, tokenizer_name = _run_tokenizer(args, accelerator, resume, state, corpus)
    config = build_model_config(args, tokenizer)
    with accelerator.main_process_first():  # a dataset on disk: the main process writes the map caches, others read
        train_examples = corpus.examples("train", tokenizer, args)
        eval_examples = corpus.examples("validation", tokenizer, args)
    for name, examples in (("training", train_examples), ("held-out", eval_examples)):
        if examples is not None and len(examples) == 0:  # (a stream's training rows are made as it is read)
            raise PretrainingError(
                f"The {name} split gives no example of --block-size {args.block_size} tokens; use more text or a "
                f"smaller --block-size."
            )
    # So that `tokenizer(text, truncation=True)` on the saved tokenizer stops where the model's positions do (set
    # after tokenizing: documents longer than this are meant to be windowed or packed, not warned about).
    tokenizer.model_max_length = min(tokenizer.model_max_length, config.max_position_embeddings)
    accelerator.print(
        f"{args.family} {args.objective} pretraining on {accelerator.num_processes} process(es), "
        f"{accelerator.device}; {tracker_line}"
    )
    accelerator.print(engine.line(choose_threads(args.threads).apply()))
    accelerator.print(corpus.data_line(train_examples, args.block_size))
    accelerator.print(checkpoint_plan_line(args.save_every, args.max_steps, state["step"] if state else 0))
    return _Run(
        args,
        accelerator,
        log_with,
        resume,
        state,
        tokenizer,
        tokenizer_name,
        config,
        train_examples,
        eval_examples,
        engine,
        corpus.held_out_texts(tokenizer),
        corpus,
    )


def open_run_folder(run: _Run) -> None:
    """The first writes: the previous run moved aside until this one saves (--overwrite, checked), leftovers of
    crashed saves cleaned, the tokenizer and run_config.json."""
    accelerator, output_dir = run.accelerator, run.output_dir
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        settle_set_aside_run(output_dir)
        if run.resume is None and output_dir.is_dir() and any(output_dir.iterdir()):
            set_aside(output_dir)  # --overwrite of a previous run, checked in prepare; dropped at this run's first save
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(output_dir)
        if run.resume is None:
            run.tokenizer.save_pretrained(output_dir)
        write_json(output_dir / RUN_CONFIG, dataclasses.asdict(run.args))
    accelerator.wait_for_everyone()
    if run.args.warmup_steps >= run.args.max_steps:
        accelerator.print(
            f"note: --warmup-steps {run.args.warmup_steps} >= --max-steps: the learning rate only warms up"
        )


def holds_a_save(output_dir: Path) -> bool:
    """Whether a run folder holds something a run saved: a checkpoint or a final model."""
    return find_latest_checkpoint(output_dir) is not None or (output_dir / "config.json").is_file()


def settle_set_aside_run(output_dir: Path) -> None:
    """A run set aside by an --overwrite rerun that was killed: put back if that rerun saved nothing, else dropped."""
    if not set_aside_path(output_dir).is_dir():
        return
    if output_dir.is_dir() and holds_a_save(output_dir):
        drop_set_aside(output_dir)
    else:
        restore_set_aside(output_dir)


def _restore(run: _Run, training: _Training) -> None:
    """Model, optimizer, schedule, scaler, every process's RNG and the data position of the resumed checkpoint."""
    accelerator, state, args = run.accelerator, run.state, run.args
    run.engine.load_state(accelerator, training.model, training.optimizer, training.scheduler, run.resume)
    training.step, training.consumed, training.tokens_seen, training.history = (
        state[key] for key in ("step", "consumed", "tokens_seen", "history")
    )
    micro_batches_per_step = state["world_size"] * state["args"]["grad_accum"]
    if (
        (state["args"]["dataset"], state["args"].get("data_dir"), state["args"].get("streaming", False))
        != (args.dataset, args.data_dir, args.streaming)
        or state["args"].get("packing", args.packing) != args.packing  # recorded since --packing exists
        or micro_batches_per_step != accelerator.num_processes * args.grad_accum
    ):
        accelerator.print(
            "note: the dataset, the packing or the number of micro-batches per step differs from the checkpoint's run; "
            "the data position is kept in global batches, so the order of examples continues but the runs are not "
            "exact."
        )
    accelerator.print(f"resumed from {run.resume} at step {training.step}")
    saved_schedule = (state["args"]["max_steps"], state["args"]["warmup_steps"])
    if training.step >= args.max_steps:
        accelerator.print(
            f"note: the checkpoint is at step {training.step} and --max-steps is {args.max_steps}: no step to train, "
            f"the final folder is written again; pass a larger --max-steps to train on"
        )
    elif saved_schedule != (args.max_steps, args.warmup_steps):
        accelerator.print(
            f"note: the schedule changed on resume (--max-steps {saved_schedule[0]} -> {args.max_steps}, "
            f"--warmup-steps {saved_schedule[1]} -> {args.warmup_steps}): from step {training.step} the learning rate "
            f"follows the new {args.lr_scheduler_type} schedule, not the one the run started with"
        )


def build(run: _Run) -> _Training:
    """The model (seeded), optimizer and schedule under Accelerate, the resumed state, and the data: this process's
    share of the global batches and the held-out batches."""
    from accelerate.utils import set_seed

    args, accelerator = run.args, run.accelerator
    set_seed(args.seed)
    model = run.objective.build_model(run.config, args)
    if args.attn_implementation is not None:
        model.set_attn_implementation(args.attn_implementation)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if args.compile:
        # In place, not torch.compile(model): the module is not wrapped, so its state_dict keys (and so every checkpoint
        # and the final folder) carry no `_orig_mod.` prefix, and a compiled run resumes from an eager one's checkpoint.
        model.compile()
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    model, optimizer, scheduler = run.engine.setup(
        accelerator,
        model,
        lambda module: build_optimizer(module, args, accelerator.device),  # optimizers.py: --optimizer
        lambda optimizer: build_schedule(optimizer, args),  # --lr-scheduler-type
    )
    training = _Training(model, optimizer, scheduler, num_parameters, iter(()), [])
    if run.resume is not None:
        _restore(run, training)
    accelerator.init_trackers("pretrain", config=tracker_hparams(args))

    collator = build_collator(run.tokenizer, args)
    world, rank = accelerator.num_processes, accelerator.process_index
    share = BatchShare(  # global batch g = consumed + j * world + rank
        args, run.tokenizer, collator, training.consumed + rank, world, rank, run.state,
        pin_memory=accelerator.device.type == "cuda",
    )  # fmt: skip
    training.data = run.corpus.training_batches(run.train_examples, share)
    eval_pool = run.eval_examples.shuffle(seed=args.seed) if len(run.eval_examples) > 1 else run.eval_examples
    eval_source = GlobalBatches(eval_pool, collator, args.batch_size, seed=args.seed, stream="eval", shuffle=False)
    eval_count = max(1, min(args.eval_batches, len(eval_pool) // args.batch_size))
    training.eval_batches = [eval_source[i][1] for i in range(eval_count)]
    return training


def run_pretraining(args: PretrainingArguments) -> dict[str, Any]:
    """Train `args.objective` on `args.dataset` and write the run folder described in the module docstring.

    Returns:
        The metrics also written to metrics.json.
    """
    session_start = time.perf_counter()
    run = prepare(args)
    open_run_folder(run)
    training = None
    try:
        training = build(run)
        train(run, training)
        return finish(run, training, session_start)
    except KeyboardInterrupt:
        step = training.step if training is not None else 0
        if _put_back_the_run_set_aside(run):
            raise RunStoppedError(
                f"stopped at step {step}, before the first checkpoint; the run it was replacing is back in "
                f"{str(run.output_dir)!r} (start again with --overwrite)"
            ) from None
        raise RunStoppedError(stopped_message(run.output_dir, step, "start again with --overwrite")) from None
    except BaseException:
        _put_back_the_run_set_aside(run)
        raise


def _put_back_the_run_set_aside(run: _Run) -> bool:
    """A run that stops before its first save gives the folder back to the run it was replacing (--overwrite)."""
    if not run.accelerator.is_main_process or holds_a_save(run.output_dir):
        return False
    return restore_set_aside(run.output_dir)
