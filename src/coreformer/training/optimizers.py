"""The optimizer and learning-rate schedule of a pretraining run (`--optimizer`, `--lr-scheduler-type`).

    OPTIMIZER_BUILDERS[name](model, args, device)          adamw | muon -> the Optimizer
    SCHEDULES[name](optimizer, args)                       cosine | wsd -> the LambdaLR
    build_optimizer(model, args, device) / build_schedule(optimizer, args)
    wsd_steps(warmup_steps, max_steps, decay_fraction) -> (warmup, stable, decay)
    muon_parameters(model) -> (names under Muon, names under AdamW)
    ShardedMuon                                            torch.optim.Muon that also steps FSDP2's DTensor shards
    muon_owners(shapes, world_size) -> [rank, ...]         which rank orthogonalises each sharded matrix
    MuonWithAdamW                                          Muon and AdamW stepped as one torch Optimizer
    check_optimization_settings(args)                      the range checks of the settings above
    check_run_optimizer(args, engine, state)               muon on whole weights or FSDP2 rows; a resume keeps its
                                                           optimizer
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
optimizer.bin holds both states (a DCP checkpoint of FSDP2: each parameter's state under its name, read from
`optimizers`), so gradient accumulation, clipping and exact resume work as with AdamW alone.

Newton-Schulz needs the whole matrix, and a DTensor shard of FSDP2 holds only some rows: ShardedMuon (torch's Muon,
the same update) sends each matrix's rows to one owner rank, which orthogonalises it whole and sends each rank its rows
back (the scheme of Moonlight's distributed Muon and modded-nanogpt). Momentum, Nesterov, weight decay and the step
are elementwise, so each rank does them on its own rows; only Newton-Schulz's input and output travel, in bf16, the
precision torch's Newton-Schulz casts to first, so every rank ends with the bits one process computes:

    2 ranks, 3 matrices, owners decided once (the costliest first, each to the least loaded rank: muon_owners)
               rank 0 rows  rank 1 rows                     owners
    q_proj     [ q0      ]  [ q1      ]  -- all-to-all -->  rank 0: NS([q0; q1]) = [o0; o1], NS([u0; u1])
    up_proj    [ u0      ]  [ u1      ]                     rank 1: NS([d0; d1])
    down_proj  [ d0      ]  [ d1      ]  <-- all-to-all --  each rank its rows of every result: o0, ... / o1, ...

A flattened partition (DeepSpeed ZeRO, FSDP1's FlatParameter) is not a matrix's rows: Muon is refused there.
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# torch's own Newton-Schulz and rate scaling, so that a sharded step is torch's step to the bit (private names: a torch
# release that moves them fails here, at import, not silently; test_optimizers.py compares the steps)
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from transformers import get_cosine_schedule_with_warmup, get_wsd_schedule

from coreformer_settings.pretraining import DECAY_SHAPES, LR_SCHEDULERS, MUON_LR_ADJUSTMENTS, OPTIMIZERS

from .arguments import PretrainingError
from .engine import FSDP2_SHARDINGS

__all__ = [
    "OPTIMIZER_BUILDERS",
    "SCHEDULES",
    "MuonWithAdamW",
    "ShardedMuon",
    "build_optimizer",
    "build_schedule",
    "check_optimization_settings",
    "check_run_optimizer",
    "muon_owners",
    "muon_parameters",
    "optimizer_text",
    "schedule_text",
    "wsd_steps",
]


def _block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: instances of the `_no_split_modules` classes of every model inside `model` (ELECTRA
    holds two), as FSDP finds them (engine.py); once sharded too, where fully_shard made each block's class
    FSDP<Block>, a subclass of it."""
    names = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or ())}
    return [module for module in model.modules() if any(cls.__name__ in names for cls in type(module).__mro__)]


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


def _newton_schulz_work(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton-Schulz iteration on an (m, n) matrix, m <= n: X X^T (m^2 n), its square (m^3) and
    the product with X (m^2 n): the work an owner takes on for each matrix it orthogonalises."""
    small, large = sorted(shape)
    return small * small * (2 * large + small)


def muon_owners(shapes: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """The rank that orthogonalises each matrix: the costliest first, each to the rank with the least Newton-Schulz
    work so far (ties to the lowest rank), so that every rank computes the same answer without a message."""
    load, owners = [0] * world_size, [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-_newton_schulz_work(shapes[i]), i)):
        owner = min(range(world_size), key=lambda rank: (load[rank], rank))
        owners[index], load[owner] = owner, load[owner] + _newton_schulz_work(shapes[index])
    return owners


def _row_split(rows: int, world_size: int) -> list[int]:
    """The rows each rank holds under Shard(0): torch.chunk's split, as fully_shard makes it (ceil(rows / world)
    each, the last ranks what is left, possibly none)."""
    chunk = -(-rows // world_size)
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(world_size)]


@dataclass(frozen=True)
class _ShardLayout:
    """How ShardedMuon's matrices lie across the ranks, decided once: `rows[i][r]` of matrix i on rank r, its owner."""

    group: dist.ProcessGroup
    device: torch.device  # where the shards live: the exchange's buffers too (gloo on CPU, NCCL on GPUs)
    rank: int
    world_size: int
    rows: list[list[int]]
    columns: list[int]
    owners: list[int]


def _flat(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One bf16 buffer of `tensors`, in order (an empty one when there are none: a rank may send a peer nothing)."""
    return (
        torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0, dtype=torch.bfloat16, device=device)
    )


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon, the same update and state (`momentum_buffer` per parameter), that also steps FSDP2's
    DTensor shards (Shard(0) rows on a 1-D mesh): each matrix is orthogonalised whole by its owner rank (module
    docstring), so a sharded run steps as one process does. The momentum buffers are DTensors sharded like their
    parameters, so DCP checkpoints reshard them to any number of processes. On whole tensors (one process, DDP) the
    step is torch's own.

    Whether the parameters are shards, and the owners, are decided at the first step: Accelerate's FSDP2 (GPUs)
    swaps the parameters for DTensors after the optimizer is built."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._layout: _ShardLayout | None = None
        self._sharded: bool | None = None  # None: not decided yet

    def _decide_layout(self) -> None:
        from torch.distributed.tensor import DTensor, Shard

        parameters = [p for group in self.param_groups for p in group["params"]]
        shards = [p for p in parameters if isinstance(p, DTensor)]
        self._sharded = bool(shards)
        if not shards:
            return
        mesh = shards[0].device_mesh
        for parameter in parameters:
            if not isinstance(parameter, DTensor) or parameter.device_mesh != mesh:
                raise PretrainingError("--optimizer muon needs every matrix whole or every one sharded on one mesh.")
            if mesh.ndim != 1 or tuple(parameter.placements) != (Shard(0),):
                raise PretrainingError(
                    f"--optimizer muon gathers matrices sharded by rows over one mesh dimension (FSDP2's Shard(0)); "
                    f"this run places one as {parameter.placements} on a {mesh.ndim}-D mesh: pass --optimizer adamw."
                )
        group, rank, world_size = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        rows = [_row_split(p.shape[0], world_size) for p in parameters]
        for parameter, split in zip(parameters, rows):
            if parameter.to_local().shape[0] != split[rank]:
                raise PretrainingError(
                    f"--optimizer muon expected rank {rank} to hold {split[rank]} of the {parameter.shape[0]} rows "
                    f"(torch.chunk's split), it holds {parameter.to_local().shape[0]}: pass --optimizer adamw."
                )
        shapes = [tuple(p.shape) for p in parameters]
        columns = [p.shape[1] for p in parameters]
        owners = muon_owners(shapes, world_size)
        self._layout = _ShardLayout(group, shards[0].device, rank, world_size, rows, columns, owners)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        if self._sharded is None:
            self._decide_layout()
        if not self._sharded:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch's _single_tensor_muon, split where Newton-Schulz needs the whole matrix (torch/optim/_muon.py)
        index = {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        stepped, updates = [], []
        for group in self.param_groups:
            parameters, grads, buffers = [], [], []
            self._init_group(group, parameters, grads, buffers)
            momentum = group["momentum"]
            for parameter, grad, buffer in zip(parameters, grads, buffers):
                grad, buffer = grad.to_local(), buffer.to_local()  # this rank's rows; to_local shares the storage
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                # Newton-Schulz starts by casting to bf16: cast before sending, half the bytes, the same bits
                updates.append(update.bfloat16())
                stepped.append((index[id(parameter)], parameter, group))
        orthogonal = self._orthogonalise(updates, stepped)
        for (_, parameter, group), update in zip(stepped, orthogonal):
            lr = float(group["lr"])
            local = parameter.to_local()
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], parameter.shape))  # the whole shape
        return loss

    def _orthogonalise(self, updates: list[torch.Tensor], stepped: list[tuple]) -> list[torch.Tensor]:
        """Newton-Schulz of every matrix whose local rows are `updates`: one all-to-all brings each owner the rows of
        its matrices, one takes each rank its rows of the results. Every rank steps the same matrices (FSDP gives
        each a gradient on every rank)."""
        layout = self._layout
        rank, world = layout.rank, layout.world_size
        matrices = [i for i, _, _ in stepped]
        settings = {i: (g["ns_coefficients"], g["ns_steps"], g["eps"]) for i, _, g in stepped}
        # This rank's rows of each matrix, grouped by owner: the send buffer, in `stepped` order within an owner.
        by_owner = [[n for n, i in enumerate(matrices) if layout.owners[i] == owner] for owner in range(world)]
        send_sizes = [sum(updates[n].numel() for n in ns) for ns in by_owner]
        owned = [matrices[n] for n in by_owner[rank]]
        # What each rank sends this owner: its rows of every owned matrix, in the same order.
        receive_sizes = [sum(layout.rows[i][r] * layout.columns[i] for i in owned) for r in range(world)]
        send = _flat([updates[n] for ns in by_owner for n in ns], layout.device)
        gathered = self._all_to_all(send, send_sizes, receive_sizes)
        from_rank = [
            piece.split([layout.rows[i][r] * layout.columns[i] for i in owned])
            for r, piece in enumerate(gathered.split(receive_sizes))
        ]
        results = []
        for j, i in enumerate(owned):
            # (rows on rank r, columns) pieces -> (rows, columns)
            whole = torch.cat([from_rank[r][j].view(layout.rows[i][r], layout.columns[i]) for r in range(world)])
            coefficients, steps, eps = settings[i]
            results.append(_zeropower_via_newtonschulz(whole, coefficients, steps, eps))  # (rows, columns), bf16
        # Back: each rank's rows of each result, ranks in order; the receive buffer mirrors the send one.
        back = []
        for r in range(world):
            for i, result in zip(owned, results):
                start = sum(layout.rows[i][:r])
                back.append(result[start : start + layout.rows[i][r]])
        returned = self._all_to_all(_flat(back, layout.device), receive_sizes, send_sizes).split(send_sizes)
        orthogonal = [None] * len(matrices)
        for owner, ns in enumerate(by_owner):
            for n, piece in zip(ns, returned[owner].split([updates[n].numel() for n in ns])):
                orthogonal[n] = piece.view_as(updates[n])  # (this rank's rows, columns)
        return orthogonal

    def _all_to_all(self, send: torch.Tensor, send_sizes: list[int], receive_sizes: list[int]) -> torch.Tensor:
        received = send.new_empty(sum(receive_sizes))
        dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=self._layout.group)
        return received


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
# ... and those whose parameters are DTensor rows, which ShardedMuon gathers (FSDP1 and DeepSpeed ZeRO flatten them)
MUON_SHARDINGS = (*WHOLE_WEIGHTS, *FSDP2_SHARDINGS)


def check_run_optimizer(args, engine, state: dict[str, Any] | None) -> None:
    """Before anything is written: Muon only where each matrix is whole or sharded by rows (module docstring), and a
    resumed run keeps the optimizer its checkpoint's state belongs to."""
    if args.optimizer == "muon" and engine.sharding not in MUON_SHARDINGS:
        raise PretrainingError(
            f"--optimizer muon needs whole weight matrices (Newton-Schulz orthogonalises each one) or FSDP2's row "
            f"shards, which it gathers, but this run shards them ({engine.sharding}) into flattened partitions; pass "
            f"--optimizer adamw, or launch with FSDP2 (fsdp_version: 2), DDP or one process."
        )
    saved = (state or {}).get("args", {}).get("optimizer", "adamw")  # checkpoints before the setting: AdamW
    if state is not None and saved != args.optimizer:
        raise PretrainingError(
            f"The checkpoint was trained with --optimizer {saved}, this run asks for {args.optimizer}: its optimizer "
            f"state does not carry over. Resume with --optimizer {saved}, or start a new run from the final folder."
        )


def build_muon(model: torch.nn.Module, args, device: torch.device) -> MuonWithAdamW:
    """Muon over the blocks' linear weights, AdamW over the rest (module docstring)."""
    parameters = dict(model.named_parameters())
    hidden, rest = muon_parameters(model)
    if not hidden:
        raise PretrainingError(f"--optimizer muon found no linear layer inside {type(model).__name__}'s blocks.")
    muon = ShardedMuon(
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
