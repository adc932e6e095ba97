"""Pretraining on Accelerate: one loop for every objective (objectives/), atomic checkpoints, exact resume.

    PretrainingArguments             every run setting (a CLI flag per field; declared in the torch-free
                                     coreformer_settings.pretraining), validated in __post_init__
    resolve_arguments(...)           dataclass defaults < preset or config file < explicit overrides
    run_pretraining(args) -> dict    prepare (checks) -> open_run_folder -> build (model, data) -> train -> finish
    find_latest_checkpoint(dir)      newest complete `checkpoints/step-N` (checkpoints.py)
    GlobalBatches                    global batch number -> collated batch: the data order of every run (batches.py)

The objective (`--objective`, the family's default when not given) decides the examples, the collator, the model,
the loss, what the final folder holds and what its card says:

    objective    family    examples                                 collator
    masked-lm    encoder   windows of at most block_size ids         MaskedLMCollator (15%, 80/10/10)
    causal-lm    decoder   documents packed into full blocks         PackedCausalLMCollator (no padding)
    denoising    seq2seq   windows of at most block_size ids         DenoisingCollator (infilling + permutation)

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
"""

import dataclasses
import math
import os
import shutil
import tempfile
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

# the settings' torch-free declarations (beside the package, so that training/pretrain.py --help imports no torch)
from coreformer_settings.families import FAMILY_NAMES
from coreformer_settings.objectives import OBJECTIVE_REGISTRY, objective_settings
from coreformer_settings.pretraining import MIXED_PRECISION, PRESETS, REPORT_TO, PretrainingSettings, gather_settings

from ..folders import MissingTokenizerError, folder_tokenizer, link_into, staged_folder
from . import arguments
from .arguments import PretrainingError, RunStoppedError, export_run, write_json
from .batches import GlobalBatches, derive_seed, strided_loader
from .checkpoints import (
    CHECKPOINTS_DIR,
    find_latest_checkpoint,
    read_trainer_state,
    remove_stale_temporaries,
    requested_checkpoint,
    save_checkpoint,
    stopped_message,
)
from .data import iter_texts, load_text_dataset
from .engine import Engine, requested_engine, resolve_engine
from .families import TRAINING_FACTS, longest_input
from .objectives import OBJECTIVES, Objective
from .optimizers import build_optimizer, build_schedule, check_optimization_settings, check_run_optimizer
from .reports import (
    PEAK_FLOPS,
    flops_per_token,
    held_out_numbers,
    plot_losses,
    render_model_card,
    run_summary,
    time_line,
)
from .tokenizer_training import token_config_kwargs, tokenizer_name, train_tokenizer
from .zero_shot import run_zero_shot, zero_shot_line

RUN_CONFIG = "run_config.json"
METRICS = "metrics.json"
# What a run leaves in its output directory: a folder holding any of these is a previous run (--overwrite replaces it).
_RUN_MARKERS = (RUN_CONFIG, CHECKPOINTS_DIR, "config.json", "model.safetensors", "tokenizer.json", METRICS)

__all__ = [
    "FAMILY_NAMES",
    "PRESETS",
    "GlobalBatches",
    "PretrainingArguments",
    "PretrainingError",
    "find_latest_checkpoint",
    "flops_per_token",
    "resolve_arguments",
    "run_pretraining",
]


# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class PretrainingArguments(PretrainingSettings):
    """Every setting of a pretraining run (declared in coreformer_settings.pretraining, so that --help needs no
    torch), checked here against the registries: the objective's families, the family config's fields; the
    objective's own settings are typed and checked by its settings class (coreformer_settings.objectives)."""

    def __post_init__(self) -> None:
        self.check_choices(family=FAMILY_NAMES, mixed_precision=MIXED_PRECISION, report_to=REPORT_TO)
        if self.objective is None:
            self.objective = TRAINING_FACTS[self.family].default_objective
        self.check_choices(objective=tuple(OBJECTIVE_REGISTRY))
        if self.family not in self.spec.families:
            raise PretrainingError(
                f"The {self.objective} objective trains {' or '.join(self.spec.families)} models; --family is "
                f"{self.family}. Pass --family {self.spec.families[0]} or another --objective."
            )
        positive = ("vocab_size", "pad_vocab_to_multiple_of", "block_size", "max_steps", "batch_size", "grad_accum")
        self.check_at_least(1, positive + ("keep_last", "eval_batches"))
        self.check_at_least(
            0, ("save_every", "eval_every", "warmup_steps", "num_workers", "zero_shot_pairs"), note=" (0 turns it off)"
        )
        if self.max_documents is not None and self.max_documents < 2:
            raise PretrainingError(f"`max_documents` must be >= 2 (train + held out), got {self.max_documents}.")
        if self.lr <= 0:
            raise PretrainingError(f"`lr` must be > 0, got {self.lr}.")
        self.check_between("validation_fraction", 0.0, 1.0, low_open=False, high_open=True)
        check_optimization_settings(self)
        self.objective_settings = objective_settings(self.objective, self.objective_settings)  # checked there
        if not isinstance(self.model, dict):
            raise PretrainingError(f"`model` must be a mapping of config fields, got {type(self.model).__name__}.")
        if "vocab_size" in self.model:
            raise PretrainingError(
                "`model.vocab_size` is set from the tokenizer (padded to `pad_vocab_to_multiple_of`); set the "
                "top-level `vocab_size` (the tokenizer's target) instead."
            )
        known = _config_fields(self.family)
        unknown = sorted(set(self.model) - known)
        if unknown:
            raise PretrainingError(
                f"Unknown {self.family} config field(s) under `model`: {', '.join(unknown)}. "
                f"See {TRAINING_FACTS[self.family].config_class.__name__} for the fields."
            )

    @property
    def spec(self) -> Objective:
        return OBJECTIVES[self.objective]

    @property
    def global_batch_size(self) -> int:
        """Examples per optimizer step on one process (times the number of processes for the whole run)."""
        return self.batch_size * self.grad_accum


def _config_fields(family: str) -> set[str]:
    return {f.name for f in dataclasses.fields(TRAINING_FACTS[family].config_class)}


def resolve_arguments(
    *,
    family: str | None = None,
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    configs_dir: str | Path | None = None,
) -> PretrainingArguments:
    """Dataclass defaults, then the preset (`--preset`, default "tiny") or `--config` file, then `overrides`
    (the flags given on the command line). A `model:` mapping in `overrides` updates the file's field by field.
    """
    values, source = gather_settings(
        family=family, preset=preset, config_file=config_file, overrides=overrides, configs_dir=configs_dir
    )
    return PretrainingArguments.resolve(values, source=source)


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer, data, model config
# ---------------------------------------------------------------------------------------------------------------------


def load_tokenizer(name_or_path: str, objective: Objective) -> PreTrainedTokenizerBase:
    """A tokenizer folder or Hub name, checked for the special tokens the objective needs."""
    try:
        tokenizer = folder_tokenizer(name_or_path)
    except MissingTokenizerError as error:
        raise PretrainingError(f"--tokenizer: {error} Or omit --tokenizer to train one.") from None
    except Exception as error:  # OSError for an unknown Hub name, ValueError for broken files
        raise PretrainingError(f"Cannot load tokenizer {name_or_path!r}: {error}") from error
    missing = [name for name in objective.required_tokens if getattr(tokenizer, name) is None]
    if missing:
        raise PretrainingError(
            f"Tokenizer {name_or_path!r} has no {', '.join(missing)}, which the {objective.name} objective needs; "
            f"omit --tokenizer to train one."
        )
    return tokenizer


def load_dataset_splits(args: PretrainingArguments) -> datasets.DatasetDict:
    """`load_text_dataset` with its errors (and the Hub's) turned into one PretrainingError."""
    try:
        return load_text_dataset(
            args.dataset,
            args.text_column,
            seed=args.seed,
            validation_fraction=args.validation_fraction,
            max_documents=args.max_documents,
            config_name=args.dataset_config,
        )
    except ValueError as error:
        raise PretrainingError(str(error)) from error
    except Exception as error:  # DatasetNotFoundError, ConnectionError offline, FileNotFoundError, ...
        raise PretrainingError(
            f"Cannot load dataset {args.dataset!r}: {type(error).__name__}: {error}. Pass a local file "
            f"(.txt/.json/.jsonl/.csv/.parquet), a datasets Hub name, or omit --dataset for the embedded corpus."
        ) from error


def build_collator(tokenizer: PreTrainedTokenizerBase, args: PretrainingArguments) -> Any:
    return args.spec.collator(tokenizer, args)


def build_model_config(args: PretrainingArguments, tokenizer: PreTrainedTokenizerBase):
    """The family config: token ids from the tokenizer, vocab padded to `pad_vocab_to_multiple_of`, then `model`."""
    fields = token_config_kwargs(tokenizer, args.family)
    multiple = args.pad_vocab_to_multiple_of
    fields["vocab_size"] = math.ceil(len(tokenizer) / multiple) * multiple
    fields.update(args.model)
    try:
        config = TRAINING_FACTS[args.family].config_class(**fields)
    except ValueError as error:
        raise PretrainingError(f"Bad model config: {error}") from error
    longest = longest_input(config)
    if longest is not None and args.block_size > longest:
        needed = args.block_size + config.position_offset
        raise PretrainingError(
            f"--block-size {args.block_size} needs max_position_embeddings >= {needed} with "
            f"{config.position_embedding_type} positions; the model has {config.max_position_embeddings}. "
            f"Lower --block-size or raise model.max_position_embeddings."
        )
    return config


def input_token_count(batch: dict[str, torch.Tensor]) -> int:
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


# ---------------------------------------------------------------------------------------------------------------------
# The output directory, resume, launch
# ---------------------------------------------------------------------------------------------------------------------


def check_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse a folder that holds something, unless it is a previous run and `overwrite` is set."""
    arguments.check_output_dir(
        output_dir,
        overwrite,
        markers=_RUN_MARKERS,
        error=PretrainingError,
        otherwise="--resume-from-checkpoint latest to continue it",
    )


def resolve_resume(args: PretrainingArguments, output_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None to start fresh; refuses a checkpoint of another family, objective or
    model."""
    if args.resume_from_checkpoint is None:
        check_output_dir(output_dir, args.overwrite)
        return None
    holds_run = output_dir.is_dir() and arguments.holds_run(output_dir, _RUN_MARKERS)
    checkpoint, state = requested_checkpoint(
        args.resume_from_checkpoint, output_dir, holds_run=holds_run, error=PretrainingError
    )
    if checkpoint is None:
        check_output_dir(output_dir, args.overwrite)
        return None  # nothing to resume yet: the same command starts the run and restarts it after a crash
    if output_dir.resolve() not in checkpoint.resolve().parents:
        check_output_dir(output_dir, args.overwrite)  # continuing another run's checkpoint in a new folder
    if state.get("family") != args.family:
        raise PretrainingError(
            f"Checkpoint {str(checkpoint)!r} belongs to a run of the {state.get('family')} family; this run trains the "
            f"{args.family} family. Pass --family {state.get('family')} with the same preset, or start a new "
            f"--output-dir."
        )
    saved_objective = state.get("args", {}).get("objective") or TRAINING_FACTS[args.family].default_objective
    if saved_objective != args.objective:
        raise PretrainingError(
            f"Checkpoint {str(checkpoint)!r} belongs to a run of the {saved_objective} objective; this run trains "
            f"{args.objective}. Pass --objective {saved_objective}, or start a new --output-dir."
        )
    saved_model = state.get("args", {}).get("model", {})
    if saved_model != args.model:
        changed = sorted(
            key for key in set(saved_model) | set(args.model) if saved_model.get(key) != args.model.get(key)
        )
        raise PretrainingError(
            f"Checkpoint {str(checkpoint)!r} was trained with another model config (differs in: {', '.join(changed)}); "
            f"resume with the preset or config file it was started with."
        )
    return checkpoint


def check_world_size(world: int, environ: typing.Mapping[str, str] = os.environ) -> None:
    """Refuse a launch whose processes do not form one run.

    On a machine without GPUs, `accelerate launch --multi_gpu` (or a MULTI_GPU config file) without
    ACCELERATE_USE_CPU=1 starts N processes that each set up a single-process run: N independent runs writing one
    folder. The launcher's WORLD_SIZE tells.
    """
    launched = int(environ.get("WORLD_SIZE", world))
    if launched != world:
        raise PretrainingError(
            f"The launcher started {launched} processes but Accelerate set up {world}. On CPU, launch with "
            f"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {launched} -m coreformer_cli "
            "pretrain ..."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Tracker, tokenizer sharing, evaluation
# ---------------------------------------------------------------------------------------------------------------------


def _tracker(report_to: str) -> tuple[str | None, str]:
    """(log_with, a line saying what happens)."""
    try:
        import tensorboard  # noqa: F401

        available = True
    except ImportError:
        available = False
    if report_to == "none":
        return None, "tracker: none (--report-to none)"
    if available:
        return "tensorboard", "tracker: tensorboard"
    if report_to == "tensorboard":
        raise PretrainingError("--report-to tensorboard needs the tensorboard package: pip install tensorboard")
    return None, "tracker: none (tensorboard is not installed; pip install tensorboard to log curves)"


def _hparams(args: PretrainingArguments) -> dict[str, Any]:
    """Flat scalar settings for TensorBoard's hparams view."""
    settings = dataclasses.asdict(args)
    settings.update({f"model.{key}": value for key, value in settings.pop("model").items()})
    settings.update(settings.pop("objective_settings"))
    return {
        key: value if isinstance(value, int | float | str | bool) else str(value) for key, value in settings.items()
    }


def shared_tokenizer(accelerator, train: typing.Callable[[], PreTrainedTokenizerBase]) -> PreTrainedTokenizerBase:
    """Train on the main process and hand the files to the others: WordPiece training is not reproducible (two
    trainings on the same text can differ), so every process training its own would give ranks different ids."""
    payload: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            tokenizer = train()
            with tempfile.TemporaryDirectory() as folder:
                tokenizer.save_pretrained(folder)
                payload = [{path.name: path.read_bytes() for path in Path(folder).iterdir()}]
        except Exception as error:  # let every process raise it, instead of waiting forever on the main one
            payload = [PretrainingError(f"Tokenizer training failed: {type(error).__name__}: {error}")]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(payload)
    if isinstance(payload[0], Exception):
        raise payload[0]
    if accelerator.is_main_process:
        return tokenizer
    with tempfile.TemporaryDirectory() as folder:
        for name, content in payload[0].items():
            Path(folder, name).write_bytes(content)
        return AutoTokenizer.from_pretrained(folder)


@torch.no_grad()
def evaluate(
    accelerator, model, batches: list[dict[str, torch.Tensor]], objective: Objective, *, seed: int
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
            [objective.label_count(batches[index]), input_token_count(batches[index])]
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


# ---------------------------------------------------------------------------------------------------------------------
# The run: prepare, build, train, finish
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What `prepare` found: every input checked, nothing written yet."""

    args: PretrainingArguments
    accelerator: Any
    tracker: str | None
    resume: Path | None
    state: dict[str, Any] | None  # the resumed checkpoint's trainer_state.json
    tokenizer: PreTrainedTokenizerBase
    tokenizer_name: str
    config: Any
    train_examples: datasets.Dataset
    eval_examples: datasets.Dataset
    engine: Engine  # what runs (engine.py): recorded in metrics.json and every checkpoint

    @property
    def output_dir(self) -> Path:
        return Path(self.args.output_dir)

    @property
    def objective(self) -> Objective:
        return self.args.spec


@dataclass
class _Training:
    """The model and optimizer in training, where the run is in its data, and what it has measured."""

    model: Any
    optimizer: Any
    scheduler: Any
    num_parameters: int
    data: Iterator[tuple[int, dict[str, torch.Tensor]]]
    eval_batches: list[dict[str, torch.Tensor]]
    step: int = 0
    consumed: int = 0  # global batches
    tokens_seen: int = 0
    history: dict[str, list[dict]] = field(default_factory=lambda: {"train": [], "eval": []})
    train_time: float = 0.0
    session_tokens: int = 0


def _accelerator(args: PretrainingArguments) -> tuple[Any, Engine, str | None, str]:
    """The Accelerator of the run (checked to hold every launched process), the engine that runs (the one the
    launcher asked for, or a refusal), its tracker and a line saying which."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    output_dir = Path(args.output_dir)
    log_with, tracker_line = _tracker(args.report_to)
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


def check_checkpoint_engine(checkpoint: Path, state: dict[str, Any], engine: Engine) -> None:
    """A checkpoint is read by the engine that writes its format: Accelerate's save_state folders by Accelerate's
    engines, DCP shards by coreformer's FSDP2 on any number of processes from 2 (DCP reshards: tested 2 -> 4)."""
    recorded = state.get("engine", {})  # absent in checkpoints of runs before engines were recorded: Accelerate's
    saved, writer = recorded.get("checkpoint_format", "accelerate"), recorded.get("sharding", "DDP or single-process")
    if saved != engine.checkpoint_format:
        processes = f"saved by {state.get('world_size', '?')} process(es), this run has {engine.world_size}"
        raise PretrainingError(
            f"Checkpoint {str(checkpoint)!r} holds {saved} state (written by a {writer} run); "
            f"this run is {engine.distributed_type} ({engine.sharding}) and reads {engine.checkpoint_format} "
            f"checkpoints ({processes}). Resume with the launcher config the run was started with"
            + (" (FSDP2 shards of DCP checkpoints load on any number of processes from 2)." if saved == "dcp" else ".")
        )


def _run_tokenizer(args: PretrainingArguments, accelerator, resume: Path | None, state, splits):
    """(tokenizer, how the card names it): the checkpoint's, --tokenizer, or one trained on the training split."""
    if resume is not None:
        return load_tokenizer(str(resume / "tokenizer"), args.spec), state["tokenizer"]
    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer, args.spec), args.tokenizer
    tokenizer = shared_tokenizer(
        accelerator, lambda: train_tokenizer(args.family, iter_texts(splits["train"]), args.vocab_size)
    )
    return tokenizer, f"{tokenizer_name(args.family)} trained on the training split"


def prepare(args: PretrainingArguments) -> _Run:
    """Every check of the inputs (output folder, resume checkpoint, dataset, tokenizer, blocks), on every process,
    before the first write: a bad input raises `PretrainingError` with nothing written or overwritten."""
    accelerator, engine, log_with, tracker_line = _accelerator(args)
    resume = resolve_resume(args, Path(args.output_dir))
    state = read_trainer_state(resume) if resume is not None else None
    if resume is not None:
        check_checkpoint_engine(resume, state, engine)
    check_run_optimizer(args, engine, state)
    splits = load_dataset_splits(args)
    tokenizer, tokenizer_name = _run_tokenizer(args, accelerator, resume, state, splits)
    config = build_model_config(args, tokenizer)
    with accelerator.main_process_first():  # a dataset on disk: the main process writes the map caches, others read
        train_examples = args.spec.examples(splits["train"], tokenizer, args)
        eval_examples = args.spec.examples(splits["validation"], tokenizer, args)
    for name, examples in (("training", train_examples), ("held-out", eval_examples)):
        if len(examples) == 0:
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
    accelerator.print(engine.line())
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
    )


def open_run_folder(run: _Run) -> None:
    """The first writes: the previous run removed (--overwrite, checked), leftovers of crashed saves cleaned,
    the tokenizer and run_config.json."""
    accelerator, output_dir = run.accelerator, run.output_dir
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if run.resume is None and output_dir.is_dir() and any(output_dir.iterdir()):
            shutil.rmtree(output_dir)  # --overwrite of a previous run, checked in prepare
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


def _restore(run: _Run, training: _Training) -> None:
    """Model, optimizer, schedule, scaler, every process's RNG and the data position of the resumed checkpoint."""
    accelerator, state, args = run.accelerator, run.state, run.args
    run.engine.load_state(accelerator, training.model, training.optimizer, training.scheduler, run.resume)
    training.step, training.consumed, training.tokens_seen, training.history = (
        state[key] for key in ("step", "consumed", "tokens_seen", "history")
    )
    micro_batches_per_step = state["world_size"] * state["args"]["grad_accum"]
    if (
        state["args"]["dataset"] != args.dataset
        or micro_batches_per_step != accelerator.num_processes * args.grad_accum
    ):
        accelerator.print(
            "note: the dataset or the number of micro-batches per step differs from the checkpoint's run; the data "
            "position is kept in global batches, so the order of examples continues but the runs are not exact."
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
        model.gradient_checkpointing_enable()
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
    accelerator.init_trackers("pretrain", config=_hparams(args))

    collator = build_collator(run.tokenizer, args)
    train_batches = GlobalBatches(
        run.train_examples, collator, args.batch_size, seed=args.seed, stream="train", shuffle=True
    )
    world, rank = accelerator.num_processes, accelerator.process_index
    training.data = iter(
        strided_loader(  # global batch g = consumed + j * world + rank
            train_batches,
            training.consumed + rank,
            world,
            num_workers=args.num_workers,
            pin_memory=accelerator.device.type == "cuda",
        )
    )
    eval_pool = run.eval_examples.shuffle(seed=args.seed) if len(run.eval_examples) > 1 else run.eval_examples
    eval_source = GlobalBatches(eval_pool, collator, args.batch_size, seed=args.seed, stream="eval", shuffle=False)
    eval_count = max(1, min(args.eval_batches, len(eval_pool) // args.batch_size))
    training.eval_batches = [eval_source[i][1] for i in range(eval_count)]
    return training


def _evaluate(run: _Run, training: _Training) -> dict[str, float]:
    held_out = evaluate(run.accelerator, training.model, training.eval_batches, run.objective, seed=run.args.seed)
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
            sum(input_token_count(batch) for _, batch in micro_batches),
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
        "tokens_per_second": tokens_per_second,
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
    """The final folder, rebuilt beside itself and swapped in (coreformer.folders): a kill leaves the previous final
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
            metrics["zero_shot"] = run_zero_shot(staging, args, accelerator.device)  # zero_shot.py
            metrics["wall_time_s"] = time.perf_counter() - session_start
            plot_losses(training.history, staging / "loss.png", f"coreformer {args.family} ({args.preset})")
            (staging / "README.md").write_text(render_model_card(args, metrics, str(output_dir)))
            write_json(staging / METRICS, metrics)
            export_run(args.export, staging)
            for entry in output_dir.iterdir():
                # A previous run's native export describes its model, not this one: never carried over.
                if entry.name != arguments.EXPORT_FOLDER and not (staging / entry.name).exists():
                    link_into(entry, staging / entry.name)
        first, last = training.history["eval"][0], training.history["eval"][-1]
        speed = f"{metrics['tokens_per_second']:,.0f} tokens/s" if training.session_tokens else "no steps this session"
        extra = held_out_numbers(last, run.objective.metrics_beside_loss)
        accelerator.print(
            f"done: {training.step} steps, held-out loss {first['loss']:.4f} -> {last['loss']:.4f} ({extra}), {speed}; "
            f"wrote {output_dir}"
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
    accelerator.end_training()
    return metrics


def run_pretraining(args: PretrainingArguments) -> dict[str, Any]:
    """Train `args.objective` on `args.dataset` and write the run folder described in the module docstring.

    Returns:
        The metrics also written to metrics.json.
    """
    session_start = time.perf_counter()
    run = prepare(args)
    open_run_folder(run)
    training = build(run)
    try:
        train(run, training)
    except KeyboardInterrupt:
        raise RunStoppedError(stopped_message(run.output_dir, training.step, "start again with --overwrite")) from None
    return finish(run, training, session_start)
