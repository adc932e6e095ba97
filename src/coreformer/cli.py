"""The work behind the `coreformer` console command; its arguments are parsed in the torch-free `coreformer_cli`
(declared in pyproject.toml as `coreformer = "coreformer_cli:main"`), which imports this module only afterwards.

    coreformer convert SRC DST [--check] [--overwrite] [--skip-tokenizer]
    coreformer export FOLDER OUT [--to native|onnx|gguf] [--check] [--overwrite] [--gguf-dtype DTYPE]
    coreformer attention-map FOLDER "text" [--layer L] [--head H] [--stack S] -o map.png

`convert` reads a local transformers checkpoint folder (config.json + model.safetensors or pytorch_model.bin),
converts it with `convert_from_hf` and writes a coreformer folder that loads with `trust_remote_code=True` where
coreformer is not installed, with a model card (README.md, model_cards/converted.md: the source, and the `--check`
difference in its model-index when the check ran). DST is built in a temporary sibling folder and renamed into place
only when everything (and `--check`, if asked) succeeded, so a failed run leaves nothing behind.

Each subcommand is a function `(args) -> exit code` named in `coreformer_cli.COMMANDS`. Exit codes: 0 success, 1
`--check` found a difference above tolerance, 2 a usage or input error (one line on stderr, nothing written).
"""

import argparse
import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForMultipleChoice, AutoModelForSequenceClassification

import coreformer_cli

from . import attention_maps
from .families import head_of_class
from .folders import TOKENIZER_FILES, has_tokenizer, staged_folder
from .model_card import ModelCardInfo, inherited_license, is_hub_id, source_card_metadata, write_model_card
from .pipelines import save_with_pipeline

CHECK_TOLERANCE = coreformer_cli.CHECK_TOLERANCE  # coreformer.native.parity.tolerance("f32")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Checkpoint conversion should not change a single logit.",
    "Short one.",
)


class CommandError(Exception):
    """An error the user can fix; `main` prints its message and exits with code 2."""


class _CheckFailedError(Exception):
    """Unwinds the staging folder when --check finds a difference; `main` exits with code 1."""


def quiet_loading() -> None:
    """No progress bars for loading or writing weights (a command's own lines say what it did, and the work takes a
    moment), and no word from torch.onnx about the torchvision operators it skips (coreformer uses none)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def command(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A subcommand's handler: a CommandError becomes one line on stderr and exit code 2, a failed --check 1."""

    @functools.wraps(run)
    def handler(args: argparse.Namespace) -> int:
        quiet_loading()
        try:
            return run(args)
        except CommandError as error:
            print(f"coreformer {args.command}: error: {error}", file=sys.stderr)
            return 2
        except _CheckFailedError:
            return 1

    return handler


def _check_destination(dst: Path, overwrite: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise CommandError(f"{dst} exists and is not a folder.")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise CommandError(f"{dst} exists and is not empty; pass --overwrite to replace it.")


def load_hf_model(src: Path):
    """Load the transformers model of a local checkpoint folder, choosing its class from config.architectures."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from .conversion import SUPPORTED_ARCHITECTURES

    if not src.is_dir():
        raise CommandError(f"{src} is not a folder; pass a local transformers checkpoint folder.")
    if not (src / "config.json").is_file():
        raise CommandError(f"{src} has no config.json: not a transformers checkpoint folder.")
    if not any((src / name).is_file() for name in WEIGHT_FILES):
        raise CommandError(f"{src} has no weights: expected one of {', '.join(WEIGHT_FILES)}.")
    try:
        config = transformers.AutoConfig.from_pretrained(src, local_files_only=True)
    except Exception as error:  # a malformed or unknown config.json
        raise CommandError(f"cannot read {src / 'config.json'}: {error}") from error

    architectures = getattr(config, "architectures", None) or []
    name = architectures[0] if architectures else MODEL_MAPPING_NAMES.get(config.model_type)
    if name not in SUPPORTED_ARCHITECTURES:
        raise CommandError(
            f"cannot convert {name or config.model_type} (from {src / 'config.json'}); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    try:
        # Local files only, and pickles (pytorch_model.bin) only through torch.load(weights_only=True).
        model, info = getattr(transformers, name).from_pretrained(
            src, local_files_only=True, weights_only=True, output_loading_info=True
        )
    except Exception as error:  # truncated or corrupt weights, a shard missing, shapes that do not match the config
        raise CommandError(f"cannot load the weights in {src}: {type(error).__name__}: {error}") from error
    if info["missing_keys"]:
        print(
            f"warning: {src} lacks {sorted(info['missing_keys'])}; transformers initialised them randomly and the "
            f"converted model keeps those values.",
            file=sys.stderr,
        )
    return model.eval()


def load_tokenizer(src: Path):
    """The checkpoint's tokenizer, or None when the folder has no tokenizer files."""
    if not has_tokenizer(src):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src, local_files_only=True)
    except Exception as error:
        raise CommandError(
            f"{src} has tokenizer files but they do not load ({type(error).__name__}: {error}); fix them or pass "
            f"--skip-tokenizer to convert the weights alone."
        ) from error


def sample_inputs(model, tokenizer) -> dict[str, torch.Tensor]:
    """A small right-padded batch for `model`: tokenized sample texts, or random ids when there is no tokenizer.

    Right padding is what every supported conversion reproduces exactly on non-padding tokens (RoBERTa included).
    """
    config = model.config
    if tokenizer is not None:
        rows = [tokenizer(text)["input_ids"] for text in SAMPLE_TEXTS]
    else:
        generator = torch.Generator().manual_seed(0)
        special = {config.pad_token_id, config.bos_token_id, config.eos_token_id}
        ordinary = [i for i in range(config.vocab_size) if i not in special]
        rows = []
        for length in (12, 9, 5):
            picks = torch.randint(len(ordinary), (length,), generator=generator)
            row = [ordinary[i] for i in picks]
            if config.eos_token_id is not None:  # BART's classifier pools at the eos token
                row[-1] = config.eos_token_id
            rows.append(row)
    _, head = head_of_class(type(model).__name__)
    if config.pad_token_id is None and head.auto_class == AutoModelForSequenceClassification.__name__:
        rows = rows[:1]  # without a pad id, transformers cannot find the last token of a padded row
    longest = max(len(row) for row in rows)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    input_ids = torch.tensor([row + [pad] * (longest - len(row)) for row in rows])  # (B, T)
    attention_mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in rows])  # (B, T)
    if head.auto_class == AutoModelForMultipleChoice.__name__:
        # (B, T) -> (1, B, T): the sample rows become the choices of one question.
        return {"input_ids": input_ids[None], "attention_mask": attention_mask[None]}
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def max_abs_difference(reference, converted, inputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Run both models on `inputs` in fp32 and return, per shared floating output, the largest absolute difference
    over non-padding positions (the one parity check, `coreformer.native.parity`)."""
    from .native.parity import model_differences

    return model_differences(reference, converted, inputs)


@command
def convert(args: argparse.Namespace) -> int:
    """`coreformer convert`: SRC (transformers folder) -> DST (coreformer folder)."""
    from .conversion import convert_from_hf

    src, dst = Path(args.src), Path(args.dst)
    _check_destination(dst, args.overwrite)
    hf_model = load_hf_model(src)
    tokenizer = None if args.skip_tokenizer else load_tokenizer(src)
    if tokenizer is None and not args.skip_tokenizer:
        print(
            f"note: {src} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}), so none is copied: add the "
            f"source model's with AutoTokenizer.from_pretrained(SOURCE).save_pretrained({str(dst)!r}).",
            file=sys.stderr,
        )
    try:
        model = convert_from_hf(hf_model)
    except ValueError as error:
        raise CommandError(str(error)) from error
    print(f"converted {type(hf_model).__name__} -> {type(model).__name__}")

    with staged_folder(dst) as staging:
        if tokenizer is not None:
            # config.json, model.safetensors, generation_config.json, modeling *.py, tokenizer, and for QA and
            # seq2seq heads the custom pipeline that serves them (transformers 5 dropped those tasks).
            save_with_pipeline(model, tokenizer, staging)
        else:
            model.save_pretrained(staging)
        if args.check:
            # Check the written folder, not the in-memory model: that also covers saving and loading.
            reloaded = type(model).from_pretrained(staging).eval()
            differences = max_abs_difference(hf_model, reloaded, sample_inputs(reloaded, tokenizer))
            worst = max(differences.values())
            for key, value in differences.items():
                print(f"max abs difference {key}: {value:.3g}")
            if worst > CHECK_TOLERANCE:
                print(f"check failed: {worst:.3g} > {CHECK_TOLERANCE}; {dst} not written.", file=sys.stderr)
                raise _CheckFailedError
        info = converted_card_info(src, hf_model, model, tokenizer, differences if args.check else None)
        write_model_card(staging, info, path_hint=str(dst))
        _check_destination(dst, args.overwrite)  # it may have been filled while we worked
    print(f"wrote {dst}")
    return 0


def converted_card_info(src: Path, hf_model, model, tokenizer, differences: dict[str, float] | None) -> ModelCardInfo:
    """The card of a converted folder: what it was converted from, and the `--check` differences when measured.
    License and Hub datasets come from the source folder's card when it has one (the weights are the source's); with
    no card the license is "other" and the text says the source's terms apply."""
    source_card = source_card_metadata(src)
    datasets = source_card.get("datasets") or []
    datasets = [datasets] if isinstance(datasets, str) else datasets
    datasets = [name for name in datasets if isinstance(name, str) and is_hub_id(name)]
    source_license = inherited_license(src)
    limitations = ""  # the template's default
    if source_license is None:
        limitations = (
            "The source folder has no model card, so its license is not recorded here (`license: other`): the terms "
            "of the source checkpoint apply. Outputs match the source model up to floating-point rounding, as "
            "measured above when the check was run."
        )
    name = type(model).__name__
    family, head = head_of_class(name)
    pipeline_tag = head.pipeline_tag
    hyperparameters = [
        ("source class", type(hf_model).__name__),
        ("coreformer class", name),
        ("source folder", f"`{src}`"),
        ("tokenizer", "copied from the source" if tokenizer is not None else "none (not in the source, or skipped)"),
    ]
    eval_results = {}
    if differences is not None:
        eval_results["max_abs_diff_vs_transformers"] = max(differences.values())
        for key, value in differences.items():
            hyperparameters.append((f"check: max abs difference, {key}", f"{value:.3g}"))
        hyperparameters.append(("check tolerance", CHECK_TOLERANCE))
        inputs = "tokenized sample texts" if tokenizer is not None else "random token ids"
        hyperparameters.append(("check inputs", f"{inputs}, right-padded; padding positions ignored"))
    return ModelCardInfo(
        kind="converted",
        title=f"coreformer {name} from {src.resolve().name}",
        family=family.name,
        auto_class=head.auto_class,
        summary=(
            f"`{type(hf_model).__name__}` from `{src}` converted to coreformer's `{name}` with `coreformer convert`: "
            f"the same weights under coreformer's parameter names, computing the same outputs."
        ),
        num_parameters=model.num_parameters(),
        base_model=str(src),
        datasets=datasets,
        pipeline_tag=pipeline_tag,
        task_type=pipeline_tag or "multiple-choice",
        eval_results=eval_results,
        eval_dataset="coreformer convert --check sample batch",
        hyperparameters=hyperparameters,
        license=source_license or "other",
        limitations=limitations,
        tags=["conversion"],
    )


@command
def export(args: argparse.Namespace) -> int:
    """`coreformer export`: a coreformer folder -> a native transformers folder, ONNX or GGUF (coreformer.export)."""
    from .export import ExportCheckError, export_to

    try:
        summary = export_to(
            args.folder,
            args.out,
            to=args.to,
            check=args.check,
            overwrite=args.overwrite,
            gguf_dtype=args.gguf_dtype,
        )
    except ExportCheckError as error:
        print(str(error), file=sys.stderr)
        raise _CheckFailedError from error
    except ValueError as error:
        raise CommandError(str(error)) from error
    if summary.get("check"):
        print_check(summary["check"])
    written = summary.get("out") or summary.get("file") or args.out
    print(f"exported {args.folder} -> {summary.get('native_class') or args.to}: wrote {written}")
    return 0


def print_check(check: dict) -> None:
    """What `export --check` found, alike for every format (coreformer.native.parity.check_summary)."""
    print(f"max abs difference: {check['max_abs_difference']:.3g} (tolerance {check['tolerance']})")
    for key, what in (("tokens_equal", "greedy tokens equal"), ("tokenizer_equal", "tokenizer ids equal")):
        if check.get(key) is not None:
            print(f"{what}: {check[key]}")


@command
def attention_map(args: argparse.Namespace) -> int:
    """`coreformer attention-map`: a saved model's attention probabilities for a text, drawn to an image."""
    try:
        return attention_maps.run(args)
    except ValueError as error:
        raise CommandError(str(error)) from error


def main(argv: list[str] | None = None) -> int:
    """`coreformer ARGS` in-process: the same as the console command (coreformer_cli.main)."""
    return coreformer_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
