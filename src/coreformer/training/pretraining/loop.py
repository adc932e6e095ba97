"""Pretraining's loop and what it writes, from the first step to the final folder (the driver's `train` and
`finish` stages).

    evaluate(accelerator, model, ...)     the held-out loss, token-weighted as in training, split across processes
    train_step(run, training)             one optimizer step over --grad-accum micro-batches on each process
    train(run, training)                  steps until --max-steps, with held-out evaluations and checkpoints
    finish(run, training, start)          metrics.json, the model card and the final model, swapped into output_dir
    end_training(accelerator, training)   the model freed, then the process group destroyed (finish's last step)
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import torch

from coreformer_settings.pretraining import METRICS

from ...hub.folders import drop_set_aside, link_into, staged_folder
from .. import arguments
from ..arguments import export_run, write_json
from ..batches import derive_seed
from ..checkpoints import save_checkpoint
from ..flops import flops_per_token
from ..objectives import Objective
from ..reports import (
    PEAK_FLOPS,
    held_out_numbers,
    plot_losses,
    render_model_card,
    run_summary,
    time_line,
)
from ..zero_shot import run_zero_shot, zero_shot_line
from .inputs import input_token_count
from .run import _Run, _Training


@torch.no_grad()
def evaluate(
    accelerator,
    model,
    batches: list[dict[str, torch.Tensor]],
    objective: Objective,
    *,
    seed: int,
    pad_token_id: int | None = None,
) -> dict[str, float]:
    """The held-out loss over `batches`, token-weighted as in training (the objective's loss with the token counts of
    all the batches), split across processes; every process runs the same number of forwards (FSDP needs every rank
    in every forward), padding its share with zero-weight repeats. Randomness in a forward (ELECTRA's generator
    samples) follows the batch, as in training, so every split of the batches gives the same loss."""
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    shares = [index for index in range(math.ceil(len(batches) / world) * world) if index % world == rank]
    counts = torch.tensor(
        [
            [objective.label_count(batches[index]), input_token_count(batches[index], pad_token_id)]
            for index in shares
            if index < len(batches)
        ]
        or [[0, 0]],
        device=accelerator.device,
    ).sum(0)
    counts = accelerator.reduce(counts, "sum")  # (label tokens, input tokens) of all held-out batches
    totals: dict[str, torch.Tensor] = {}
    for index in shares:
        batch = batches[index % len(batches)]
        torch.manual_seed(derive_seed(seed, "eval", index))
        terms = objective.loss_terms(model, _to_device(batch, accelerator.device), counts[0], counts[1])
        for name, value in terms.items():
            totals.setdefault(name, torch.zeros((), dtype=torch.float64, device=accelerator.device))
            if index < len(batches):
                totals[name] += value.double()
    names = sorted(totals)  # every process reduces the terms in one order
    reduced = accelerator.reduce(torch.stack([totals[name] for name in names]), "sum").tolist()
    model.train()
    result = dict(zip(names, reduced, strict=True))
    loss = result.pop("loss")
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf, "tokens": int(counts[0]), **result}


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _evaluate(run: _Run, training: _Training) -> dict[str, float]:
    held_out = evaluate(
        run.accelerator,
        training.model,
        training.eval_batches,
        run.objective,
        seed=run.args.seed,
        pad_token_id=run.tokenizer.pad_token_id,
    )
    result = {"step": training.step, **held_out}
    training.history["eval"].append(result)
    run.accelerator.log({"eval/loss": result["loss"], "eval/perplexity": result["perplexity"]}, step=training.step)
    return result


def train_step(run: _Run, training: _Training) -> tuple[float, float, int]:
    """One optimizer step over `grad_accum` micro-batches on each process: (the step's loss, its learning rate,
    its input tokens on all processes)."""
    args, accelerator, model = run.args, run.accelerator, training.model
    world = accelerator.num_processes
    micro_batches = [next(training.data) for _ in range(args.grad_accum)]
    counts = torch.tensor(
        [
            sum(run.objective.label_count(batch) for _, batch in micro_batches),
            sum(input_token_count(batch, run.tokenizer.pad_token_id) for _, batch in micro_batches),
        ],
        device=accelerator.device,
    )
    counts = accelerator.reduce(counts, "sum")  # label tokens and input tokens of the whole optimizer step
    step_loss = torch.zeros((), device=accelerator.device)
    lr = training.scheduler.get_last_lr()[0]  # the rate this step's update uses
    for g, batch in micro_batches:
        torch.manual_seed(derive_seed(args.seed, "dropout", g))  # dropout follows the batch, not the rank
        with accelerator.accumulate(model):
            loss = run.objective.loss(model, _to_device(batch, accelerator.device), counts[0], counts[1])
            # loss is this micro-batch's share of the step's token mean. Accelerate divides by grad_accum and
            # DDP averages over processes: undo both, so the summed gradients are those of the step's mean.
            accelerator.backward(loss * (world * args.grad_accum))
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            training.optimizer.step()
            if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                training.scheduler.step()
            training.optimizer.zero_grad(set_to_none=True)
        step_loss += loss.detach()
    return accelerator.reduce(step_loss, "sum").item(), lr, int(counts[1])


def _save_checkpoint(run: _Run, training: _Training) -> None:
    trainer_state = {
        "family": run.args.family,
        "step": training.step,
        "consumed": training.consumed,  # global batches
        "tokens_seen": training.tokens_seen,
        "world_size": run.accelerator.num_processes,
        "engine": run.engine.record(),
        "tokenizer": run.tokenizer_name,
        "history": training.history,
        "args": dataclasses.asdict(run.args),
    }
    position = run.corpus.position(training.data)
    if position is not None:  # a streamed run: where each process's next micro-batch starts
        from accelerate.utils import gather_object

        trainer_state["stream_positions"] = gather_object([position])  # in rank order; [position] on one process
    save_checkpoint(
        run.accelerator,
        training.model,
        run.output_dir,
        training.step,
        trainer_state,
        run.tokenizer,
        run.args.keep_last,
        write_state=lambda folder: run.engine.save_state(
            run.accelerator, training.model, training.optimizer, training.scheduler, folder
        ),
    )
    if run.accelerator.is_main_process:
        drop_set_aside(run.output_dir)  # an --overwrite rerun now has a checkpoint to put in the previous run's place


def check_finite(loss: float, step: int, args) -> None:
    """Stop at the first step whose training loss is not finite: its update has already made the weights NaN, and
    every later step would spend time on a model that cannot recover. fp16 is exempt: its loss scaler skips the
    steps that overflow and lowers the scale, so an inf there is routine."""
    if math.isfinite(loss) or args.mixed_precision == "fp16":
        return
    precision = (
        f", or train in fp32 (--mixed-precision no, now {args.mixed_precision})" if args.mixed_precision != "no" else ""
    )
    raise arguments.PretrainingError(
        f"the training loss became {loss} at step {step}: the model diverged (checkpoints written before it stay in "
        f"{args.output_dir}). Lower --lr (now {args.lr:g}) or raise --warmup-steps (now {args.warmup_steps})"
        f"{precision}."
    )


def train(run: _Run, training: _Training) -> None:
    """Steps until --max-steps: a held-out evaluation before the first (always) and every --eval-every steps, a
    checkpoint every --save-every."""
    from tqdm.auto import tqdm

    args, accelerator = run.args, run.accelerator
    if not training.history["eval"]:  # the loss before training, always: every run reports where it started
        _evaluate(run, training)
    progress = tqdm(
        total=args.max_steps,
        initial=training.step,
        desc=f"{args.family} pretraining",
        unit="step",
        disable=not accelerator.is_main_process,
        dynamic_ncols=True,
    )
    training.model.train()
    try:  # Ctrl-C: the bar ends on its line before the caller's message
        while training.step < args.max_steps:
            step_start = time.perf_counter()
            loss, lr, step_tokens = train_step(run, training)
            check_finite(loss, training.step + 1, args)
            training.step += 1
            training.consumed += args.grad_accum * accelerator.num_processes
            training.tokens_seen += step_tokens
            training.session_tokens += step_tokens
            training.train_time += time.perf_counter() - step_start
            training.history["train"].append({"step": training.step, "loss": loss, "lr": lr, "tokens": step_tokens})
            tokens_per_second = training.session_tokens / max(training.train_time, 1e-9)
            accelerator.log(
                {"train/loss": loss, "train/lr": lr, "train/tokens_per_second": tokens_per_second}, training.step
            )
            progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:,.0f}", refresh=False)
            progress.update(1)
            if args.eval_every and training.step % args.eval_every == 0:
                result = _evaluate(run, training)
                extra = held_out_numbers(result, run.objective.metrics_beside_loss)
                progress.write(f"step {training.step}: held-out loss {result['loss']:.4f}, {extra}")
            if args.save_every and training.step % args.save_every == 0:
                _save_checkpoint(run, training)
    finally:
        progress.close()
    if training.history["eval"][-1]["step"] != training.step:
        _evaluate(run, training)


def _metrics(run: _Run, training: _Training) -> dict[str, Any]:
    """metrics.json: the run's settings, its speed and its held-out losses (wall_time_s filled in at the save)."""
    args, accelerator, history = run.args, run.accelerator, training.history
    device_name = torch.cuda.get_device_name(accelerator.device) if accelerator.device.type == "cuda" else "CPU"
    tokens_per_second = training.session_tokens / training.train_time if training.train_time else None
    last_eval, world = history["eval"][-1], accelerator.num_processes
    rows = len(run.train_examples) if run.train_examples is not None else None
    metrics: dict[str, Any] = {
        "family": args.family,
        "preset": args.preset,
        "objective": run.objective.description,
        "num_parameters": run.objective.saved_parameters(accelerator.unwrap_model(training.model)),
        "trained_parameters": training.num_parameters,
        "vocab_size": run.config.vocab_size,
        "tokenizer": run.tokenizer_name,
        "steps": training.step,
        "world_size": world,
        "num_nodes": run.engine.num_nodes,
        "engine": run.engine.record(),
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "examples_per_step": args.batch_size * args.grad_accum * world,
        "block_size": args.block_size,
        "tokens_seen": training.tokens_seen,
        # the training split's examples of --block-size tokens at most (None streamed: made as the stream is read)
        "training_rows": rows,
        # Passes over the training split (rows read / its rows), as Trainer's "epoch": past 1, text is read again.
        "epochs": training.consumed * args.batch_size / rows if rows else None,
        "tokens_per_second": tokens_per_second,
        # torch's threads in each process (training/threads.py): float sums run in another order on another count,
        # so a run reproduces another to the last digit only on the same count
        "threads": torch.get_num_threads(),
        "train_time_s": training.train_time,
        "wall_time_s": None,
        "initial_eval_loss": history["eval"][0]["loss"],
        "final_eval_loss": last_eval["loss"],
        "final_eval_perplexity": last_eval["perplexity"],
        "final_eval_tokens": last_eval["tokens"],
        "final_train_loss": history["train"][-1]["loss"] if history["train"] else None,
        "mixed_precision": args.mixed_precision,
        "device": device_name,
        "tracker": run.tracker or "none",
        "resumed_from": str(run.resume) if run.resume is not None else None,
        "mfu": None,
    }
    peak = next((flops for name, flops in PEAK_FLOPS.items() if name in device_name), None)
    if peak and tokens_per_second and args.mixed_precision != "no":
        per_token = flops_per_token(run.config, training.num_parameters, args.block_size)
        metrics["mfu"] = per_token * tokens_per_second / (peak * world)
    metrics["history"] = history
    return metrics


def finish(run: _Run, training: _Training, session_start: float) -> dict[str, Any]:
    """The final folder, rebuilt beside itself and swapped in (coreformer.hub.folders): a kill leaves the previous final
    model or the new one, never a mix; checkpoints and logs come along as hard links. Then the sample, if asked."""
    args, accelerator, output_dir = run.args, run.accelerator, run.output_dir
    metrics = _metrics(run, training)
    state_dict = run.engine.full_state_dict(accelerator, training.model)  # a collective under FSDP / ZeRO-3
    if accelerator.is_main_process:
        model = run.engine.model_to_save(
            accelerator, training.model, lambda: run.objective.build_model(run.config, args)
        )
        with staged_folder(output_dir) as staging:
            run.objective.save(model, state_dict, run.tokenizer, staging)
            metrics["zero_shot"] = run_zero_shot(staging, args, run.held_out, accelerator.device)  # zero_shot.py
            metrics["wall_time_s"] = time.perf_counter() - session_start
            plot_losses(training.history, staging / "loss.png", f"coreformer {args.family} ({args.preset})")
            (staging / "README.md").write_text(render_model_card(args, metrics, str(output_dir)))
            write_json(staging / METRICS, metrics)
            export_run(args.export, staging)
            for entry in output_dir.iterdir():
                # A previous run's native export describes its model, not this one: never carried over.
                if entry.name != arguments.EXPORT_FOLDER and not (staging / entry.name).exists():
                    link_into(entry, staging / entry.name)
        drop_set_aside(output_dir)  # the run an --overwrite rerun replaces, kept until now
        first, last = training.history["eval"][0], training.history["eval"][-1]
        speed = f"{metrics['tokens_per_second']:,.0f} tokens/s" if training.session_tokens else "no steps this session"
        extra = held_out_numbers(last, run.objective.metrics_beside_loss)
        epochs = f"{metrics['epochs']:.3g} epochs" if metrics["epochs"] is not None else "streamed"
        accelerator.print(
            f"done: {training.step} steps ({epochs}), held-out loss of the objective as trained "
            f"{first['loss']:.4f} -> {last['loss']:.4f} ({extra}), {speed}; wrote {output_dir}"
        )
        if metrics["zero_shot"]:
            accelerator.print(zero_shot_line(metrics["zero_shot"]))
        if args.sample_prompt is not None:
            metrics["sample"] = run.objective.sample(output_dir, args.sample_prompt, seed=args.seed)
            write_json(output_dir / f".{METRICS}.tmp", metrics)
            os.replace(output_dir / f".{METRICS}.tmp", output_dir / METRICS)
            accelerator.print(f"sample ({run.objective.auto_class}.from_pretrained({str(output_dir)!r})):")
            accelerator.print(metrics["sample"])
        accelerator.print(time_line(time.perf_counter() - session_start, sampled=args.sample_prompt is not None))
        accelerator.print(run_summary(args, output_dir))
    accelerator.wait_for_everyone()
    end_training(accelerator, training)
    return metrics


def end_training(accelerator, training: _Training) -> None:
    """Free the model in training, then destroy the process group. DDP's reducer holds the group: when the reducer
    is the group's last holder, the group's destructor runs with the GIL held and joins gloo's worker threads, one of
    which may still need the GIL to free the final barrier's tensors, and the process never exits (rarely: a race
    with that thread). Freed first, the reducer leaves the group to destroy_process_group, which releases the GIL."""
    training.model = training.optimizer = training.scheduler = None
    accelerator.free_memory()  # the accelerator's own references to them, then a garbage collection
    accelerator.end_training()
