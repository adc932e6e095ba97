"""`coreformer convert`: a local transformers checkpoint folder -> a coreformer folder, checked and carded.

    convert(args, prog) -> exit code    the handler (arguments: coreformer_settings.tools.add_convert_arguments)
    load_hf_model(src)                  the folder's transformers model, its class chosen from config.architectures
    converted_card_info(...)            the model card of the converted folder

It reads a folder (config.json + model.safetensors or pytorch_model.bin), converts it with `convert_from_hf` and
writes a coreformer folder that loads with `trust_remote_code=True` where coreformer is not installed, with a model
card (README.md, model_cards/converted.md: the source, and the `--check` difference in its model-index when the check
ran). DST is built in a temporary sibling folder and renamed into place only when everything (and `--check`, if
asked) succeeded, so a failed run leaves nothing behind. Exit codes: 0 written, 1 `--check` found a difference above
tolerance, 2 a bad input (one line on stderr, nothing written).
"""

import argparse
import sys
from pathlib import Path

from ..families import head_of_class
from ..hub.folders import TOKENIZER_FILES, DestinationExistsError, check_destination, saved_tokenizer, staged_folder
from ..hub.model_card import ModelCardInfo, inherited_license, is_hub_id, source_card_metadata, write_model_card
from ..native.parity import Comparison, allowed_difference, compare_models, sample_inputs
from ..pipelines import save_with_pipeline
from .base import CheckFailedError, CommandError, tool_command

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _check_destination(dst: Path, overwrite: bool) -> None:
    try:
        check_destination(dst, overwrite)
    except DestinationExistsError as error:
        raise CommandError(error.command_line_message()) from error
    except ValueError as error:
        raise CommandError(str(error)) from error


def load_hf_model(src: Path):
    """Load the transformers model of a local checkpoint folder, choosing its class from config.architectures."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from ..native.conversion import SUPPORTED_ARCHITECTURES

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


def source_tokenizer(src: Path):
    """The checkpoint's tokenizer, or None when the folder has no tokenizer files."""
    try:
        return saved_tokenizer(src)
    except Exception as error:
        raise CommandError(
            f"{src} has tokenizer files but they do not load ({type(error).__name__}: {error}); fix them or pass "
            f"--skip-tokenizer to convert the weights alone."
        ) from error


@tool_command
def convert(args: argparse.Namespace) -> int:
    """`coreformer convert`: SRC (transformers folder) -> DST (coreformer folder)."""
    from ..native.conversion import convert_from_hf

    src, dst = Path(args.src), Path(args.dst)
    _check_destination(dst, args.overwrite)
    hf_model = load_hf_model(src)
    tokenizer = None if args.skip_tokenizer else source_tokenizer(src)
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
            comparison = compare_models(hf_model, reloaded, sample_inputs(reloaded, tokenizer))
            allowed = allowed_difference(comparison.scale)
            for key, value in comparison.differences.items():
                print(f"max abs difference {key}: {value:.3g}")
            if not comparison.passed:
                worst = max(comparison.differences.values(), default=float("inf"))
                print(f"check failed: {worst:.3g} > {allowed:.3g}; {dst} not written.", file=sys.stderr)
                raise CheckFailedError
        info = converted_card_info(src, hf_model, model, tokenizer, comparison if args.check else None)
        write_model_card(staging, info, path_hint=str(dst))
        _check_destination(dst, args.overwrite)  # it may have been filled while we worked
    print(f"wrote {dst}")
    return 0


def converted_card_info(src: Path, hf_model, model, tokenizer, comparison: Comparison | None) -> ModelCardInfo:
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
    if comparison is not None:
        eval_results["max_abs_diff_vs_transformers"] = max(comparison.differences.values())
        for key, value in comparison.differences.items():
            hyperparameters.append((f"check: max abs difference, {key}", f"{value:.3g}"))
        hyperparameters.append(("check tolerance", f"{allowed_difference(comparison.scale):.3g}"))
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
