"""The exporters: coreformer models -> transformers' own architectures, and `export_to` for every format (ONNX and
GGUF in onnx.py and gguf.py).

    export_to(source, out, to="native" | "onnx" | "gguf", check=False)   a saved coreformer folder -> OUT (or a
                                                                           native folder coreformer reads)
    to_native(model) -> transformers model                                 the same function under a native class
    choose_target(config, class_name) -> (architecture, native class)      or ONE ValueError naming the differences
    check_exported([CheckJob, ...]) -> [CheckResult, ...]                  plain-transformers reload, in a fresh process

Most coreformer configurations ARE a native architecture. The registry of `coreformer.native` says, per
architecture (one file each), which family it represents, which config values it needs (each `Requirement` names the
field and the value the architecture has), how the config is written, and which native class each coreformer head
becomes. The first architecture whose requirements all hold is used; when none holds, the error names the closest
one and every field that differs:

    target     family    needs (besides the family's defaults)                      native heads
    gpt2       decoder   learned positions, LayerNorm pre-norm, biases, no GQA      GPT2{Model,LMHeadModel,For...}
    llama      decoder   rotary, RMSNorm pre-norm, gated MLP, all layers full       Llama{Model,ForCausalLM,For...}
    mistral    decoder   as llama without biases, every layer sliding               Mistral...
    qwen2      decoder   as llama without biases, layers full or sliding            Qwen2... (q/k/v biases written 0)
    gpt_neox   decoder   rotary, LayerNorm pre-norm, MLP biases, no GQA, all full    GPTNeoX{Model,ForCausalLM,For...}
                         (a GPT-2 block with rotary positions: the decoder presets; sequential residual, full rotary)
    bert       encoder   learned positions from 0, LayerNorm post-norm, types       Bert{Model,ForMaskedLM,For...}
    roberta    encoder   as bert, positions from pad_token_id + 1                   Roberta...
    modernbert encoder   rotary pre-norm GeGLU, no first attention norm, full/sliding      ModernBert{Model,For...}
                         layers (a rope theta each), head transforms (classifier_transform)
    bart       seq2seq   learned positions (offset <= 2), LayerNorm post-norm        Bart{Model,ForConditional...}

The weights are renamed with the architecture's reading rules, run backwards (`NativeArchitecture.to_native`), so
`convert_from_hf(to_native(m))` is `m` again by construction (tests/native/test_export.py checks it for every target
and head). Native weights coreformer has no counterpart for are written as zeros, which adds nothing: BertModel's
pooler (pooler_output is then 0), BART's final_logits_bias when the model has none, Qwen2's q/k/v biases for a model
without biases.

The output folder holds config.json (native model_type and architectures, no auto_map), model.safetensors,
generation_config.json for generative heads, the source's tokenizer, and a README.md saying what it was exported
from. It is written atomically (folders.staged_folder); a non-empty OUT is refused unless `overwrite=True`.

`check=True` reloads OUT with plain transformers in a fresh `python -I` process in which importing coreformer
fails (asserted there), runs it on a padded sample batch and, for generative heads, generates a few greedy tokens;
the same runs here on the coreformer model. The comparison is `coreformer.native.parity`'s: a difference above its
fp32 tolerance (`CHECK_TOLERANCE`, times the outputs' scale above 1: `allowed_difference`) or a different token fails
the export and leaves nothing at OUT.

A native transformers folder (an exported one, or any checkpoint of an architecture in the registry) is accepted
too: it is converted in memory (`convert_from_hf`) and exported as its coreformer twin would be, except that
`--to gguf` writes it as it is. Every exporter's summary holds `check` (`check_summary`: the largest difference, the
tolerance, whether greedy tokens and tokenizer ids are equal) when checked, and errors name the folder the user
gave, never a temporary one.
"""

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from coreformer_settings.base import installed_version as version
from coreformer_settings.exports import GGUF_DTYPES

from ..configuration_coreformer import CoreformerConfig
from ..families import head_of_class
from ..hub.folders import DestinationExistsError, check_destination, prepare_for_serving, saved_tokenizer, staged_folder
from ..hub.model_card import CARD_NAME, inherited_license, is_hub_id, validate_model_card
from ..modeling_base import CoreformerPreTrainedModel
from ..native import NATIVE_ARCHITECTURES, NativeArchitecture, architecture_of_class
from ..native.base import match_device_and_mode
from ..native.parity import (
    SAMPLE_TEXTS,
    ExportCheckError,
    allowed_difference,
    check_summary,
    greedy_tokens,
    output_differences,
    output_scale,
    sample_inputs,
    within_tolerance,
)

GREEDY_TOKENS = 5  # new tokens generated greedily by each side for generative heads


def choose_target(config: CoreformerConfig, class_name: str) -> tuple[NativeArchitecture, str]:
    """The first registered architecture that computes exactly what `class_name` with `config` computes, and its
    native class.

    Raises:
        ValueError: naming the closest architecture of the family (fewest differences) and every differing field.
    """
    family, _ = head_of_class(class_name)
    candidates = [
        target
        for target in NATIVE_ARCHITECTURES.values()
        if target.family == family.name and class_name in target.export_heads
    ]
    if not candidates:
        raise ValueError(f"{class_name} has no native transformers counterpart to export to.")
    differences = {target.name: target.differences(config, class_name) for target in candidates}
    for target in candidates:
        if not differences[target.name]:
            return target, target.export_heads[class_name]
    closest = min(candidates, key=lambda target: len(differences[target.name]))
    raise ValueError(
        f"cannot export {class_name} to a native transformers architecture without changing what it computes: the "
        f"closest native architecture is {closest.export_heads[class_name]}; differs in: "
        f"{'; '.join(differences[closest.name])}. Export to ONNX (--to onnx) keeps any configuration."
    )


def suggested_export(config: CoreformerConfig, class_name: str) -> str | None:
    """The export that takes `class_name` with `config` as it is, for a run's "what to run next": "native" where a
    native architecture computes the same function (`choose_target`), else "onnx" where the graphs hold its layer
    types (a generation head's with a key/value cache), else None. The exporters' own refusals decide."""
    from .onnx import refuse_uncachable, refuse_unexportable

    try:
        choose_target(config, class_name)
        return "native"
    except ValueError:
        pass
    family, head = head_of_class(class_name)
    try:
        refuse_unexportable(config)
        if head.auto_class == family.language_model_auto_class and family.name != "encoder":
            refuse_uncachable(config.cached_layer_types)
    except ValueError:
        return None
    return "onnx"


def to_native(model: CoreformerPreTrainedModel) -> PreTrainedModel:
    """The transformers model computing what `model` computes: same weights, native class, eval mode, same dtype.

    Raises:
        ValueError: when no native architecture computes the same function (the message names the closest one and
            the differing config fields).
    """
    target, _ = choose_target(model.config, type(model).__name__)
    native = target.to_native(model)
    match_device_and_mode(native, model)
    return native.eval()


# ---------------------------------------------------------------------------------------------------------------
# The check: plain transformers, in a fresh process where coreformer cannot be imported
# ---------------------------------------------------------------------------------------------------------------

# Run with `python -I` (no user site, no PYTHON* variables, no script folder on sys.path). An editable install still
# puts coreformer on sys.path, so the child blocks the import and asserts that it fails before loading anything.
_CHECK_CHILD = r"""
import sys
for blocked in ("coreformer", "coreformer_cli"):
    sys.modules[blocked] = None
try:
    import coreformer  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("coreformer is importable in the check process")
import gc
import torch
import transformers

gc.freeze()  # what the imports made lives as long as this process: no collection walks it again, exit included
jobs = torch.load(sys.argv[1], weights_only=False)
results = []
for job in jobs:
    config = transformers.AutoConfig.from_pretrained(job["folder"], local_files_only=True)
    assert "auto_map" not in config.to_dict(), "the exported config.json asks for remote code"
    model_class = getattr(transformers, config.architectures[0])
    # fp32 whatever the folder holds: the comparison is made in fp32 on both sides.
    model = model_class.from_pretrained(job["folder"], local_files_only=True, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("transformers.models."), type(model).__module__
    result = {"class": type(model).__name__}
    with torch.no_grad():
        outputs = model(**job["inputs"])
        result["outputs"] = {
            key: value for key, value in outputs.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point()
        }
        if job["generate"] is not None:
            result["tokens"] = model.generate(**job["generate"], do_sample=False, num_beams=1,
                                              max_new_tokens=job["new_tokens"])
    if job["texts"]:
        tokenizer = transformers.AutoTokenizer.from_pretrained(job["folder"], local_files_only=True)
        result["token_ids"] = [tokenizer(text)["input_ids"] for text in job["texts"]]
    results.append(result)
torch.save(results, sys.argv[2])
"""


@dataclass
class CheckJob:
    """One exported folder to reload, with the coreformer model it must reproduce."""

    folder: Path
    model: CoreformerPreTrainedModel
    tokenizer: object = None  # the source tokenizer, whose ids the exported one must reproduce


@dataclass
class CheckResult:
    native_class: str
    differences: dict[str, float]  # output name -> max abs difference over real tokens
    tokens_equal: bool | None  # greedy tokens identical (None: not a generative head)
    tokenizer_equal: bool | None  # the exported tokenizer's ids (None: no tokenizer)
    scale: float = 0.0  # the largest magnitude of the compared outputs (native.parity.output_scale)
    worst: float = field(init=False)

    def __post_init__(self) -> None:
        self.worst = max(self.differences.values(), default=float("inf"))

    @property
    def allowed(self) -> float:
        """The largest difference the check accepts at these outputs' scale (native.parity.allowed_difference)."""
        return allowed_difference(self.scale)

    @property
    def passed(self) -> bool:
        within = within_tolerance(self.differences, scale=self.scale)
        return within and self.tokens_equal is not False and self.tokenizer_equal is not False


def _generation_inputs(model: CoreformerPreTrainedModel, inputs: dict) -> dict | None:
    """The first (unpadded) sample row, for greedy generation; None for heads that do not generate."""
    if not model.can_generate():
        return None
    length = int(inputs["attention_mask"][0].sum())
    return {"input_ids": inputs["input_ids"][:1, :length], "attention_mask": inputs["attention_mask"][:1, :length]}


@torch.no_grad()
def check_exported(jobs: list[CheckJob], timeout: float = 900) -> list[CheckResult]:
    """Reload every exported folder in ONE fresh process with plain transformers (coreformer blocked there) and
    compare its outputs, greedy tokens and tokenizer ids with the coreformer models here, in fp32."""
    prepared, references = [], []
    for job in jobs:
        model = job.model.float().eval()
        inputs = sample_inputs(model)
        generate = _generation_inputs(model, inputs)
        outputs = model(**inputs)
        reference = {
            "outputs": {key: value for key, value in outputs.items() if isinstance(value, torch.Tensor)},
            "tokens": None if generate is None else greedy_tokens(model, generate, GREEDY_TOKENS),
            "token_ids": None if job.tokenizer is None else [job.tokenizer(text)["input_ids"] for text in SAMPLE_TEXTS],
        }
        references.append((reference, inputs["attention_mask"]))
        prepared.append(
            {
                "folder": str(job.folder),
                "inputs": inputs,
                "generate": generate,
                "new_tokens": GREEDY_TOKENS,
                "texts": list(SAMPLE_TEXTS) if job.tokenizer is not None else [],
            }
        )
    with tempfile.TemporaryDirectory(prefix="coreformer-export-check-") as scratch:
        jobs_path, results_path = Path(scratch) / "jobs.pt", Path(scratch) / "results.pt"
        torch.save(prepared, jobs_path)
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        completed = subprocess.run(
            [sys.executable, "-I", "-c", _CHECK_CHILD, str(jobs_path), str(results_path)],
            cwd=scratch,
            env=environment,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if completed.returncode != 0:
            raise RuntimeError(f"the plain-transformers check process failed:\n{completed.stderr[-3000:]}")
        found = torch.load(results_path, weights_only=False)
    results = []
    for (reference, mask), child in zip(references, found):
        tokens_equal = None
        if reference["tokens"] is not None:
            tokens_equal = torch.equal(reference["tokens"], child["tokens"])
        tokenizer_equal = None if reference["token_ids"] is None else reference["token_ids"] == child["token_ids"]
        differences = output_differences(reference["outputs"], child["outputs"], mask)
        scale = output_scale(reference["outputs"], child["outputs"], mask)
        results.append(CheckResult(child["class"], differences, tokens_equal, tokenizer_equal, scale))
    return results


# ---------------------------------------------------------------------------------------------------------------
# Folders: load, write, card
# ---------------------------------------------------------------------------------------------------------------


def _architectures(source: str | Path) -> list[str]:
    config_path = Path(source) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{source} has no config.json: not a saved model folder.")
    return json.loads(config_path.read_text()).get("architectures") or []


def native_class_of(source: str | Path) -> str | None:
    """The native transformers class the folder `source` holds when coreformer reads it (`convert_from_hf`), else
    None (a coreformer folder, or a class coreformer does not read)."""
    architectures = _architectures(source)
    if architectures and architecture_of_class(architectures[0]) is not None:
        return architectures[0]
    return None


def coreformer_class(source: str | Path) -> type[CoreformerPreTrainedModel]:
    """The coreformer class the config.json of the folder `source` names (looked up in the family registry)."""
    architectures = _architectures(source)
    try:
        family, head = head_of_class(architectures[0] if architectures else "")
    except ValueError:
        raise ValueError(
            f"{source} holds {architectures or 'no architectures'}, not a coreformer model nor a native class "
            f"coreformer reads: export takes a folder saved by coreformer (pretraining, fine-tuning or `coreformer "
            f"convert`) or a transformers folder of {', '.join(NATIVE_ARCHITECTURES)}."
        ) from None
    return getattr(import_module(f"..{family.module}", __package__), head.class_name)


def load_exportable(source: str | Path) -> CoreformerPreTrainedModel:
    """The coreformer model of the folder `source`: a coreformer folder loaded, or a native transformers folder of an
    architecture coreformer reads converted in memory (`convert_from_hf`: the same function, same weights)."""
    native_class = native_class_of(source)
    if native_class is None:
        return coreformer_class(source).from_pretrained(source).eval()
    import transformers

    from ..native.conversion import convert_from_hf

    native = getattr(transformers, native_class).from_pretrained(source, local_files_only=True)
    return convert_from_hf(native).eval()


def _card(
    source: str, out: str, model: CoreformerPreTrainedModel, native: PreTrainedModel, result: CheckResult | None
) -> str:
    """README.md of an exported folder: plain transformers metadata (no custom code), what it was exported from, and
    how to load it from `out` (publishing.card_for_repo points those lines at the repo)."""
    import yaml

    _, head = head_of_class(type(model).__name__)
    metadata = {
        "license": inherited_license(source) or "other",
        "library_name": "transformers",
        "tags": ["coreformer", "exported", native.config.model_type],
    }
    if head.pipeline_tag:
        metadata["pipeline_tag"] = head.pipeline_tag
    if is_hub_id(source) and not Path(source).exists():
        metadata["base_model"] = source
    native_class = type(native).__name__
    if result is None:
        check = "not run (`coreformer export --check` reloads the folder with plain transformers and compares)"
    else:
        tokens = {None: "", True: "; greedy tokens identical", False: "; greedy tokens DIFFER"}[result.tokens_equal]
        check = f"max abs difference {result.worst:.3g} (tolerance {result.allowed:.3g}, fp32){tokens}"
    rows = [
        ("exported from", f"`{source}`"),
        ("coreformer class", type(model).__name__),
        ("native class", native_class),
        ("coreformer version", version()),  # the installed package's, read without importing it from here
        ("check", check),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        f"---\n{yaml.safe_dump(metadata, sort_keys=False)}---\n\n"
        f"# {native_class} exported from {Path(source).name}\n\n"
        f"A coreformer `{type(model).__name__}` written as transformers' own `{native_class}` with `coreformer "
        f"export`: the same weights under {native_class}'s names, computing the same outputs. It loads with plain "
        f"transformers (no `trust_remote_code`, no coreformer) and in engines that know {native_class}.\n\n"
        f"| | |\n|---|---|\n{table}\n\n"
        f"## How to load\n\n```python\nfrom transformers import AutoTokenizer, {head.auto_class}\n\n"
        f'tokenizer = AutoTokenizer.from_pretrained("{out}")\n'
        f'model = {head.auto_class}.from_pretrained("{out}")\n```\n'
    )


def export_native(
    source: str | Path, out: str | Path, *, check: bool = False, overwrite: bool = False
) -> dict[str, object]:
    """Write the native transformers folder of the coreformer folder `source` to `out` (see the module docstring).

    Returns:
        {"out", "native_class", "target", "check"}: check is None, or the max difference and token equality.

    Raises:
        ValueError: no native architecture computes the same function, or `out` is not empty without overwrite.
        ExportCheckError: `check` found a difference; nothing is written.
    """
    out = Path(out)
    check_destination(out, overwrite)
    if native_class_of(source) is None:
        model_class = coreformer_class(source)
        choose_target(model_class.config_class.from_pretrained(source), model_class.__name__)  # refuse before loading
    model = load_exportable(source)
    native = to_native(model)
    tokenizer = saved_tokenizer(source)
    result = None
    with staged_folder(out) as staging:
        native.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        causal_lm = (
            type(native).__name__ in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        )
        prepare_for_serving(staging, causal_lm=causal_lm)
        saved = json.loads((staging / "config.json").read_text())
        if "auto_map" in saved:
            raise ValueError(f"the exported config.json names remote code ({saved['auto_map']}); refusing to write.")
        if check:
            (result,) = check_exported([CheckJob(staging, model, tokenizer)])
            if not result.passed:
                raise ExportCheckError(
                    f"check failed: max abs difference {result.worst:.3g} (tolerance {result.allowed:.3g}), greedy "
                    f"tokens equal: {result.tokens_equal}, tokenizer ids equal: {result.tokenizer_equal}; {out} not "
                    "written."
                )
        card = _card(str(source), str(out), model, native, result)
        validate_model_card(card)
        (staging / CARD_NAME).write_text(card, encoding="utf-8")
        check_destination(out, overwrite)  # it may have been filled while we worked
    summary = {"out": str(out), "native_class": type(native).__name__, "target": native.config.model_type}
    summary["check"] = (
        None
        if result is None
        else {
            **check_summary(result.worst, result.allowed, result.tokens_equal, result.tokenizer_equal),
            "differences": result.differences,
        }
    )
    return summary


@contextmanager
def coreformer_folder(source: Path) -> Iterator[Path]:
    """`source` when it is a coreformer folder; for a native folder, its in-memory conversion saved (with its
    tokenizer) to a temporary folder, removed afterwards."""
    if native_class_of(source) is None:
        yield source
        return
    model, tokenizer = load_exportable(source), saved_tokenizer(source)
    with tempfile.TemporaryDirectory(prefix="coreformer-converted-") as scratch:
        model.save_pretrained(scratch)
        if tokenizer is not None:
            tokenizer.save_pretrained(scratch)
        yield Path(scratch)


def _export_onnx(source: Path, out: Path, *, check: bool, overwrite: bool, gguf_dtype: str) -> dict:
    from .onnx import export_onnx  # the serve helper's module; imported only when asked for

    check_destination(out, overwrite)
    with coreformer_folder(source) as folder:
        return export_onnx(folder, out, check=check, label=str(source))


def gguf_path(out: Path, dtype: str) -> Path:
    """OUT for `--to gguf`: a path ending in .gguf is the file itself; anything else is a folder that receives
    `model-<dtype>.gguf`."""
    return out if out.suffix == ".gguf" else out / f"model-{dtype}.gguf"


def _export_gguf(source: Path, out: Path, *, check: bool, overwrite: bool, gguf_dtype: str) -> dict:
    from .gguf import export_gguf  # the serve helper's module; imported only when asked for

    path = gguf_path(out, gguf_dtype)
    if path.exists() and not overwrite:
        raise DestinationExistsError(path, "exists")
    if native_class_of(source) is not None:  # already native: written as it is (or refused naming its class)
        return export_gguf(source, path, dtype=gguf_dtype, check=check, label=str(source))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coreformer-native-", dir=path.parent) as scratch:
        native_folder = Path(scratch) / "native"
        export_native(source, native_folder)
        return export_gguf(native_folder, path, dtype=gguf_dtype, check=check, label=str(source))


def _export_native(source: Path, out: Path, *, check: bool, overwrite: bool, gguf_dtype: str) -> dict:
    return export_native(source, out, check=check, overwrite=overwrite)


# --to FORMAT (coreformer_settings.exports.EXPORT_FORMATS) -> the function writing it: (source folder, out, check,
# overwrite, gguf_dtype) -> summary dict.
EXPORTERS: dict[str, Callable[..., dict]] = {"native": _export_native, "onnx": _export_onnx, "gguf": _export_gguf}


def export_to(
    source: str | Path,
    out: str | Path,
    *,
    to: str = "native",
    check: bool = False,
    overwrite: bool = False,
    gguf_dtype: str = "f32",
) -> dict:
    """Export the folder `source` to `out`: a native transformers folder (default), an ONNX folder, or a GGUF file
    (`gguf_path`: OUT ending in .gguf, or a folder receiving model-<dtype>.gguf; written from a temporary native
    export). `source` is a coreformer folder or a transformers folder of a native architecture coreformer reads
    (converted in memory; written to GGUF as it is). Returns the exporter's summary, with `check` (`check_summary`)
    when checked; see `export_native` for errors."""
    if to not in EXPORTERS:
        raise ValueError(f"unknown export target {to!r}; choose one of {', '.join(EXPORTERS)}.")
    if gguf_dtype not in GGUF_DTYPES:
        raise ValueError(f"unknown GGUF dtype {gguf_dtype!r}; choose one of {', '.join(GGUF_DTYPES)}.")
    source = Path(source)
    if not source.is_dir():
        raise ValueError(
            f"no such folder: {source} (looked for {source.resolve()}); pass a saved coreformer or transformers folder."
        )
    return EXPORTERS[to](source, Path(out), check=check, overwrite=overwrite, gguf_dtype=gguf_dtype)
