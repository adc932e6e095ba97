"""The distributed engine of a pretraining run: what the launcher asked for, what runs, and FSDP2 on CPU processes.

    requested_engine(environ) -> EngineRequest    what `accelerate launch` passed to this process (its config file
                                                   and flags reach the script only as environment variables)
    resolve_engine(accelerator, request, mixed_precision) -> Engine
                                                   the engine that runs; refuses (PretrainingError) a request that
                                                   Accelerate did not set up and coreformer does not take over
    Engine.record() / Engine.line()                what metrics.json and the start line say ran
    Engine.setup / save_state / load_state / full_state_dict / model_to_save
    CpuFsdp2Engine.shard / unsharded_copy          fully_shard a model (fine-tuning shards Trainer's model with it);
                                                   a plain copy with the gathered weights
                                                   the engine's part of build, checkpoints and the final save

Two engines:

    AccelerateEngine   whatever Accelerate set up (one process, DDP, Accelerate's FSDP on GPUs, DeepSpeed): the model,
                       optimizer and schedule go through `accelerator.prepare`, checkpoints through
                       `accelerator.save_state` (model.safetensors, optimizer.bin, ...).
    CpuFsdp2Engine     an FSDP2 config launched on CPU processes. Accelerate 1.15 turns ACCELERATE_USE_FSDP into its
                       FSDP engine only on accelerators (state.py switches MULTI_GPU/MULTI_XPU/..., never MULTI_CPU,
                       to FSDP), so on CPU it silently sets up MULTI_CPU and would wrap the model in DDP. Here the run
                       applies torch's `fully_shard` itself inside the same Accelerate run: one FSDP unit per block
                       (the models' `_no_split_modules` classes), then the root; the model never goes through
                       `accelerator.prepare` (no DDP on top: FSDP reduce-scatters the gradients). Checkpoints are
                       torch.distributed.checkpoint (DCP) folders, every rank writing its own shards.

How FSDP2 holds a tiny decoder on 2 processes (Shard(0): rows split across ranks, gathered for each unit's forward
and backward, freed after; gradients reduce-scattered back to the row shards, averaged over ranks):

    root unit (model)    embed_tokens.weight (V, H) == lm_head.weight   rank 0: rows [0, V/2)  rank 1: rows [V/2, V)
                         final norm, position table                      tied weights: one parameter, one shard
    unit layers.0        q/k/v/o_proj, up/down_proj, norms               rank 0: first half of each  rank 1: the rest
    unit layers.1        ...
"""

import os
import pickle
import random
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .arguments import PretrainingError

SINGLE, DATA_PARALLEL, FSDP, DEEPSPEED, MEGATRON = "single process", "data parallel", "FSDP", "DeepSpeed", "Megatron-LM"
DCP_FOLDER = "dcp"  # model + optimizer shards of a CpuFsdp2Engine checkpoint
SCHEDULER_FILE = "scheduler.pt"


def _flag(environ: typing.Mapping[str, str], name: str) -> bool:
    return environ.get(name, "false").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class EngineRequest:
    """What the launcher asked for. `accelerate launch` turns its config file and flags into environment variables
    (accelerate/utils/launch.py): ACCELERATE_USE_FSDP with FSDP_VERSION, FSDP_RESHARD_AFTER_FORWARD, ...;
    ACCELERATE_USE_DEEPSPEED with ACCELERATE_DEEPSPEED_ZERO_STAGE; ACCELERATE_MIXED_PRECISION; torchrun's WORLD_SIZE
    and LOCAL_WORLD_SIZE. Without a launcher every field is the single-process default."""

    engine: str
    world_size: int
    num_nodes: int
    mixed_precision: str | None  # the launcher's --mixed_precision / config value; None without a launcher
    fsdp_version: int | None = None
    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False
    zero_stage: int | None = None


def requested_engine(environ: typing.Mapping[str, str] = os.environ) -> EngineRequest:
    world = int(environ.get("WORLD_SIZE", 1))
    local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
    common = dict(
        world_size=world,
        num_nodes=max(1, world // max(local_world, 1)),
        mixed_precision=environ.get("ACCELERATE_MIXED_PRECISION"),
    )
    if _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        return EngineRequest(DEEPSPEED, zero_stage=int(stage) if stage else None, **common)
    if _flag(environ, "ACCELERATE_USE_MEGATRON_LM"):
        return EngineRequest(MEGATRON, **common)
    if _flag(environ, "ACCELERATE_USE_FSDP"):
        strategy = environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
        reshard = environ.get("FSDP_RESHARD_AFTER_FORWARD")
        return EngineRequest(
            FSDP,
            fsdp_version=int(environ.get("FSDP_VERSION", 1)),
            # FSDP2 reads reshard_after_forward; FSDP1's strategy names map onto it (SHARD_GRAD_OP keeps parameters)
            reshard_after_forward=reshard.lower() == "true" if reshard else strategy != "SHARD_GRAD_OP",
            offload_params=_flag(environ, "FSDP_OFFLOAD_PARAMS"),
            activation_checkpointing=_flag(environ, "FSDP_ACTIVATION_CHECKPOINTING"),
            **common,
        )
    return EngineRequest(DATA_PARALLEL if world > 1 else SINGLE, **common)


# ---------------------------------------------------------------------------------------------------------------------
# The engines
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Engine:
    """What runs. `sharding` in words: none (one process), DDP, FSDP2 full shard / shard grad-op, DeepSpeed ZeRO-N."""

    distributed_type: str  # Accelerate's DistributedType
    world_size: int
    num_nodes: int
    sharding: str
    mixed_precision: str
    backend: str | None
    set_up_by: str  # "accelerate" or "coreformer" (fully_shard on CPU processes)
    requested: EngineRequest
    checkpoint_format: typing.ClassVar[str] = "accelerate"

    def record(self) -> dict[str, Any]:
        """The `engine` entry of metrics.json and of every checkpoint's trainer_state.json."""
        return {
            "distributed_type": self.distributed_type,
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "sharding": self.sharding,
            "mixed_precision": self.mixed_precision,
            "backend": self.backend,
            "set_up_by": self.set_up_by,
            "requested": {"engine": self.requested.engine, "mixed_precision": self.requested.mixed_precision},
            "checkpoint_format": self.checkpoint_format,
        }

    def line(self, threads: str | None = None) -> str:
        """The start line, with each process's torch `threads` in words (`threads.ThreadChoice.apply`); a second
        line when the launcher's mixed precision is not the run's (the flag decides)."""
        by = "coreformer's fully_shard inside Accelerate" if self.set_up_by == "coreformer" else "Accelerate"
        line = (
            f"engine: {self.distributed_type} ({self.sharding}, set up by {by}), {self.world_size} process(es) on "
            f"{self.num_nodes} node(s), backend {self.backend or 'none'}, mixed precision {self.mixed_precision}"
        )
        if threads is not None:
            line += f", {threads}"
        launcher = self.requested.mixed_precision
        if launcher not in (None, self.mixed_precision):
            line += (
                f"\nnote: the launcher's mixed precision is {launcher}, this run's --mixed-precision is "
                f"{self.mixed_precision}: the flag decides (pass --mixed-precision {launcher} to follow the launcher)"
            )
        return line

    # ---- the engine's part of the run ----
    def setup(self, accelerator, model, build_optimizer: Callable, build_scheduler: Callable) -> tuple:
        """(model, optimizer, scheduler) ready to train; the optimizer is built over the parameters that train."""
        optimizer = build_optimizer(model)
        return accelerator.prepare(model, optimizer, build_scheduler(optimizer))

    def save_state(self, accelerator, model, optimizer, scheduler, folder: Path) -> None:
        accelerator.save_state(str(folder))

    def load_state(self, accelerator, model, optimizer, scheduler, folder: Path) -> None:
        accelerator.load_state(str(folder))

    def full_state_dict(self, accelerator, model) -> dict[str, torch.Tensor]:
        """The whole model's weights on the main process (a collective: every process calls it)."""
        return accelerator.get_state_dict(model)

    def model_to_save(self, accelerator, model, rebuild: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """The module whose save_pretrained writes the final folder (its class and config; weights come from
        full_state_dict)."""
        return accelerator.unwrap_model(model)


class AccelerateEngine(Engine):
    """Everything through Accelerate (module docstring)."""


class CpuFsdp2Engine(Engine):
    """FSDP2 by `fully_shard` on CPU processes (module docstring), DCP checkpoints."""

    checkpoint_format: typing.ClassVar[str] = "dcp"

    def __init__(self, *args, reshard_after_forward: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reshard_after_forward = reshard_after_forward

    def mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mixed_precision == "bf16":  # compute in bf16, gradients reduced in fp32 (gloo carries both)
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """fully_shard on every block (the `_no_split_modules` classes of every transformers model inside), then on
        the root, which holds the rest: the embeddings and every weight tied to them, sharded once."""
        from torch.distributed.fsdp import fully_shard

        block_names = {
            name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or ())
        }
        blocks = [module for module in model.modules() if type(module).__name__ in block_names]
        if not blocks:
            raise PretrainingError(
                f"FSDP wraps one unit per block, but {type(model).__name__} declares no `_no_split_modules`."
            )
        policy = self.mp_policy()
        for block in blocks:
            fully_shard(block, mp_policy=policy, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mp_policy=policy, reshard_after_forward=self.reshard_after_forward)
        return model

    def setup(self, accelerator, model, build_optimizer: Callable, build_scheduler: Callable) -> tuple:
        model = self.shard(model.to(accelerator.device))
        optimizer = build_optimizer(model)  # over the DTensor shards: each rank steps its own rows
        # The optimizer goes through Accelerate (it skips steps while accumulating), the model does not (no DDP).
        optimizer, scheduler = accelerator.prepare(optimizer, build_scheduler(optimizer))
        return model, optimizer, scheduler

    @staticmethod
    def _optimizers(optimizer) -> tuple:
        """What DCP reads the state of: the optimizer under Accelerate's wrapper, or the optimizers a combined one
        steps (optimizers.MuonWithAdamW), each parameter's state then saved under its name whichever holds it."""
        inner = getattr(optimizer, "optimizer", optimizer)
        return tuple(getattr(inner, "optimizers", (inner,)))

    @classmethod
    def _states(cls, model, optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, cls._optimizers(optimizer))
        return {"model": model_state, "optimizer": optimizer_state}

    def save_state(self, accelerator, model, optimizer, scheduler, folder: Path) -> None:
        """Every rank writes its shards of the model and optimizer (DCP; rank 0 also the metadata), its RNG states;
        rank 0 the schedule."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._states(model, optimizer), checkpoint_id=str(folder / DCP_FOLDER))
        rank = accelerator.process_index
        (folder / f"random_states_{rank}.pkl").write_bytes(pickle.dumps(_rng_states()))
        if accelerator.is_main_process:
            torch.save(scheduler.state_dict(), folder / SCHEDULER_FILE)

    def load_state(self, accelerator, model, optimizer, scheduler, folder: Path) -> None:
        """The shards this rank holds, read from whichever files hold them (DCP reshards to any world size)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        states = self._states(model, optimizer)
        dcp.load(states, checkpoint_id=str(folder / DCP_FOLDER))
        set_state_dict(
            model,
            self._optimizers(optimizer),
            model_state_dict=states["model"],
            optim_state_dict=states["optimizer"],
        )
        scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, weights_only=False))
        rng = folder / f"random_states_{accelerator.process_index}.pkl"
        if rng.is_file():  # a resume on more processes than the checkpoint had: the new ranks keep their seeds
            _set_rng_states(pickle.loads(rng.read_bytes()))

    def full_state_dict(self, accelerator, model) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # All-gathered from the shards onto rank 0's CPU memory; the other ranks get an empty dict.
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def unsharded_copy(self, accelerator, model: torch.nn.Module) -> torch.nn.Module | None:
        """A plain copy of the sharded `model` (its own class, config and generation config) holding every weight,
        gathered from the shards into the main process's CPU memory; None on the other processes (a collective:
        every process calls it). For writers that need a model with real weights, not a state dict beside a meta
        model: fine-tuning's checkpoints (Trainer's save_model) and final folder (with its pipeline)."""
        from torch.distributed.fsdp import FSDPModule

        state_dict = self.full_state_dict(accelerator, model)
        if not accelerator.is_main_process:
            return None
        # fully_shard made the class FSDP<Class>(FSDPModule, Class): the first base that is not FSDP's
        plain = next(cls for cls in type(model).__mro__[1:] if not issubclass(cls, FSDPModule))
        copy = plain(model.config)
        copy.load_state_dict(state_dict)
        if hasattr(model, "generation_config"):
            copy.generation_config = model.generation_config
        return copy.eval()

    def model_to_save(self, accelerator, model, rebuild: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        # fully_shard swaps the class for FSDP<Class>, a name save_pretrained would write into config.json: a copy
        # of the unsharded model, built on the meta device (no memory), gives the class, config and code files.
        with torch.device("meta"):
            return rebuild()


def _rng_states() -> dict[str, Any]:
    import numpy

    return {"python": random.getstate(), "numpy": numpy.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_states(states: dict[str, Any]) -> None:
    import numpy

    random.setstate(states["python"])
    numpy.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


# ---------------------------------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------------------------------

_SHARDING = {True: "FSDP2 full shard", False: "FSDP2 shard grad-op"}  # by reshard_after_forward
FSDP2_SHARDINGS = tuple(_SHARDING.values())  # Engine.sharding where every parameter is a DTensor of rows (Shard(0))


def _sharding(accelerator) -> str:
    """What Accelerate set up, in words."""
    kind = accelerator.distributed_type.value
    if kind == "NO":
        return "none"
    if kind == "FSDP":
        plugin = accelerator.state.fsdp_plugin
        if plugin.fsdp_version == 2:
            return _SHARDING[bool(plugin.reshard_after_forward)]
        return f"FSDP1 {getattr(plugin.sharding_strategy, 'name', plugin.sharding_strategy)}"
    if kind == "DEEPSPEED":
        return f"DeepSpeed ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}"
    return "DDP"


def resolve_engine(
    accelerator, request: EngineRequest, mixed_precision: str, *, error: type[Exception] = PretrainingError
) -> Engine:
    """The engine that runs `request` under `accelerator`, or one `error` (PretrainingError; FinetuningError for
    fine-tuning) naming what was asked, what Accelerate set up instead and how to launch what was meant. Never a silent
    downgrade."""
    kind = accelerator.distributed_type.value
    backend = getattr(accelerator.state, "backend", None)
    world, nodes = accelerator.num_processes, request.num_nodes
    wanted = {FSDP: ("FSDP",), DEEPSPEED: ("DEEPSPEED",), MEGATRON: ("MEGATRON_LM",)}.get(request.engine)
    if wanted is None or kind in wanted:  # Accelerate set up what was asked
        sharding = _sharding(accelerator)
        return AccelerateEngine(kind, world, nodes, sharding, mixed_precision, backend, "accelerate", request)
    asked = f"The launcher asked for {request.engine}"
    if request.engine == FSDP and kind == "MULTI_CPU":  # Accelerate does not do FSDP on CPU: coreformer does
        if request.fsdp_version != 2:
            raise error(
                f"{asked} version {request.fsdp_version}, which Accelerate does not set up on CPU processes (it set up "
                f"MULTI_CPU data parallel instead); coreformer shards CPU processes with FSDP2: set `fsdp_version: 2` "
                f"in the accelerate config (training/configs/accelerate/fsdp.yaml)."
            )
        for setting, on, instead in (
            ("fsdp_offload_params", request.offload_params, "the parameters already live in CPU memory"),
            ("fsdp_activation_checkpointing", request.activation_checkpointing, "pass --gradient-checkpointing"),
        ):
            if on:
                raise error(
                    f"{asked} with {setting}: true, which FSDP2 on CPU processes does not do ({instead}); set "
                    f"{setting}: false in the accelerate config."
                )
        if mixed_precision == "fp16":
            raise error(
                "FSDP2 on CPU processes runs in fp32 or bf16 (fp16 would need a gradient scaler over sharded "
                "gradients); pass --mixed-precision bf16 or no."
            )
        sharding = _SHARDING[request.reshard_after_forward]
        return CpuFsdp2Engine(
            "FSDP",
            world,
            nodes,
            sharding,
            mixed_precision,
            backend,
            "coreformer",
            request,
            reshard_after_forward=request.reshard_after_forward,
        )
    how = {
        "NO": "Accelerate set up a single process (one process shards nothing); launch at least 2 processes, "
        "with ACCELERATE_USE_CPU=1 on a machine without GPUs",
        "MULTI_CPU": "Accelerate set up MULTI_CPU data parallel (DDP) instead: it does not run this engine on CPU "
        "processes",
    }.get(kind, f"Accelerate set up {kind} instead")
    raise error(
        f"{asked}, but {how}. Launch without that config (e.g. ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
        f"--num_processes N for DDP), or on machines where Accelerate runs {request.engine}."
    )
