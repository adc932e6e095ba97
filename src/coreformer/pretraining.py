"""Pretraining on Accelerate: one loop for the three objectives, atomic checkpoints, exact resume.

    PretrainingArguments             every run setting (a CLI flag per field), validated in __post_init__
    resolve_arguments(...)           dataclass defaults < preset or config file < explicit overrides
    run_pretraining(args) -> dict    tokenizer, data, model, Accelerate loop, checkpoints, final folder; the metrics
    find_latest_checkpoint(dir)      newest complete `checkpoints/step-N` (temporary folders never count)
    GlobalBatches                    global batch number -> collated batch: the data order of every run
    render_model_card(...)           the final folder's README.md (model_card_info -> coreformer.model_card)

Objectives, one per family (collators in pretraining_data.py):

    encoder  masked LM        tokenize_dataset(max_length=block)  -> MaskedLMCollator (15%, 80/10/10)
    decoder  next token       tokenize_dataset -> pack_into_blocks -> PackedCausalLMCollator (no padding)
    seq2seq  BART denoising   tokenize_dataset(max_length=block)  -> DenoisingCollator (infilling + permutation)

An output directory, as a run leaves it:

    output_dir/
      run_config.json                    the resolved arguments (written when the run starts)
      tokenizer.json, tokenizer_config.json
      checkpoints/step-N/                accelerator.save_state + trainer_state.json + tokenizer/
      logs/pretrain/                     TensorBoard events (when tensorboard is installed)
      config.json, model.safetensors, generation_config.json, modeling code,
      README.md, metrics.json, loss.png  the final model, written at the end

Why runs are exact. Every example a run sees is fixed by its global batch number g: batch g holds the examples at
positions [g * batch_size, (g + 1) * batch_size) of an endless stream of seeded per-epoch permutations, and its
masking and dropout draw from seeds derived from (seed, g). On rank r of W, micro-batch j is global batch
g = consumed + j * W + r, which is exactly how a single process with `grad_accum * W` micro-batches per step would
number them. So a 2-process run and a 1-process run with `--grad-accum 2` put the same examples, masks and dropout
into each optimizer step, and a resumed run restarts at the first unconsumed g (no batches to skip over). Each
micro-batch loss is a sum over label tokens divided by the label tokens of the whole optimizer step (all
micro-batches, all ranks: transformers' `num_items_in_batch`), so gradient accumulation and data parallelism compute
the same token-weighted mean.

Checkpoints are written into `checkpoints/.tmp-step-N` and renamed to `step-N` once complete (a rename is atomic on
POSIX), so a crash during a save leaves the previous checkpoint as the latest. The final model goes through a
temporary folder too; its files are moved into `output_dir` with config.json, the file every loader reads first,
moved last (and an older one removed first), so a folder that has a config.json holds a complete model.
"""

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from . import run_arguments
from .configuration_coreformer import CoreformerDecoderConfig, CoreformerEncoderConfig, CoreformerSeq2SeqConfig
from .folders import (
    MissingTokenizerError,
    folder_tokenizer,
    link_into,
    remove_stale_saves,
    replace_folder,
    staged_folder,
)
from .model_card import ModelCardInfo, is_hub_id
from .model_card import render_model_card as render_card
from .modeling_decoder import CoreformerDecoderForCausalLM
from .modeling_encoder import CoreformerEncoderForMaskedLM
from .modeling_seq2seq import CoreformerSeq2SeqForConditionalGeneration
from .pretraining_data import (
    DenoisingCollator,
    MaskedLMCollator,
    PackedCausalLMCollator,
    iter_texts,
    load_text_dataset,
    pack_into_blocks,
    tokenize_dataset,
)
from .run_arguments import arg
from .tokenizer_training import token_config_kwargs, train_tokenizer

FAMILIES = ("encoder", "decoder", "seq2seq")
PRESETS = ("tiny", "small", "base")
MIXED_PRECISION = ("no", "bf16", "fp16")
REPORT_TO = ("auto", "tensorboard", "none")

CHECKPOINTS_DIR = "checkpoints"
TRAINER_STATE = "trainer_state.json"  # written last into a checkpoint: its presence marks the folder complete
RUN_CONFIG = "run_config.json"
METRICS = "metrics.json"
_CHECKPOINT_NAME = re.compile(r"step-(\d+)")
# What a run leaves in its output directory: a folder holding any of these is a previous run (--overwrite replaces it).
_RUN_MARKERS = (RUN_CONFIG, CHECKPOINTS_DIR, "config.json", "model.safetensors", "tokenizer.json", METRICS)

_FAMILY = {
    "encoder": {
        "config": CoreformerEncoderConfig,
        "model": CoreformerEncoderForMaskedLM,
        "auto_class": "AutoModelForMaskedLM",
        "objective": "masked language modelling (BERT: 15% of tokens selected, 80% [MASK] / 10% random / 10% kept)",
        "pipeline_tag": "fill-mask",
        "description": "BERT-style encoder",
    },
    "decoder": {
        "config": CoreformerDecoderConfig,
        "model": CoreformerDecoderForCausalLM,
        "auto_class": "AutoModelForCausalLM",
        "objective": "next-token prediction on packed blocks (documents joined by </s>, no padding)",
        "pipeline_tag": "text-generation",
        "description": "GPT-style decoder",
    },
    "seq2seq": {
        "config": CoreformerSeq2SeqConfig,
        "model": CoreformerSeq2SeqForConditionalGeneration,
        "auto_class": "AutoModelForSeq2SeqLM",
        "objective": "BART denoising (text infilling with Poisson(3) spans, 30% of tokens; sentence permutation)",
        "pipeline_tag": "text2text-generation",
        "description": "BART-style encoder-decoder",
    },
}


class PretrainingError(ValueError):
    """One clear message about a bad input; raised before anything in the output directory is touched."""


# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class PretrainingArguments:
    """Every setting of a pretraining run. The CLI exposes each field as `--field-name` (see training/pretrain.py);
    a preset or config file (training/configs/*.yaml) holds the same keys plus `model:`, the family config's fields.
    """

    family: str = arg(  # no default in --help: a --config file may name the family
        "decoder",
        "model family and objective: encoder (MLM), decoder (causal LM), seq2seq (BART)",
        choices=FAMILIES,
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
    # optimisation
    max_steps: int = arg(1000, "optimizer steps")
    batch_size: int = arg(16, "examples per micro-batch on each process")
    grad_accum: int = arg(1, "micro-batches accumulated per optimizer step")
    lr: float = arg(1e-3, "peak learning rate (AdamW)")
    warmup_steps: int = arg(100, "linear warmup steps before the cosine decay to 0 at --max-steps")
    weight_decay: float = arg(0.1, "AdamW weight decay on matrices (biases, norms: none)")
    adam_beta1: float = arg(0.9, "AdamW beta1")
    adam_beta2: float = arg(0.95, "AdamW beta2")
    adam_epsilon: float = arg(1e-8, "AdamW epsilon")
    max_grad_norm: float = arg(1.0, "gradient clipping norm (0 disables)")
    mixed_precision: str = arg("no", "autocast precision", choices=MIXED_PRECISION)
    gradient_checkpointing: bool = arg(False, "recompute activations in backward to save memory")
    attn_implementation: str | None = arg(None, "attention backend (sdpa, eager, flex_attention, ...); default sdpa")
    seed: int = arg(0, "seed of the data order, masking, dropout and initialisation")
    # objectives
    mlm_probability: float = arg(0.15, "encoder: share of tokens selected for masking")
    mask_ratio: float = arg(0.3, "seq2seq: share of tokens hidden by text infilling")
    poisson_lambda: float = arg(3.0, "seq2seq: mean infilled span length")
    # run
    output_dir: str = arg("outputs/pretrain", "run folder: checkpoints, logs, and the final model")
    overwrite: bool = arg(False, "replace an output directory that holds another run")
    save_every: int = arg(500, "save a checkpoint every N steps (0: none)")
    keep_last: int = arg(2, "keep the last K checkpoints")
    eval_every: int = arg(200, "held-out evaluation every N steps (also before the first step and at the end)")
    eval_batches: int = arg(20, "batches in the held-out evaluation")
    resume_from_checkpoint: str | None = arg(
        None,
        "'latest' (newest checkpoint in --output-dir; starts fresh when the folder is empty) or a checkpoint folder",
    )
    report_to: str = arg("auto", "tracker: tensorboard, none, or auto (tensorboard when installed)", choices=REPORT_TO)
    num_workers: int = arg(0, "DataLoader worker processes")
    sample_prompt: str | None = arg(
        None,
        "at the end, reload the final folder with its Auto class and print a sample for this prompt (generated text; "
        "the encoder's top predictions for [MASK])",
    )

    def __post_init__(self) -> None:
        choices = {"family": FAMILIES, "mixed_precision": MIXED_PRECISION, "report_to": REPORT_TO}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise PretrainingError(f"`{name}` must be one of {', '.join(allowed)}; got {getattr(self, name)!r}.")
        positive = ("vocab_size", "pad_vocab_to_multiple_of", "block_size", "max_steps", "batch_size", "grad_accum")
        positive += ("keep_last", "eval_batches")
        for name in positive:
            if getattr(self, name) < 1:
                raise PretrainingError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        for name in ("save_every", "eval_every", "warmup_steps", "num_workers"):
            if getattr(self, name) < 0:
                raise PretrainingError(f"`{name}` must be >= 0 (0 turns it off), got {getattr(self, name)}.")
        if self.max_documents is not None and self.max_documents < 2:
            raise PretrainingError(f"`max_documents` must be >= 2 (train + held out), got {self.max_documents}.")
        if self.lr <= 0:
            raise PretrainingError(f"`lr` must be > 0, got {self.lr}.")
        for name in ("mlm_probability", "mask_ratio", "validation_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise PretrainingError(f"`{name}` must be in [0, 1), got {getattr(self, name)}.")
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
                f"See {_FAMILY[self.family]['config'].__name__} for the fields."
            )

    @property
    def global_batch_size(self) -> int:
        """Examples per optimizer step on one process (times the number of processes for the whole run)."""
        return self.batch_size * self.grad_accum


def _config_fields(family: str) -> set[str]:
    return {f.name for f in dataclasses.fields(_FAMILY[family]["config"])}


def argument_fields() -> list[dataclasses.Field]:
    """The fields the CLI exposes as flags, in declaration order."""
    return [f for f in dataclasses.fields(PretrainingArguments) if f.metadata.get("cli", True)]


def default_configs_dir() -> Path:
    """training/configs of the source checkout this module was installed from (editable install)."""
    return Path(__file__).resolve().parents[2] / "training" / "configs"


def preset_path(family: str, preset: str, configs_dir: str | Path | None = None) -> Path:
    """training/configs/{family}-{preset}.yaml."""
    if family not in FAMILIES:
        raise PretrainingError(f"Unknown family {family!r}: expected one of {', '.join(FAMILIES)}.")
    if preset not in PRESETS:
        raise PretrainingError(f"Unknown preset {preset!r}: expected one of {', '.join(PRESETS)}.")
    path = Path(configs_dir or default_configs_dir()) / f"{family}-{preset}.yaml"
    if not path.is_file():
        raise PretrainingError(f"Preset file {path} is missing; pass --config FILE instead.")
    return path


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML (.yaml/.yml) or JSON (.json) run config: PretrainingArguments keys plus `model:`. Top-level keys that
    start with "_" are comments (JSON has no other kind) and are dropped."""
    return run_arguments.load_config_file(path, error=PretrainingError)


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
    if preset is not None and config_file is not None:
        raise PretrainingError("Pass either --preset or --config, not both.")
    if config_file is not None:
        values = load_config_file(config_file)
        source = Path(config_file).name
        if family is not None and values.get("family", family) != family:
            raise PretrainingError(
                f"Config file {source} is for the {values['family']} family, but --family is {family}."
            )
    else:
        if family is None:
            raise PretrainingError("Pass --family (encoder, decoder or seq2seq), or a --config file that names it.")
        preset = preset or "tiny"
        values = load_config_file(preset_path(family, preset, configs_dir))
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

    hints = typing.get_type_hints(PretrainingArguments)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise PretrainingError(
            f"Unknown setting(s) {', '.join(unknown)} in {source}; known: {', '.join(sorted(hints))}."
        )
    typed = {
        name: run_arguments.coerce(name, value, hints[name], error=PretrainingError) for name, value in values.items()
    }
    return PretrainingArguments(**typed)


# ---------------------------------------------------------------------------------------------------------------------
# Data order: global batch numbers
# ---------------------------------------------------------------------------------------------------------------------


def derive_seed(seed: int, stream: str, index: int) -> int:
    """A seed for item `index` of `stream` ("shuffle", "train", "eval", "dropout"), the same on every machine."""
    digest = hashlib.blake2b(f"{seed}/{stream}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _reseeded(collator: Any, seed: int) -> Any:
    """A copy of a seeded collator (MLM, denoising) whose generator starts from `seed`; others as they are."""
    if dataclasses.is_dataclass(collator) and hasattr(collator, "seed"):
        return dataclasses.replace(collator, seed=seed)
    return collator


class GlobalBatches(torch.utils.data.Dataset):
    """Global batch number g -> (g, collated batch): the examples at stream positions [g*B, (g+1)*B).

    The stream is an endless concatenation of per-epoch permutations of `dataset` (epoch e is shuffled with
    `derive_seed(seed, "shuffle", e)`; `shuffle=False` keeps the order), so a batch may span two epochs. The collator
    is reseeded per batch with `derive_seed(seed, stream, g)`: what batch g looks like does not depend on which
    process builds it, in which order, or after how many others.
    """

    def __init__(
        self, dataset: datasets.Dataset, collator: Any, batch_size: int, *, seed: int, stream: str, shuffle: bool
    ):
        self.dataset, self.collator, self.batch_size = dataset, collator, batch_size
        self.seed, self.stream, self.shuffle = seed, stream, shuffle
        self._permutations: dict[int, list[int]] = {}

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if not self.shuffle:
            return offset
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "shuffle", epoch))
            self._permutations = {epoch: torch.randperm(len(self.dataset), generator=generator).tolist()}
        return self._permutations[epoch][offset]

    def __getitem__(self, g: int) -> tuple[int, dict[str, torch.Tensor]]:
        start = g * self.batch_size
        rows = self.dataset[[self._index(position) for position in range(start, start + self.batch_size)]]
        examples = [dict(zip(rows, values)) for values in zip(*rows.values())]
        return g, _reseeded(self.collator, derive_seed(self.seed, self.stream, g))(examples)


class _Strided(torch.utils.data.Sampler):
    """start, start + step, start + 2 * step, ... without end (the loop decides when to stop)."""

    def __init__(self, start: int, step: int):
        self.start, self.step = start, step

    def __iter__(self) -> Iterator[int]:
        index = self.start
        while True:
            yield index
            index += self.step


def _identity(item: Any) -> Any:
    return item  # DataLoader(batch_size=None) would run default_convert; batches are already tensors


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer, data, model
# ---------------------------------------------------------------------------------------------------------------------

_REQUIRED_TOKENS = {
    "encoder": ("pad_token", "mask_token", "cls_token", "sep_token"),
    "decoder": ("eos_token",),
    "seq2seq": ("pad_token", "mask_token", "bos_token", "eos_token"),
}


def load_tokenizer(name_or_path: str, family: str) -> PreTrainedTokenizerBase:
    """A tokenizer folder or Hub name, checked for the special tokens the family's objective needs."""
    try:
        tokenizer = folder_tokenizer(name_or_path)
    except MissingTokenizerError as error:
        raise PretrainingError(f"--tokenizer: {error} Or omit --tokenizer to train one.") from None
    except Exception as error:  # OSError for an unknown Hub name, ValueError for broken files
        raise PretrainingError(f"Cannot load tokenizer {name_or_path!r}: {error}") from error
    missing = [name for name in _REQUIRED_TOKENS[family] if getattr(tokenizer, name) is None]
    if missing:
        raise PretrainingError(
            f"Tokenizer {name_or_path!r} has no {', '.join(missing)}, which the {family} objective needs; "
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


def build_examples(
    split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, args: PretrainingArguments
) -> datasets.Dataset:
    """Text -> the family's examples: packed blocks (decoder) or windows of at most `block_size` ids."""
    if args.family == "decoder":
        tokenized = tokenize_dataset(split, tokenizer, add_special_tokens=False)
        return pack_into_blocks(tokenized, args.block_size, eos_token_id=tokenizer.eos_token_id)
    return tokenize_dataset(split, tokenizer, max_length=args.block_size)


def build_collator(tokenizer: PreTrainedTokenizerBase, args: PretrainingArguments) -> Any:
    if args.family == "encoder":
        return MaskedLMCollator.from_tokenizer(tokenizer, mlm_probability=args.mlm_probability, seed=args.seed)
    if args.family == "decoder":
        return PackedCausalLMCollator(eos_token_id=tokenizer.eos_token_id)
    return DenoisingCollator.from_tokenizer(
        tokenizer, mask_ratio=args.mask_ratio, poisson_lambda=args.poisson_lambda, seed=args.seed
    )


def build_model_config(args: PretrainingArguments, tokenizer: PreTrainedTokenizerBase):
    """The family config: token ids from the tokenizer, vocab padded to `pad_vocab_to_multiple_of`, then `model`."""
    fields = token_config_kwargs(tokenizer, args.family)
    multiple = args.pad_vocab_to_multiple_of
    fields["vocab_size"] = math.ceil(len(tokenizer) / multiple) * multiple
    fields.update(args.model)
    try:
        config = _FAMILY[args.family]["config"](**fields)
    except ValueError as error:
        raise PretrainingError(f"Bad model config: {error}") from error
    if config.position_embedding_type in ("learned", "sinusoidal"):
        longest = args.block_size + config.position_offset
        if longest > config.max_position_embeddings:
            raise PretrainingError(
                f"--block-size {args.block_size} needs max_position_embeddings >= {longest} with "
                f"{config.position_embedding_type} positions; the model has {config.max_position_embeddings}. "
                f"Lower --block-size or raise model.max_position_embeddings."
            )
    return config


def label_count(batch: dict[str, torch.Tensor], family: str) -> int:
    """Tokens that carry a loss: the causal LM shifts labels inside its loss, so its first label never counts."""
    labels = batch["labels"][:, 1:] if family == "decoder" else batch["labels"]
    return int((labels != -100).sum())


def input_token_count(batch: dict[str, torch.Tensor]) -> int:
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints and the output directory
# ---------------------------------------------------------------------------------------------------------------------


def _checkpoint_step(path: Path) -> int | None:
    match = _CHECKPOINT_NAME.fullmatch(path.name)
    if match is None or not path.is_dir() or not (path / TRAINER_STATE).is_file():
        return None
    return int(match.group(1))


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first; `.tmp-*` folders of interrupted saves are ignored."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(step, path) for path in root.iterdir() if (step := _checkpoint_step(path)) is not None]
    return [path for _, path in sorted(found)]


def find_latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def read_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    path = Path(checkpoint) / TRAINER_STATE
    if not path.is_file():
        raise PretrainingError(f"{str(checkpoint)!r} is not a complete checkpoint folder (no {TRAINER_STATE}).")
    return json.loads(path.read_text())


def check_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse a folder that holds something, unless it is a previous run and `overwrite` is set."""
    run_arguments.check_output_dir(
        output_dir,
        overwrite,
        markers=_RUN_MARKERS,
        error=PretrainingError,
        otherwise="--resume-from-checkpoint latest to continue it",
    )


def resolve_resume(args: PretrainingArguments, output_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None to start fresh; refuses a checkpoint of another family or model."""
    if args.resume_from_checkpoint is None:
        check_output_dir(output_dir, args.overwrite)
        return None
    if args.resume_from_checkpoint == "latest":
        checkpoint = find_latest_checkpoint(output_dir)
        if checkpoint is None:
            if output_dir.is_dir() and run_arguments.holds_run(output_dir, _RUN_MARKERS):
                raise PretrainingError(
                    f"--resume-from-checkpoint latest: {str(output_dir)!r} holds a run but no complete checkpoint "
                    f"under {CHECKPOINTS_DIR}/. Pass --overwrite without --resume-from-checkpoint to start over."
                )
            check_output_dir(output_dir, args.overwrite)
            return None  # nothing to resume yet: the same command starts the run and restarts it after a crash
    else:
        checkpoint = Path(args.resume_from_checkpoint)
        if not checkpoint.is_dir():
            raise PretrainingError(f"--resume-from-checkpoint {str(checkpoint)!r} does not exist.")
        if output_dir.resolve() not in checkpoint.resolve().parents:
            check_output_dir(output_dir, args.overwrite)  # continuing another run's checkpoint in a new folder
    state = read_trainer_state(checkpoint)
    if state.get("family") != args.family:
        raise PretrainingError(
            f"Checkpoint {str(checkpoint)!r} belongs to a run of the {state.get('family')} family; this run trains the "
            f"{args.family} family. Pass --family {state.get('family')} with the same preset, or start a new "
            f"--output-dir."
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
            f"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {launched} training/pretrain.py ..."
        )


def _remove_stale_temporaries(output_dir: Path) -> None:
    """Leftovers of saves that a crash interrupted: checkpoints being written (never complete, never read), and a
    checkpoint caught between replace_folder's fallback renames (put back)."""
    for folder in (output_dir / CHECKPOINTS_DIR, output_dir):
        if folder.is_dir():
            for path in folder.iterdir():
                if path.name.startswith((".tmp-", ".old-", ".final-tmp")):  # .old-, .final-tmp: before 0.1
                    shutil.rmtree(path, ignore_errors=True)
    remove_stale_saves(output_dir / CHECKPOINTS_DIR)


def save_checkpoint(
    accelerator, output_dir: Path, step: int, trainer_state: dict, tokenizer: PreTrainedTokenizerBase, keep_last: int
) -> Path:
    """accelerator.save_state into checkpoints/.tmp-step-N, then rename to step-N; prune to the last `keep_last`.

    Every process writes into the temporary folder (its RNG state; shards under FSDP / DeepSpeed), so its name is
    the same on every rank. trainer_state.json goes in last, the rename makes the folder visible at once.
    """
    root = output_dir / CHECKPOINTS_DIR
    staging, final = root / f".tmp-step-{step}", root / f"step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tokenizer.save_pretrained(staging / "tokenizer")
        run_arguments.write_json(staging / TRAINER_STATE, trainer_state)
        replace_folder(staging, final)  # final exists when re-saving a step after resuming from an older checkpoint
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


# ---------------------------------------------------------------------------------------------------------------------
# Metrics, plot, model card
# ---------------------------------------------------------------------------------------------------------------------

# Dense bf16/fp16 tensor-core peaks (FLOP/s) for the MFU estimate, by a substring of the CUDA device name.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def flops_per_token(config, num_parameters: int, block_size: int) -> float:
    """Training FLOPs per token, forward + backward: 6 N for the weight matmuls (the tied embedding counts once, as
    the LM head) plus 12 L d T for attention scores and values (PaLM, Chowdhery et al. 2022, appendix B; nanoGPT's
    estimate_mfu). Exact for the decoder; for the seq2seq model each token passes one stack, so it overestimates."""
    layers = sum(config.layer_counts().values())
    return 6 * num_parameters + 12 * layers * config.hidden_size * block_size


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


_USAGE = {
    "encoder": 'inputs = tokenizer("import [MASK]", return_tensors="pt")\nlogits = model(**inputs).logits',
    "decoder": 'inputs = tokenizer("def ", return_tensors="pt")\n'
    "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0]))",
    "seq2seq": 'inputs = tokenizer("def <mask>(self):", return_tensors="pt")\n'
    "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0]))",
}


def model_card_info(args: PretrainingArguments, metrics: dict[str, Any]) -> ModelCardInfo:
    """What the final folder's card says (model_cards/pretrained.md): the run's settings and its held-out numbers,
    which also go into the card's model-index (loss and perplexity on the held-out split)."""
    family = _FAMILY[args.family]
    hub_dataset = args.dataset if args.dataset and is_hub_id(args.dataset) else None
    if args.dataset is None:
        dataset_description = "the Python standard library's own source files (coreformer's embedded corpus)"
    else:
        dataset_description = f"`{args.dataset}`" + (f" ({args.dataset_config})" if args.dataset_config else "")
    tokens_per_second = f"{metrics['tokens_per_second']:,.0f}" if metrics["tokens_per_second"] else "n/a"
    summary = (
        f"A {family['description']} with {metrics['num_parameters']:,} parameters, pretrained from scratch with "
        f"coreformer's `training/pretrain.py` on {dataset_description}. After {metrics['steps']} steps "
        f"({metrics['tokens_seen']:,} training tokens, {tokens_per_second} tokens/s on {metrics['device']}) the "
        f"held-out loss is {metrics['final_eval_loss']:.4f} nats/token (perplexity "
        f"{metrics['final_eval_perplexity']:.2f}) on {metrics['final_eval_tokens']:,} held-out label tokens. The "
        f"architecture is coreformer's ({family['config'].__name__})."
    )
    hyperparameters = [
        ("preset / config", args.preset),
        ("objective", family["objective"]),
        ("steps", metrics["steps"]),
        ("processes x micro-batch x accumulation", f"{metrics['world_size']} x {args.batch_size} x {args.grad_accum}"),
        ("block size", args.block_size),
        ("optimizer", f"AdamW (betas {args.adam_beta1}, {args.adam_beta2}; weight decay {args.weight_decay})"),
        ("learning rate", f"{args.lr:g}, {args.warmup_steps} warmup steps, cosine decay to 0"),
        ("gradient clipping", args.max_grad_norm),
        ("mixed precision", args.mixed_precision),
        ("vocabulary", f"{metrics['vocab_size']} ({metrics['tokenizer']})"),
        ("seed", args.seed),
    ]
    return ModelCardInfo(
        kind="pretrained",
        title=f"coreformer {args.family} ({args.preset})",
        family=args.family,
        auto_class=family["auto_class"],
        summary=summary,
        num_parameters=metrics["num_parameters"],
        datasets=[hub_dataset] if hub_dataset else [],
        dataset_description=dataset_description,
        pipeline_tag=family["pipeline_tag"],
        task_type=family["pipeline_tag"],
        task_name=family["objective"].split(" (")[0],
        eval_results={"loss": metrics["final_eval_loss"], "perplexity": metrics["final_eval_perplexity"]},
        eval_dataset=hub_dataset or f"{args.dataset or 'coreformer embedded corpus'} (held-out split)",
        hyperparameters=hyperparameters,
        usage=_USAGE[args.family],
        tags=["pretraining"],
    )


def render_model_card(args: PretrainingArguments, metrics: dict[str, Any], path_hint: str) -> str:
    """README.md of the final folder: metadata (license, library, tags, datasets, model-index) + how to load + the
    numbers, from coreformer.model_card's "pretrained" template."""
    return str(render_card(model_card_info(args, metrics), path_hint))


@torch.no_grad()
def sample_from_folder(folder: str | Path, family: str, prompt: str, *, seed: int = 0, max_new_tokens: int = 64) -> str:
    """Load `folder` the way a user would (Auto class + AutoTokenizer) and show what the model does with `prompt`:
    the prompt continued (decoder) or "prompt -> output" (seq2seq), sampled with top-k 40 and temperature 0.8; for
    the encoder, "prompt -> the five likeliest tokens at [MASK]" (a [MASK] is appended when the prompt has none)."""
    import transformers

    model = getattr(transformers, _FAMILY[family]["auto_class"]).from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if family == "encoder":
        text = prompt if tokenizer.mask_token in prompt else f"{prompt}{tokenizer.mask_token}"
        inputs = tokenizer(text, return_tensors="pt")
        position = (inputs["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0, 0]
        top = model(**inputs).logits[0, position].topk(5).indices
        return f"{text} -> {tokenizer.convert_ids_to_tokens(top.tolist())}"
    inputs = tokenizer(prompt, return_tensors="pt")
    used = inputs["input_ids"].shape[1] if family == "decoder" else 1  # positions taken before the first new token
    max_new_tokens = max(1, min(max_new_tokens, model.config.max_position_embeddings - used))
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8)
    torch.random.set_rng_state(generator_state)
    text = tokenizer.decode(generated[0], skip_special_tokens=True)
    return text if family == "decoder" else f"{prompt} -> {text}"  # seq2seq: the prompt denoised


# ---------------------------------------------------------------------------------------------------------------------
# The run
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
def evaluate(accelerator, model, batches: list[dict[str, torch.Tensor]], family: str) -> dict[str, float]:
    """Token-weighted held-out loss over `batches`, split across processes; every process runs the same number of
    forwards (FSDP needs every rank in every forward), padding its share with zero-weight repeats."""
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # (loss sum, label tokens)
    for round_ in range(math.ceil(len(batches) / world)):
        index = round_ * world + rank
        batch = batches[index % len(batches)]
        outputs = model(**_to_device(batch, accelerator.device), num_items_in_batch=1)  # loss = sum over tokens
        if index < len(batches):
            totals += torch.stack([outputs.loss.double(), totals.new_tensor(label_count(batch, family))])
    totals = accelerator.reduce(totals, "sum")
    model.train()
    loss = (totals[0] / totals[1]).item()
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf, "tokens": int(totals[1])}


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def run_pretraining(args: PretrainingArguments) -> dict[str, Any]:
    """Train `args.family` on `args.dataset` and write the run folder described in the module docstring.

    Every check of the inputs (output folder, resume checkpoint, dataset, tokenizer, blocks) runs on every process
    before the first write, so a bad input raises `PretrainingError` with nothing written or overwritten.

    Returns:
        The metrics also written to metrics.json.
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from tqdm.auto import tqdm

    session_start = time.perf_counter()
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
    )
    world, rank = accelerator.num_processes, accelerator.process_index
    check_world_size(world)
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None:  # DeepSpeed reads these from its own config, not from the loop
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = args.batch_size
        deepspeed.deepspeed_config["gradient_accumulation_steps"] = args.grad_accum
        deepspeed.deepspeed_config["gradient_clipping"] = args.max_grad_norm

    # ---- checks, before anything is written ----
    resume = resolve_resume(args, output_dir)
    state = read_trainer_state(resume) if resume is not None else None
    splits = load_dataset_splits(args)
    if resume is not None:
        tokenizer = load_tokenizer(str(resume / "tokenizer"), args.family)
        tokenizer_name = state["tokenizer"]
    elif args.tokenizer is not None:
        tokenizer, tokenizer_name = load_tokenizer(args.tokenizer, args.family), args.tokenizer
    else:
        tokenizer = shared_tokenizer(
            accelerator, lambda: train_tokenizer(args.family, iter_texts(splits["train"]), args.vocab_size)
        )
        tokenizer_name = (
            f"{'WordPiece' if args.family == 'encoder' else 'byte-level BPE'} trained on the training split"
        )
    config = build_model_config(args, tokenizer)
    with accelerator.main_process_first():  # a dataset on disk: the main process writes the map caches, others read
        train_examples = build_examples(splits["train"], tokenizer, args)
        eval_examples = build_examples(splits["validation"], tokenizer, args)
    for name, examples in (("training", train_examples), ("held-out", eval_examples)):
        if len(examples) == 0:
            raise PretrainingError(
                f"The {name} split gives no example of --block-size {args.block_size} tokens; use more text or a "
                f"smaller --block-size."
            )
    # So that `tokenizer(text, truncation=True)` on the saved tokenizer stops where the model's positions do (set
    # after tokenizing: documents longer than this are meant to be windowed or packed, not warned about).
    tokenizer.model_max_length = min(tokenizer.model_max_length, config.max_position_embeddings)

    # ---- the run folder ----
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if resume is None and output_dir.is_dir() and any(output_dir.iterdir()):
            shutil.rmtree(output_dir)  # --overwrite of a previous run, checked above
        output_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(output_dir)
        if resume is None:
            tokenizer.save_pretrained(output_dir)
        run_arguments.write_json(output_dir / RUN_CONFIG, dataclasses.asdict(args))
    accelerator.wait_for_everyone()
    accelerator.print(f"{args.family} pretraining on {world} process(es), {accelerator.device}; {tracker_line}")
    if args.warmup_steps >= args.max_steps:
        accelerator.print(f"note: --warmup-steps {args.warmup_steps} >= --max-steps: the learning rate only warms up")

    # ---- model, optimizer, schedule ----
    set_seed(args.seed)
    model = _FAMILY[args.family]["model"](config)
    if args.attn_implementation is not None:
        model.set_attn_implementation(args.attn_implementation)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]  # matrices and embeddings; not biases or norm gains
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=accelerator.device.type in ("cuda", "cpu"),  # one kernel for every tensor: ~5x foreach on CPU
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    step, consumed, tokens_seen = 0, 0, 0
    history: dict[str, list[dict]] = {"train": [], "eval": []}
    if resume is not None:
        accelerator.load_state(str(resume))  # model, optimizer, scheduler, scaler, every process's RNG
        step, consumed, tokens_seen, history = (state[key] for key in ("step", "consumed", "tokens_seen", "history"))
        micro_batches_per_step = state["world_size"] * state["args"]["grad_accum"]
        if state["args"]["dataset"] != args.dataset or micro_batches_per_step != world * args.grad_accum:
            accelerator.print(
                "note: the dataset or the number of micro-batches per step differs from the checkpoint's run; the data "
                "position is kept in global batches, so the order of examples continues but the runs are not exact."
            )
        accelerator.print(f"resumed from {resume} at step {step}")

    accelerator.init_trackers("pretrain", config=_hparams(args))

    collator = build_collator(tokenizer, args)
    train_batches = GlobalBatches(
        train_examples, collator, args.batch_size, seed=args.seed, stream="train", shuffle=True
    )
    loader = torch.utils.data.DataLoader(
        train_batches,
        batch_size=None,
        sampler=_Strided(consumed + rank, world),  # global batch g = consumed + j * world + rank
        num_workers=args.num_workers,
        collate_fn=_identity,
        pin_memory=accelerator.device.type == "cuda",
    )
    eval_pool = eval_examples.shuffle(seed=args.seed) if len(eval_examples) > 1 else eval_examples
    eval_source = GlobalBatches(eval_pool, collator, args.batch_size, seed=args.seed, stream="eval", shuffle=False)
    eval_count = max(1, min(args.eval_batches, len(eval_pool) // args.batch_size))
    eval_batches = [eval_source[i][1] for i in range(eval_count)]

    def run_eval() -> dict[str, float]:
        result = {"step": step, **evaluate(accelerator, model, eval_batches, args.family)}
        history["eval"].append(result)
        accelerator.log({"eval/loss": result["loss"], "eval/perplexity": result["perplexity"]}, step=step)
        return result

    if not history["eval"]:  # the loss before training, always: every run reports where it started
        run_eval()

    progress = tqdm(
        total=args.max_steps,
        initial=step,
        desc=f"{args.family} pretraining",
        unit="step",
        disable=not accelerator.is_main_process,
        dynamic_ncols=True,
    )
    data = iter(loader)
    train_time, session_tokens = 0.0, 0
    model.train()
    while step < args.max_steps:
        step_start = time.perf_counter()
        micro_batches = [next(data) for _ in range(args.grad_accum)]
        counts = torch.tensor(
            [
                sum(label_count(batch, args.family) for _, batch in micro_batches),
                sum(input_token_count(batch) for _, batch in micro_batches),
            ],
            device=accelerator.device,
        )
        counts = accelerator.reduce(counts, "sum")  # label tokens and input tokens of the whole optimizer step
        step_loss = torch.zeros((), device=accelerator.device)
        lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
        for g, batch in micro_batches:
            torch.manual_seed(derive_seed(args.seed, "dropout", g))  # dropout follows the batch, not the rank
            with accelerator.accumulate(model):
                loss = model(**_to_device(batch, accelerator.device), num_items_in_batch=counts[0]).loss
                # loss is this micro-batch's share of the step's token mean. Accelerate divides by grad_accum and
                # DDP averages over processes: undo both, so the summed gradients are those of the step's mean.
                accelerator.backward(loss * (world * args.grad_accum))
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach()
        step += 1
        consumed += args.grad_accum * world
        loss_value = accelerator.reduce(step_loss, "sum").item()
        step_tokens = int(counts[1])
        tokens_seen += step_tokens
        session_tokens += step_tokens
        train_time += time.perf_counter() - step_start
        history["train"].append({"step": step, "loss": loss_value, "lr": lr, "tokens": step_tokens})
        tokens_per_second = session_tokens / max(train_time, 1e-9)
        accelerator.log({"train/loss": loss_value, "train/lr": lr, "train/tokens_per_second": tokens_per_second}, step)
        progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:,.0f}", refresh=False)
        progress.update(1)

        if args.eval_every and step % args.eval_every == 0:
            last_eval = run_eval()
            progress.write(
                f"step {step}: held-out loss {last_eval['loss']:.4f}, perplexity {last_eval['perplexity']:.2f}"
            )
        if args.save_every and step % args.save_every == 0:
            trainer_state = {
                "family": args.family,
                "step": step,
                "consumed": consumed,  # global batches
                "tokens_seen": tokens_seen,
                "world_size": world,
                "tokenizer": tokenizer_name,
                "history": history,
                "args": dataclasses.asdict(args),
            }
            save_checkpoint(accelerator, output_dir, step, trainer_state, tokenizer, args.keep_last)
    progress.close()

    if history["eval"][-1]["step"] != step:
        run_eval()
    last_eval = history["eval"][-1]

    # ---- metrics and the final folder ----
    device_name = torch.cuda.get_device_name(accelerator.device) if accelerator.device.type == "cuda" else "CPU"
    unwrapped = accelerator.unwrap_model(model)
    tokens_per_second = session_tokens / train_time if train_time else None
    metrics: dict[str, Any] = {
        "family": args.family,
        "preset": args.preset,
        "objective": _FAMILY[args.family]["objective"],
        "num_parameters": num_parameters,
        "vocab_size": config.vocab_size,
        "tokenizer": tokenizer_name,
        "steps": step,
        "world_size": world,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "examples_per_step": args.batch_size * args.grad_accum * world,
        "block_size": args.block_size,
        "tokens_seen": tokens_seen,
        "tokens_per_second": tokens_per_second,
        "train_time_s": train_time,
        "wall_time_s": None,
        "initial_eval_loss": history["eval"][0]["loss"],
        "final_eval_loss": last_eval["loss"],
        "final_eval_perplexity": last_eval["perplexity"],
        "final_eval_tokens": last_eval["tokens"],
        "final_train_loss": history["train"][-1]["loss"] if history["train"] else None,
        "mixed_precision": args.mixed_precision,
        "device": device_name,
        "tracker": log_with or "none",
        "resumed_from": str(resume) if resume is not None else None,
        "mfu": None,
    }
    peak = next((flops for name, flops in _PEAK_FLOPS.items() if name in device_name), None)
    if peak and tokens_per_second and args.mixed_precision != "no":
        per_token = flops_per_token(config, num_parameters, args.block_size)
        metrics["mfu"] = per_token * tokens_per_second / (peak * world)
    metrics["history"] = history

    state_dict = accelerator.get_state_dict(model)  # a collective under FSDP / DeepSpeed ZeRO-3
    if accelerator.is_main_process:
        # The folder is rebuilt beside itself and swapped in (coreformer.folders): a kill leaves the previous final
        # model or the new one, never a mix. Checkpoints and logs come along as hard links (copies only on a
        # filesystem without them).
        with staged_folder(output_dir) as staging:
            unwrapped.save_pretrained(staging, state_dict=state_dict)  # config (auto_map), weights, code, generation
            tokenizer.save_pretrained(staging)
            metrics["wall_time_s"] = time.perf_counter() - session_start
            plot_losses(history, staging / "loss.png", f"coreformer {args.family} ({args.preset})")
            (staging / "README.md").write_text(render_model_card(args, metrics, str(output_dir)))
            run_arguments.write_json(staging / METRICS, metrics)
            for entry in output_dir.iterdir():
                if not (staging / entry.name).exists():
                    link_into(entry, staging / entry.name)
        accelerator.print(
            f"done: {step} steps, held-out loss {history['eval'][0]['loss']:.4f} -> {last_eval['loss']:.4f} "
            f"(perplexity {last_eval['perplexity']:.2f}), {tokens_per_second or 0:,.0f} tokens/s; wrote {output_dir}"
        )
        if args.sample_prompt is not None:
            metrics["sample"] = sample_from_folder(output_dir, args.family, args.sample_prompt, seed=args.seed)
            run_arguments.write_json(output_dir / f".{METRICS}.tmp", metrics)
            os.replace(output_dir / f".{METRICS}.tmp", output_dir / METRICS)
            accelerator.print(f"sample ({_FAMILY[args.family]['auto_class']}.from_pretrained({str(output_dir)!r})):")
            accelerator.print(metrics["sample"])
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics
