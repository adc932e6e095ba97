"""What a run reports: FLOPs per token (for MFU), the loss plot, the final folder's model card (pretraining), and
the summary both runs end with.

    flops_per_token(config, num_parameters, block_size)    training FLOPs per token (flops.py, for MFU)
    plot_losses(history, path, title)                        loss.png: train and held-out loss against the step
    model_card_info(args, metrics) / render_model_card       README.md (model_cards/pretrained.md via model_card)
    run_summary(args, output_dir)                            the run's last lines: what it wrote, what to run next
    finetune_summary(args)                                   the same for a fine-tuning run
    time_line(seconds, sampled)                              the run's wall time and what it includes

The card's family facts come from families.py, its objective text from the run's objective (objectives/).
"""

from pathlib import Path
from typing import Any

from transformers import AutoConfig

from ..export.exporters import suggested_export
from ..hub.model_card import ModelCardInfo, is_hub_id
from ..hub.model_card import render_model_card as render_card
from .arguments import EXPORT_FOLDER
from .checkpoints import list_checkpoints
from .families import TRAINING_FACTS
from .objectives import OBJECTIVES
from .optimizers import optimizer_text, schedule_text
from .zero_shot import zero_shot_line

# Dense bf16/fp16 tensor-core peaks (FLOP/s) for the MFU estimate, by a substring of the CUDA device name.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def plot_losses(history: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    if history["train"]:
        axis.plot([r["step"] for r in history["train"]], [r["loss"] for r in history["train"]], lw=0.8, label="train")
    if history["eval"]:
        axis.plot(
            [r["step"] for r in history["eval"]], [r["loss"] for r in history["eval"]], "o-", label="held-out eval"
        )
    axis.set(xlabel="optimizer step", ylabel="loss (nats/token)", title=title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def model_card_info(args: Any, metrics: dict[str, Any]) -> ModelCardInfo:
    """What the final folder's card says (model_cards/pretrained.md): the run's settings and its held-out numbers,
    which also go into the card's model-index (the objective's `card_metrics` on the held-out split)."""
    family, objective = TRAINING_FACTS[args.family], OBJECTIVES[args.objective]
    hub_dataset = args.dataset if args.dataset and is_hub_id(args.dataset) else None
    if args.data_dir is not None:
        dataset_description = f"the token shards in `{args.data_dir}` (`coreformer tokenize`)"
    elif args.dataset is None:
        dataset_description = "the Python standard library's own source files (coreformer's embedded corpus)"
    else:
        dataset_description = f"`{args.dataset}`" + (f" ({args.dataset_config})" if args.dataset_config else "")
    tokens_per_second = f"{metrics['tokens_per_second']:,.0f}" if metrics["tokens_per_second"] else "n/a"
    epochs = f"{metrics['epochs']:.3g} epochs" if metrics["epochs"] is not None else "streamed"
    numbers = held_out_numbers(metrics["history"]["eval"][-1], objective.card_metrics)
    summary = (
        f"A {family.description} with {metrics['num_parameters']:,} parameters, pretrained from scratch with "
        f"`coreformer pretrain` on {dataset_description} ({objective.name} objective). After "
        f"{metrics['steps']} steps ({metrics['tokens_seen']:,} training tokens, {epochs}, "
        f"{tokens_per_second} tokens/s on {metrics['device']}) the held-out numbers are: {numbers} (losses in nats "
        f"per token, over {metrics['final_eval_tokens']:,} held-out label tokens). The architecture is coreformer's "
        f"({family.config_class.__name__})."
    )
    if metrics.get("zero_shot"):  # zero_shot.py: the final folder scored at fixed settings
        line = zero_shot_line(metrics["zero_shot"])
        summary += f" {line[0].upper()}{line[1:]}."
    hyperparameters = [
        ("preset / config", args.preset),
        ("objective", objective.description),
        ("steps", metrics["steps"]),
        ("processes x micro-batch x accumulation", f"{metrics['world_size']} x {args.batch_size} x {args.grad_accum}"),
        ("block size", args.block_size),
        ("optimizer", optimizer_text(args)),
        ("learning rate", schedule_text(args)),
        ("gradient clipping", args.max_grad_norm),
        ("mixed precision", args.mixed_precision),
        ("vocabulary", f"{metrics['vocab_size']} ({metrics['tokenizer']})"),
        ("seed", args.seed),
    ]
    return ModelCardInfo(
        kind="pretrained",
        title=f"coreformer {args.family} ({args.preset})",
        family=args.family,
        auto_class=objective.auto_class,
        summary=summary,
        num_parameters=metrics["num_parameters"],
        datasets=[hub_dataset] if hub_dataset else [],
        dataset_description=dataset_description,
        pipeline_tag=objective.pipeline_tag,
        task_type=objective.pipeline_tag,
        task_name=objective.description.split(" (")[0],
        eval_results={name: metrics["history"]["eval"][-1][name] for name in objective.card_metrics},
        eval_dataset=hub_dataset or f"{args.dataset or 'coreformer embedded corpus'} (held-out split)",
        hyperparameters=hyperparameters,
        usage=objective.usage,
        tags=["pretraining"],
    )


def render_model_card(args: Any, metrics: dict[str, Any], path_hint: str) -> str:
    """README.md of the final folder: metadata (license, library, tags, datasets, model-index) + how to load + the
    numbers, from coreformer.hub.model_card's "pretrained" template."""
    return str(render_card(model_card_info(args, metrics), path_hint))


def data_line(documents: dict[str, int], examples: int, block_size: int) -> str:
    """How the text became training data, said before the first step: the documents of each split (a .txt file gives
    one per non-blank line; JSON, CSV and Parquet one per row) and the training examples they make."""
    return (
        f"data: {documents['train']:,} documents for training, {documents['validation']:,} held out; "
        f"{examples:,} training examples of up to {block_size} tokens"
    )


def checkpoint_plan_line(save_every: int, max_steps: int, step: int) -> str:
    """When this run saves, said before the first step: a Ctrl-C before the first checkpoint keeps nothing."""
    if not save_every:
        return "checkpoints: none (--save-every 0); only the final model is saved"
    first = (step // save_every + 1) * save_every
    if first >= max_steps:
        return f"checkpoints: none before the final model (--save-every {save_every}, --max-steps {max_steps})"
    return (
        f"checkpoints: every {save_every} steps, the next at step {first} (a Ctrl-C before it keeps nothing of this "
        f"session; --save-every N saves more often)"
    )


def checkpoints_line(args: Any, output_dir: Path) -> str:
    """Where a run's checkpoints are, or why there are none (saving off, or the run ended before the first save)."""
    checkpoints = [path.name for path in list_checkpoints(output_dir)]
    if checkpoints:
        return f"{output_dir}/checkpoints/ ({', '.join(checkpoints)}; go on with --resume-from-checkpoint latest)"
    if not args.save_every:
        return "none (save_every is 0)"
    return f"none (the run ended before step {args.save_every}, the first save; --save-every N saves more often)"


def _summary(where: list[tuple[str, str]], next_steps: list[tuple[str, str]]) -> str:
    lines = ["where everything went:", *(f"  {name:<12} {text}" for name, text in where), "what to run next:"]
    return "\n".join(lines + [f"  {name:<12} {command}" for name, command in next_steps])


def _export_lines(args: Any, folder: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The native export a run wrote (--export native), or the command of the export that takes the saved model
    as it is (`suggested_export`: native, else ONNX; none where neither does)."""
    native = Path(folder) / EXPORT_FOLDER
    if args.export is not None and native.is_dir():
        return [("native", f"{native}/  (transformers' own architecture, no coreformer needed)")], []
    config = AutoConfig.from_pretrained(folder)
    target = suggested_export(config, config.architectures[0])
    if target is None:
        return [], []
    flag = "" if target == "native" else f" --to {target}"
    return [], [("export", f"coreformer export {folder} {folder}-{target}{flag} --check")]


def run_summary(args: Any, output_dir: Path) -> str:
    """The lines a finished pretraining run ends with: where everything went (the model and how to load it, the card,
    metrics, checkpoints) and the commands to run next (fine-tune, publish, export), for the folder as the user named
    it; each command is the installed `coreformer`, so it works from any folder."""
    objective, folder = OBJECTIVES[args.objective], str(output_dir)
    logs = ", logs/ (TensorBoard)" if (Path(output_dir) / "logs").is_dir() else ""
    task = objective.finetune_task
    exported, export = _export_lines(args, folder)
    where = [
        ("model", f"{folder}/  ({objective.auto_class}.from_pretrained({folder!r}))"),
        ("model card", f"{folder}/README.md"),
        ("metrics", f"{folder}/metrics.json, {folder}/loss.png{logs}"),
        ("checkpoints", checkpoints_line(args, output_dir)),
        *exported,
    ]
    next_steps = [
        ("fine-tune", f"coreformer finetune --task {task} --model {folder} --output-dir {folder}-{task}"),
        ("publish", f"coreformer publish {folder} --repo-id YOUR_NAME/{Path(folder).name}"),
        *export,
    ]
    return _summary(where, next_steps)


def finetune_summary(args: Any) -> str:
    """The lines a finished fine-tuning run ends with, as `run_summary` for pretraining: the model and how to load it,
    the adapter (LoRA), the card, results and predictions, checkpoints, and the commands to run next."""
    folder = str(args.output_dir)
    results = [name for name in ("all_results.json", "eval_predictions.jsonl") if (Path(folder) / name).is_file()]
    exported, export = _export_lines(args, folder)
    where = [
        ("model", f"{folder}/  ({args.spec.auto_class}.from_pretrained({folder!r}))"),
        *([("adapter", f"{folder}/adapter/  (the LoRA adapter alone, for PEFT)")] if args.peft == "lora" else []),
        ("model card", f"{folder}/README.md"),
        ("metrics", ", ".join(f"{folder}/{name}" for name in results) or "none"),
        ("checkpoints", checkpoints_line(args, Path(folder))),
        *exported,
    ]
    next_steps = [("publish", f"coreformer publish {folder} --repo-id YOUR_NAME/{Path(folder).name}"), *export]
    return _summary(where, next_steps)


def held_out_numbers(result: dict[str, float], names: tuple[str, ...]) -> str:
    """ "perplexity 91.6134" (a language model) or "mlm loss 5.8, rtd loss 0.41, ..." (ELECTRA, whose combined loss
    has no perplexity): the objective's held-out numbers (`card_metrics`), as the log and the card print them."""
    return ", ".join(f"{name.replace('_', ' ')} {result[name]:.4f}" for name in names)


def time_line(seconds: float, *, sampled: bool) -> str:
    """ "time: 4 min 52 s ..." for a run that took `seconds` from its start (reading the data) to its end."""
    minutes, rest = divmod(round(seconds), 60)
    took = f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"
    sample = ", sample" if sampled else ""
    return f"time: {took} for this run (data, tokenizer, steps, evaluations, final save{sample}; not counting imports)"
