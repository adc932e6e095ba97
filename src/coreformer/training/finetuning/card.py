"""What the model card of a fine-tuned folder (and of its LoRA adapter) says: the task, the data, the settings and
the evaluation numbers, as a `ModelCardInfo` for coreformer.hub.model_card (the driver's `finish` writes it).
"""

from __future__ import annotations

from pathlib import Path

from ...hub.model_card import ModelCardInfo, inherited_license, is_hub_id
from .arguments import FinetuningArguments


def finetuned_card_info(
    args: FinetuningArguments, family: str, num_parameters: int, metrics: dict, data: str, adapter: bool
):
    """What a fine-tuned folder's (or its adapter's) card says: the task, the data, the settings, the eval numbers."""
    hub_dataset = args.dataset if args.dataset and is_hub_id(args.dataset) else None
    # A fine-tuned model is a derivative of its base: it carries the base's license, "other" when none is recorded.
    base_license = inherited_license(args.model) if Path(args.model).is_dir() else None
    limitations = "A small model fine-tuned briefly; the evaluation numbers above are its only measurement."
    if base_license is None:
        limitations += (
            f" The base model's license is not recorded here (`license: other`): the terms of {args.model} apply."
        )
    eval_results = {
        key.removeprefix("eval_"): value
        for key, value in metrics.items()
        if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second", "_time", "_samples"))
    }
    hyperparameters = _card_hyperparameters(args, metrics)
    what = "A LoRA adapter" if adapter else "A coreformer " + family + " model"
    summary = f"{what} fine-tuned for {args.task} with `coreformer finetune` (transformers Trainer)"
    if args.peft == "lora" and not adapter:
        summary += "; LoRA adapters merged into the weights (the adapter alone is in `adapter/`)"
    return ModelCardInfo(
        kind="fine-tuned",
        title=f"coreformer {family} fine-tuned for {args.task}" + (" (LoRA adapter)" if adapter else ""),
        family=family,
        auto_class=args.spec.auto_class,
        summary=summary + ".",
        num_parameters=num_parameters,
        base_model=args.model,
        datasets=[hub_dataset] if hub_dataset else [],
        dataset_description=data,
        pipeline_tag=args.spec.pipeline_tag,
        task_type=args.spec.card_task_type,
        task_name=args.spec.card_task_name,
        eval_results=eval_results,
        eval_dataset=_eval_dataset_name(args),
        hyperparameters=hyperparameters,
        usage=args.spec.usage,
        intended_use=f"{args.task} on text like the fine-tuning data; a starting point for experiments.",
        limitations=limitations,
        tags=[args.task] + (["lora", "peft"] if args.peft == "lora" else []),
        license=base_license or "other",
    )


def _card_hyperparameters(args: FinetuningArguments, metrics: dict) -> list[tuple[str, object]]:
    """The card's settings table: what the run was given and how far it went."""
    rows = [
        ("task", args.task),
        ("base model", args.model),
        ("steps", int(metrics.get("train_steps", 0))),
        ("epochs", round(float(metrics.get("epoch", 0.0)), 3)),
        ("batch size x accumulation", f"{args.batch_size} x {args.grad_accum}"),
        ("learning rate", f"{args.lr:g}, {args.lr_scheduler_type} schedule, {args.warmup_steps} warmup steps"),
        ("weight decay", args.weight_decay),
        ("max length", args.max_length),
        ("bf16", args.bf16),
        ("seed", args.seed),
    ]
    if args.peft == "lora":
        rows.append(
            (
                "LoRA",
                f"r {args.lora_r}, alpha {args.lora_alpha}, dropout {args.lora_dropout}, on {args.lora_target_modules}",
            )
        )
    return rows


def _eval_dataset_name(args: FinetuningArguments) -> str:
    """What the model-index names the evaluation data: the Hub id, the validation file, or the embedded default."""
    if args.dataset is not None:
        return args.dataset if is_hub_id(args.dataset) else Path(args.dataset).name + " (held-out share)"
    if args.validation_file is not None:
        return Path(args.validation_file).name
    if args.train_file is not None:
        return Path(args.train_file).name + " (held-out share)"
    return f"coreformer embedded {args.task} data (validation split)"
