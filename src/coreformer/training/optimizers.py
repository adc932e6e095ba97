"""The optimizer and learning-rate schedule of a pretraining run (`--optimizer`, `--lr-scheduler-type`).

    OPTIMIZER_BUILDERS[name](model, args, device)          adamw | muon -> the Optimizer
    SCHEDULES[name](optimizer, args)                       cosine | wsd -> the LambdaLR
    build_optimizer(model, args, device) / build_schedule(optimizer, args)
    wsd_steps(warmup_steps, max_steps, decay_fraction) -> (warmup, stable, decay)
    muon_parameters(model) -> (names under Muon, names under AdamW)
    MuonWithAdamW                                          Muon and AdamW stepped as one torch Optimizer
    check_optimization_settings(args)                      the range checks of the settings above
    check_run_optimizer(args, engine, state)               muon on whole weights only; a resume keeps its optimizer
    optimizer_text(args) / schedule_text(args)             what the model card says of them

Muon (Keller Jordan 2024; torch.optim.Muon) orthogonalises the momentum of a 2-D weight by Newton-Schulz
iterations; it is meant for the hidden matrices only. Which parameters it takes is decided once, by module:

    model
      embed_tokens, position table        AdamW (decay on the table)
      layers.N  (a `_no_split_modules` block)
        self_attn.{q,k,v,o}_proj.weight   Muon
        cross_attn.*_proj.weight          Muon
        mlp.{gate,up,down}_proj.weight    Muon
        *.bias, norms                     AdamW (no decay)
      final norm                          AdamW (no decay)
      lm_head / classifier / pooler       AdamW (decay)

One optimizer object holds both (MuonWithAdamW): Accelerate wraps one optimizer, the schedule scales every group
(each from its own peak rate: --muon-lr for Muon's, --lr for AdamW's; the run logs --lr's), and a checkpoint's
optimizer.bin holds both states, so gradient accumulation, clipping and exact resume work as with AdamW alone.

Sharded parameters are refused under Muon: Newton-Schulz needs the whole matrix, and a DTensor shard of FSDP2
(or a flattened ZeRO partition) holds only some rows.
"""

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import get_cosine_schedule_with_warmup, get_wsd_schedule

from coreformer_settings.pretraining import DECAY_SHAPES, LR_SCHEDULERS, MUON_LR_ADJUSTMENTS, OPTIMIZERS

from .arguments import PretrainingError

__all__ = [
    "OPTIMIZER_BUILDERS",
    "SCHEDULES",
    "MuonWithAdamW",
    "build_optimizer",
    "build_schedule",
    "check_optimization_settings",
    "check_run_optimizer",
    "muon_parameters",
    "optimizer_text",
    "schedule_text",
    "wsd_steps",
]


def _block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: instances of the `_no_split_modules` classes of every model inside `model` (ELECTRA
    holds two), as FSDP finds them (engine.py)."""
    names = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or ())}
    return [module for module in model.modules() if type(module).__name__ in names]


def muon_parameters(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(the names of the parameters Muon trains: the weights of the linear layers inside the blocks, the names of
    the rest), each in `named_parameters` order."""
    hidden = {
        id(module.weight)
        for block in _block_modules(model)
        for module in block.modules()
        if isinstance(module, torch.nn.Linear)
    }
    muon, rest = [], []
    for name, parameter in model.named_parameters():
        (muon if id(parameter) in hidden else rest).append(name)
    return muon, rest


def _adamw_groups(parameters: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices and embeddings only (not biases or norm gains)."""
    return [
        {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
    ]


def _adamw(parameters: list[torch.nn.Parameter], args, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        _adamw_groups(parameters, args.weight_decay),
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=device.type in ("cuda", "cpu"),  # one kernel for every tensor: ~5x foreach on CPU
    )


def build_adamw(model: torch.nn.Module, args, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over every parameter."""
    return _adamw(list(model.parameters()), args, device)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the hidden matrices and AdamW for the rest, as one Optimizer: `param_groups` lists AdamW's groups
    then Muon's (the same dicts, so a schedule that sets group["lr"] sets theirs; the first is --lr's, the rate the
    run logs), `state_dict` holds both states.

    Optimizer.__init__ is not called: the groups and states live in the two inner optimizers, and this object only
    views them (a second copy of the groups would drift from theirs)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw
        self.defaults = {"lr": adamw.defaults["lr"]}

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return self.muon, self.adamw

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.adamw.param_groups + self.muon.param_groups

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {**self.muon.state, **self.adamw.state}

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise PretrainingError(
                "The checkpoint's optimizer state is not Muon + AdamW (the run that saved it used another "
                "--optimizer); resume with that run's --optimizer."
            )
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError(
            "MuonWithAdamW splits the model's parameters once, when it is built (Muon: the blocks' matrices; AdamW: "
            "the rest): build a new one with build_optimizer for other parameters."
        )

    def __repr__(self) -> str:
        return f"MuonWithAdamW(\n{self.muon!r},\n{self.adamw!r})"


WHOLE_WEIGHTS = ("none", "DDP")  # Engine.sharding of the engines that keep every weight whole on every process


def check_run_optimizer(args, engine, state: dict[str, Any] | None) -> None:
    """Before anything is written: Muon only where every process holds whole weights (module docstring), and a
    resumed run keeps the optimizer its checkpoint's state belongs to."""
    if args.optimizer == "muon" and engine.sharding not in WHOLE_WEIGHTS:
        raise PretrainingError(
            f"--optimizer muon needs whole weight matrices (Newton-Schulz orthogonalises each one), but this run "
            f"shards them ({engine.sharding}); pass --optimizer adamw, or launch without sharding (one process or "
            f"DDP)."
        )
    saved = (state or {}).get("args", {}).get("optimizer", "adamw")  # checkpoints before the setting: AdamW
    if state is not None and saved != args.optimizer:
        raise PretrainingError(
            f"The checkpoint was trained with --optimizer {saved}, this run asks for {args.optimizer}: its optimizer "
            f"state does not carry over. Resume with --optimizer {saved}, or start a new run from the final folder."
        )


def _refuse_sharded(parameters: Iterator[torch.nn.Parameter]) -> None:
    from torch.distributed.tensor import DTensor

    if any(isinstance(parameter, DTensor) for parameter in parameters):
        raise PretrainingError(
            "--optimizer muon needs whole weight matrices (Newton-Schulz orthogonalises each one), but this run "
            "shards them (FSDP2 DTensors); pass --optimizer adamw, or launch without FSDP (one process or DDP)."
        )


def build_muon(model: torch.nn.Module, args, device: torch.device) -> MuonWithAdamW:
    """Muon over the blocks' linear weights, AdamW over the rest (module docstring)."""
    parameters = dict(model.named_parameters())
    _refuse_sharded(iter(parameters.values()))
    hidden, rest = muon_parameters(model)
    if not hidden:
        raise PretrainingError(f"--optimizer muon found no linear layer inside {type(model).__name__}'s blocks.")
    muon = torch.optim.Muon(
        [parameters[name] for name in hidden],
        lr=args.muon_lr,
        weight_decay=args.weight_decay,
        momentum=args.muon_momentum,
        ns_steps=args.muon_ns_steps,
        adjust_lr_fn=args.muon_adjust_lr,
    )
    return MuonWithAdamW(muon, _adamw([parameters[name] for name in rest], args, device))


OPTIMIZER_BUILDERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": build_adamw, "muon": build_muon}
assert tuple(OPTIMIZER_BUILDERS) == OPTIMIZERS  # the settings' choices name exactly these


def build_optimizer(model: torch.nn.Module, args, device: torch.device) -> torch.optim.Optimizer:
    """The run's optimizer (`args.optimizer`) over `model`'s parameters that train."""
    return OPTIMIZER_BUILDERS[args.optimizer](model, args, device)


def _cosine(optimizer: torch.optim.Optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    return get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)


def wsd_steps(warmup_steps: int, max_steps: int, decay_fraction: float) -> tuple[int, int, int]:
    """(warmup, stable, decay) steps summing to max_steps: the decay takes the last `decay_fraction` of the run (at
    least one step when the fraction is > 0), the warmup what is left before it."""
    decay = min(max_steps, math.ceil(decay_fraction * max_steps))
    warmup = min(warmup_steps, max_steps - decay)
    return warmup, max_steps - warmup - decay, decay


def _wsd(optimizer: torch.optim.Optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    # Warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024): the rate stays at its peak until the decay.
    warmup, stable, decay = wsd_steps(args.warmup_steps, args.max_steps, args.decay_fraction)
    return get_wsd_schedule(
        optimizer,
        num_warmup_steps=warmup,
        num_decay_steps=decay,
        num_stable_steps=stable,
        decay_type=args.decay_shape,
    )


SCHEDULES: dict[str, Callable[..., torch.optim.lr_scheduler.LambdaLR]] = {"cosine": _cosine, "wsd": _wsd}
assert tuple(SCHEDULES) == LR_SCHEDULERS


def build_schedule(optimizer: torch.optim.Optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's learning-rate schedule (`args.lr_scheduler_type`): one multiplier for every group."""
    return SCHEDULES[args.lr_scheduler_type](optimizer, args)


def optimizer_text(args) -> str:
    """The card's optimizer cell."""
    adamw = f"AdamW (betas {args.adam_beta1}, {args.adam_beta2}; weight decay {args.weight_decay})"
    if args.optimizer == "muon":
        return (
            f"Muon for the blocks' linear weights (lr {args.muon_lr:g}, momentum {args.muon_momentum}, "
            f"{args.muon_ns_steps} Newton-Schulz steps, {args.muon_adjust_lr} rate scaling); {adamw} for the rest"
        )
    return adamw


def schedule_text(args) -> str:
    """The card's learning-rate cell."""
    if args.lr_scheduler_type == "wsd":
        warmup, stable, decay = wsd_steps(args.warmup_steps, args.max_steps, args.decay_fraction)
        return f"{args.lr:g}, {warmup} warmup steps, {stable} constant, {args.decay_shape} decay to 0 over {decay}"
    return f"{args.lr:g}, {args.warmup_steps} warmup steps, cosine decay to 0"


def check_optimization_settings(args) -> None:
    """The optimizer's and schedule's settings, each refused with its range."""
    args.check_choices(
        optimizer=OPTIMIZERS,
        lr_scheduler_type=LR_SCHEDULERS,
        decay_shape=DECAY_SHAPES,
        muon_adjust_lr=MUON_LR_ADJUSTMENTS,
    )
    args.check_at_least(1, ("muon_ns_steps",))
    if args.muon_lr <= 0:
        raise PretrainingError(f"`muon_lr` must be > 0, got {args.muon_lr}.")
    if not 0.0 <= args.muon_momentum < 1.0:
        raise PretrainingError(f"`muon_momentum` must be in [0, 1), got {args.muon_momentum}.")
    if not 0.0 <= args.decay_fraction <= 1.0:
        raise PretrainingError(f"`decay_fraction` must be in [0, 1], got {args.decay_fraction}.")
