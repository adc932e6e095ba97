"""The settings of a pretraining run, importable without torch: what `training/pretrain.py --help` shows and how a
run's settings are gathered from a preset or config file and the flags.

    PretrainingSettings              every run setting (a CLI flag per field): the one declaration of each; the
                                     objective's own settings are declared by the objective (objectives.py) and
                                     gathered into `objective_settings`
    add_settings_flags(parser)       a flag per run setting, then a group of flags per registered objective
    PRESETS, preset_path(...)        coreformer/training/configs/{family}-{preset}.yaml (training/configs in a clone)
    load_preset(family, preset)      a preset's values over those of the preset it `extends`
    preset_defaults(configs_dir)     for --help: the value each preset gives a setting it sets
    gather_settings(...) -> (values, source)   preset or config file < flags given; untyped, unchecked

`coreformer.training.pretraining.PretrainingArguments` subclasses PretrainingSettings with the checks that need the
registries (the objective's families, the family config's fields), and its `resolve_arguments` types and checks
what `gather_settings` returns.
"""

import argparse
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import base
from .base import (
    CHECKPOINTS_DIR,
    RUN_CONFIG,
    PretrainingError,
    RunSettings,
    add_flags,
    arg,
    check_output_dir,
    export_arg,
    threads_arg,
)
from .components import add_owned_flags, gather_owned
from .objectives import OBJECTIVE_REGISTRY, ObjectiveSettings, objective_fields
from .registries import FAMILY_NAMES

SIZE_PRESETS = ("tiny", "small", "base")
# at tiny size: the modern recipe of each family, and the architecture faithful to its paper (BERT, GPT-2, BART)
RECIPE_PRESETS = ("tiny-modern", "tiny-faithful")
PRESETS = SIZE_PRESETS + RECIPE_PRESETS
MIXED_PRECISION = ("no", "bf16", "fp16")
REPORT_TO = ("auto", "tensorboard", "none")
OPTIMIZERS = ("adamw", "muon")  # coreformer.training.optimizers.OPTIMIZERS
LR_SCHEDULERS = ("cosine", "wsd")  # coreformer.training.optimizers.SCHEDULES
DECAY_SHAPES = ("linear", "1-sqrt", "cosine")  # transformers.get_wsd_schedule's decay_type
MUON_LR_ADJUSTMENTS = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn
# How documents become rows (--packing): name -> what it does. Each objective names the ones it builds
# (coreformer.training.objectives: `Objective.packings`, its first the default).
PACKINGS = {
    "concatenated": "documents joined by </s> and cut into full blocks; attention crosses documents (GPT-2)",
    "padded": "one document window per row, padded to the batch's longest, with an attention_mask",
    "packed": "whole document windows packed into rows of --block-size with position_ids restarting at each "
    "document: no padding between documents, no attention across them",
}


@dataclass
class PretrainingSettings(RunSettings):
    """Every setting of a pretraining run, declared once. The CLI exposes each field as `--field-name` (see
    training/pretrain.py); a preset or config file (training/configs/*.yaml) holds the same keys plus `model:`, the
    family config's fields. `coreformer.training.pretraining.PretrainingArguments` is this class with its checks.
    """

    error: typing.ClassVar[type[PretrainingError]] = PretrainingError

    family: str = arg(  # no default in --help: a --config file may name the family
        "decoder",
        "model family: encoder (BERT-style), decoder (GPT-style), seq2seq (BART-style)",
        choices=FAMILY_NAMES,
        show_default=False,
    )
    objective: str | None = arg(
        None,
        f"pretraining objective: {', '.join(OBJECTIVE_REGISTRY)}; default: the family's (encoder masked-lm, decoder "
        "causal-lm, seq2seq denoising)",
        choices=OBJECTIVE_REGISTRY.keys(),  # a live view: an objective registered later is a choice too
        show_default=False,
    )
    preset: str | None = arg(None, "name of the preset or config file the settings came from (for the card)", cli=False)
    model: dict = arg({}, "fields of the family config (hidden_size, num_hidden_layers, ...)", cli=False)
    # data
    dataset: str | None = arg(
        None,
        "training text: omitted = the embedded corpus (the Python standard library's source, no download); a local "
        "file or glob (.txt/.json/.jsonl/.csv/.parquet); or a datasets Hub name (downloaded only then)",
    )
    data_dir: str | None = arg(
        None,
        "a `coreformer tokenize` folder: train on its shards, read by memory map, instead of --dataset (its held-out "
        "split is the held-out text; the tokenizer is the one it was made with unless --tokenizer names the same)",
    )
    streaming: bool = arg(
        False,
        "read --dataset as a stream (datasets' streaming=True): documents tokenized as training reads them, each "
        "process its share, nothing stored; needs --tokenizer",
    )
    dataset_config: str | None = arg(None, "configuration of a Hub dataset (e.g. wikitext-2-raw-v1)")
    text_column: str = arg("text", "column holding the text")
    max_documents: int | None = arg(None, "use at most this many training documents (quick runs)")
    validation_fraction: float = arg(0.05, "held-out share of documents when the dataset has no validation split")
    # tokenizer
    tokenizer: str | None = arg(
        None, "tokenizer folder or Hub name; omitted = train one on the training split and save it in --output-dir"
    )
    vocab_size: int = arg(8192, "vocabulary size of a trained tokenizer (special tokens included)")
    pad_vocab_to_multiple_of: int = arg(64, "round the model's vocab_size up to a multiple of this (fast matmuls)")
    block_size: int = arg(128, "tokens per example: packed block (decoder) or longest window (encoder, seq2seq)")
    packing: str | None = arg(
        None,
        "how documents become rows: concatenated (causal-lm only: documents joined by </s>, cut into full blocks, "
        "attention crosses documents), padded (one window per row, padded), packed (whole windows packed into rows "
        "of --block-size, position_ids restarting per document: no padding between documents, no attention across "
        "them); default: concatenated for causal-lm, padded for the others",
        choices=PACKINGS.keys(),
        show_default=False,
    )
    # optimisation
    max_steps: int = arg(1000, "optimizer steps")
    batch_size: int = arg(16, "examples per micro-batch on each process")
    grad_accum: int = arg(1, "micro-batches accumulated per optimizer step")
    lr: float = arg(1e-3, "peak learning rate (AdamW)")
    warmup_steps: int = arg(100, "linear warmup steps before the schedule (--lr-scheduler-type)")
    weight_decay: float = arg(0.1, "AdamW weight decay on matrices (biases, norms: none)")
    adam_beta1: float = arg(0.9, "AdamW beta1")
    adam_beta2: float = arg(0.95, "AdamW beta2")
    adam_epsilon: float = arg(1e-8, "AdamW epsilon")
    optimizer: str = arg(
        "adamw",
        "adamw: every parameter; muon: torch.optim.Muon for the blocks' linear weights, AdamW (--lr) for the rest "
        "(embeddings, heads, norms, biases)",
        choices=OPTIMIZERS,
    )
    muon_lr: float = arg(0.02, "muon: peak learning rate of the blocks' linear weights")
    muon_momentum: float = arg(0.95, "muon: Nesterov momentum")
    muon_ns_steps: int = arg(5, "muon: Newton-Schulz iterations orthogonalising each update")
    muon_adjust_lr: str = arg(
        "original",
        "muon: per-matrix rate scaling: original (sqrt(max(1, rows/cols)), Keller Jordan) or match_rms_adamw "
        "(0.2 sqrt(max(rows, cols)): reuses AdamW's rate and decay)",
        choices=MUON_LR_ADJUSTMENTS,
    )
    lr_scheduler_type: str = arg(
        "cosine",
        "cosine: warmup, then cosine decay to 0 at --max-steps; wsd: warmup, constant, then decay to 0 over the last "
        "--decay-fraction of the steps",
        choices=LR_SCHEDULERS,
    )
    decay_fraction: float = arg(0.2, "wsd: share of --max-steps spent decaying")
    decay_shape: str = arg("linear", "wsd: shape of the decay", choices=DECAY_SHAPES)
    max_grad_norm: float = arg(1.0, "gradient clipping norm (0 disables)")
    mixed_precision: str = arg("no", "autocast precision", choices=MIXED_PRECISION)
    gradient_checkpointing: bool = arg(False, "recompute activations in backward to save memory")
    compile: bool = arg(
        False,
        "torch.compile the model in place (nn.Module.compile): same losses, checkpoint keys and resume as eager; the "
        "first steps are slower while graphs compile",
    )
    attn_implementation: str | None = arg(None, "attention backend (sdpa, eager, flex_attention, ...); default sdpa")
    threads: int | None = threads_arg()
    seed: int = arg(0, "seed of the data order, masking, dropout and initialisation")
    # run
    output_dir: str = arg("outputs/pretrain", "run folder: checkpoints, logs, and the final model")
    overwrite: bool = arg(False, "replace an output directory that holds another run")
    save_every: int = arg(500, "save a checkpoint every N steps (0: none)")
    keep_last: int = arg(2, "keep the last K checkpoints")
    eval_every: int = arg(200, "held-out evaluation every N steps (also before the first step and at the end)")
    eval_batches: int = arg(20, "batches in the held-out evaluation")
    zero_shot_pairs: int = arg(
        32,
        "at the end, `coreformer evaluate` on the final folder with this many minimal pairs (held-out loss at fixed "
        "settings, minimal-pair accuracy), reported in metrics.json and the card (0: none)",
    )
    resume_from_checkpoint: str | None = arg(
        None,
        "'latest' (newest checkpoint in --output-dir; starts fresh when the folder is empty) or a checkpoint folder",
    )
    report_to: str = arg("auto", "tracker: tensorboard, none, or auto (tensorboard when installed)", choices=REPORT_TO)
    num_workers: int = arg(
        0,
        "DataLoader worker processes building the batches ahead, or with --streaming the processes tokenizing the "
        "stream (the same batches as with 0)",
    )
    sample_prompt: str | None = arg(
        None,
        "at the end, reload the final folder with its Auto class and print a sample for this prompt (generated text; "
        "the encoder's top predictions for [MASK])",
    )
    export: str | None = export_arg()
    objective_settings: dict | ObjectiveSettings = arg(
        {},
        "the objective's own settings (flags and config keys of their own: coreformer_settings.objectives)",
        cli=False,
    )

    @classmethod
    def setting_names(cls) -> list[str]:
        """The run's settings and every registered objective's, as flags and config keys name them."""
        return [*super().setting_names(), *objective_fields()]

    @classmethod
    def resolve(cls, values: dict[str, Any], *, source: str | None = None) -> "PretrainingSettings":
        """As RunSettings.resolve, the objectives' settings (flat keys, or an `objective_settings` mapping as
        run_config.json holds them) gathered into `objective_settings`, which the run's objective types and checks."""
        return super().resolve(gather_owned(values, OBJECTIVE_REGISTRY, "objective_settings", run=cls), source=source)


def add_settings_flags(parser: argparse.ArgumentParser, *, default_text: dict[str, str] | None = None) -> None:
    """`--field-name` for every PretrainingSettings field, then, under a heading per registered objective, the
    flags of the settings it owns (a setting two objectives share is shown under the first)."""
    add_flags(parser, PretrainingSettings, PretrainingSettings.cli_fields(), default_text=default_text)
    add_owned_flags(parser, OBJECTIVE_REGISTRY, kind="objective", default_text=default_text)


def default_configs_dir() -> Path:
    """The presets shipped inside the package, coreformer/training/configs (in a clone, a link to training/configs);
    found beside this package without importing coreformer (which imports torch)."""
    return Path(__file__).resolve().parent.parent / "coreformer" / "training" / "configs"


METRICS = "metrics.json"  # the run's numbers, in its folder
# What a pretraining run writes into its folder: any of them there means the folder holds a run.
RUN_MARKERS = (RUN_CONFIG, CHECKPOINTS_DIR, "config.json", "model.safetensors", "tokenizer.json", METRICS)


TEXT_SETTINGS = ("dataset", "dataset_config", "max_documents")  # what --data-dir's shards have decided already


def check_data_source(values: typing.Mapping[str, Any]) -> None:
    """--data-dir trains on shards already tokenized: the settings that choose text to tokenize cannot apply.
    --streaming reads --dataset as it trains: it needs one, and a tokenizer made before (training one would read the
    whole stream first)."""
    given = [f"--{name.replace('_', '-')}" for name in TEXT_SETTINGS if values.get(name) is not None]
    if values.get("data_dir") is not None and (given or values.get("streaming")):
        given += ["--streaming"] if values.get("streaming") else []
        raise PretrainingError(
            f"--data-dir trains on shards `coreformer tokenize` made, and {', '.join(given)} choose(s) text to "
            f"tokenize: drop {' and '.join(given)}, or drop --data-dir to read the text."
        )
    if not values.get("streaming"):
        return
    if values.get("dataset") is None:
        raise PretrainingError(
            "--streaming reads --dataset as a stream, and none is given: pass --dataset FILES or a Hub name (the "
            "embedded corpus is read whole)."
        )
    if values.get("max_documents") is not None:
        raise PretrainingError("--max-documents cuts a dataset read whole; drop it, or drop --streaming.")
    if values.get("tokenizer") is None:
        raise PretrainingError(
            "--streaming needs --tokenizer (a tokenizer folder or Hub name): training one would read the whole stream "
            "before the first step. Train one with a short run on a sample (its --output-dir holds it), or pass a "
            "previous run's folder."
        )


def check_run_folder(output_dir: Path, overwrite: bool) -> None:
    """Refuse a folder that holds something, unless it is a previous run and `overwrite` is set."""
    check_output_dir(
        output_dir,
        overwrite,
        markers=RUN_MARKERS,
        error=PretrainingError,
        otherwise="--resume-from-checkpoint latest to continue it",
    )


def preset_path(family: str, preset: str, configs_dir: str | Path | None = None) -> Path:
    """training/configs/{family}-{preset}.yaml."""
    if family not in FAMILY_NAMES:
        raise PretrainingError(f"Unknown family {family!r}: expected one of {', '.join(FAMILY_NAMES)}.")
    if preset not in PRESETS:
        raise PretrainingError(f"Unknown preset {preset!r}: expected one of {', '.join(PRESETS)}.")
    path = Path(configs_dir or default_configs_dir()) / f"{family}-{preset}.yaml"
    if not path.is_file():
        raise PretrainingError(f"Preset file {path} is missing; pass --config FILE instead.")
    return path


def preset_defaults(configs_dir: str | Path | None = None) -> dict[str, str]:
    """For --help: each setting some preset sets -> "from the preset: tiny 600, small 20000, ..." (a preset whose
    families disagree is named per family; a family's preset that leaves the setting out runs with the default,
    which is shown as its value), then the value a --config file that does not set it gets."""
    values: dict[str, dict[str, Any]] = {}
    presets = {}
    for preset in SIZE_PRESETS:  # the recipes' values are in their files
        for family in FAMILY_NAMES:
            path = Path(configs_dir or default_configs_dir()) / f"{family}-{preset}.yaml"
            if path.is_file():
                presets[f"{family}-{preset}"] = load_preset(family, preset, configs_dir)
                for name, value in presets[f"{family}-{preset}"].items():
                    values.setdefault(name, {})[f"{family}-{preset}"] = value
    texts = {}
    objectives = [spec for _, spec in objective_fields().values()]
    for spec in [*PretrainingSettings.cli_fields(), *objectives]:
        if spec.name not in values:
            continue
        shown = []
        for preset in SIZE_PRESETS:
            found = {
                name: settings.get(spec.name, spec.default)
                for name, settings in presets.items()
                if name.endswith(f"-{preset}")
            }
            if len(set(map(str, found.values()))) == 1:
                shown.append(f"{preset} {next(iter(found.values()))}")
            else:
                shown += [f"{name} {value}" for name, value in found.items()]
        texts[spec.name] = f"from the preset: {', '.join(shown)}; a --config file without it: {spec.default}"
    return texts


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML (.yaml/.yml) or JSON (.json) run config: PretrainingArguments keys plus `model:`. Top-level keys that
    start with "_" are comments (JSON has no other kind) and are dropped."""
    return base.load_config_file(path, error=PretrainingError)


def load_preset(
    family: str, preset: str, configs_dir: str | Path | None = None, chain: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The values of {family}-{preset}.yaml over those of the preset it `extends` (if any), `model:` merged field by
    field: a preset that is another at a larger size, or under a second name, says only what differs."""
    if preset in chain:
        raise PretrainingError(f"Presets of {family} extend each other in a circle: {' -> '.join((*chain, preset))}.")
    return extended(load_config_file(preset_path(family, preset, configs_dir)), family, configs_dir, (*chain, preset))


def extended(
    values: dict[str, Any], family: str, configs_dir: str | Path | None = None, chain: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`values` (a preset's or a --config file's) over the preset their `extends` key names, if any."""
    name = values.pop("extends", None)
    if name is None:
        return values
    beneath = load_preset(family, name, configs_dir, chain)
    return {**beneath, **values, "model": {**(beneath.get("model") or {}), **(values.get("model") or {})}}


def gather_settings(
    *,
    family: str | None = None,
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    configs_dir: str | Path | None = None,
) -> tuple[dict[str, Any], str]:
    """(the raw values of a run's settings, where they came from): the preset (`--preset`, default "tiny") or
    `--config` file, then `overrides` (the flags given on the command line); the dataclass defaults fill the rest when
    `PretrainingArguments.resolve` types and checks them. A `model:` mapping in `overrides` updates the file's field by
    field.
    """
    if preset is not None and config_file is not None:
        raise PretrainingError("Pass either --preset or --config, not both.")
    if config_file is not None:
        values = load_config_file(config_file)
        source = Path(config_file).name
        if family is not None and values.get("family", family) != family:
            raise PretrainingError(
                f"Config file {source} is for the {values['family']} family, but --family is {family}."
            )
        if "extends" in values and (family or values.get("family")) is None:
            raise PretrainingError(f"Config file {source} extends a preset but names no family; add `family:`.")
        values = extended(values, family or values.get("family"), configs_dir)
    else:
        if family is None:
            raise PretrainingError("Pass --family (encoder, decoder or seq2seq), or a --config file that names it.")
        preset = preset or "tiny"
        values = load_preset(family, preset, configs_dir)
        source = preset
        if values.get("family", family) != family:
            raise PretrainingError(f"Preset {preset} of {family} names family {values['family']!r}.")
    if family is not None:
        values["family"] = family
    overrides = dict(overrides or {})
    model = {**(values.get("model") or {}), **(overrides.pop("model", None) or {})}
    values.update(overrides)
    values["model"] = model
    values.setdefault("preset", source)
    return values, source
