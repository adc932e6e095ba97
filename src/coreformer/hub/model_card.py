"""Model cards (README.md) for coreformer folders: one description, three templates, an offline check.

    ModelCardInfo                      what a card says: kind, title, family, numbers, data, usage, eval results
    render_model_card(info) -> card    huggingface_hub ModelCard from model_cards/<kind>.md (Jinja) + ModelCardData
    write_model_card(folder, info)     folder/README.md, written atomically (temporary file, then os.replace)
    validate_model_card(path or text)  the metadata checks the Hub would make, offline; ValueError naming the problem

The templates live in the repository's top-level `model_cards/` folder and ship in the wheel as
`coreformer/model_cards/` (pyproject.toml maps them in), so `template_dir()` looks next to this file first and
then in the source checkout. The card's metadata block holds Hub ids only (datasets, base_model): local paths are
described in the text. Evaluation results go into `model-index` (ModelCardData(eval_results=[EvalResult(...)])),
one entry per metric, all on `eval_dataset`.

Used by the pretraining and fine-tuning runs, `coreformer convert` (coreformer.commands) and publishing.py; never
imported by the modeling code, which is copied next to checkpoints.
"""

import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..families import FAMILIES

KINDS = ("pretrained", "fine-tuned", "converted")
CARD_NAME = "README.md"

# "name" or "owner/name": the shape of a Hub repository id (no path separators beyond one slash, no leading dot).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# dataset.type of a model-index entry whose evaluation data is not a Hub dataset.
LOCAL_DATASET_TYPE = "local"


@dataclass
class ModelCardInfo:
    """Everything a card says. `kind` picks the template; `datasets` and `base_model` reach the metadata only when
    they are Hub ids, `dataset_description` says in words what the data was (local files, the embedded corpus)."""

    kind: str  # "pretrained" | "fine-tuned" | "converted": picks model_cards/<kind>.md
    title: str  # card heading, also model-index name
    family: str  # a name in families.FAMILIES: "encoder" | "decoder" | "seq2seq"
    auto_class: str  # e.g. "AutoModelForSequenceClassification"
    summary: str  # a paragraph: what the model is and how it was made
    num_parameters: int
    base_model: str | None = None  # Hub id or path it was fine-tuned/converted from (only Hub ids go in metadata)
    datasets: list[str] = field(default_factory=list)  # Hub dataset ids only (metadata)
    dataset_description: str = ""  # human words for the data (local files, embedded corpus)
    pipeline_tag: str | None = None
    task_type: str | None = None  # model-index task type, e.g. "text-classification"
    task_name: str | None = None
    eval_results: dict[str, float] = field(default_factory=dict)  # metric name -> value, goes into model-index
    eval_dataset: str | None = None  # dataset name for model-index
    hyperparameters: list[tuple[str, Any]] = field(default_factory=list)
    usage: str = ""  # python lines run after `model = AutoX.from_pretrained(...)` in the how-to-load block
    intended_use: str = ""
    limitations: str = ""
    tags: list[str] = field(default_factory=list)
    license: str = "apache-2.0"


def template_dir() -> Path:
    """The folder holding the card templates: `coreformer/model_cards/` in an installed wheel, the repository's
    `model_cards/` in a source checkout (editable install)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "model_cards", here.parents[2] / "model_cards"):
        if (candidate / f"{KINDS[0]}.md").is_file():
            return candidate
    raise FileNotFoundError(
        f"coreformer's model card templates are missing: looked in {here / 'model_cards'} (installed package) and "
        f"{here.parents[2] / 'model_cards'} (source checkout); reinstall coreformer."
    )


def is_hub_id(name: str) -> bool:
    """True when `name` has the shape of a Hub repository id and is not a local path."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not Path(name).expanduser().exists()


def source_card_metadata(folder: str | Path) -> dict:
    """The metadata of a model folder's README.md (license, datasets, ...), or {} when it has no readable card."""
    card = Path(folder) / CARD_NAME
    try:
        return ModelCard.load(card).data.to_dict() if card.is_file() else {}
    except Exception:  # a card without metadata or with metadata huggingface_hub rejects: nothing to carry over
        return {}


def inherited_license(folder: str | Path) -> str | None:
    """The license a model derived from `folder` carries: its card's, or None when that is not recorded."""
    license_name = source_card_metadata(folder).get("license")
    return license_name if isinstance(license_name, str) else None


def format_metric(value: float) -> str:
    """A metric for the card's text: 4 decimals, or 3 significant digits when tiny or huge."""
    return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e6 else f"{value:.3g}"


def format_cell(value: Any) -> str:
    """A markdown table cell: ints with thousands separators, None as "none"; `|`, `<` and newlines escaped so the
    table keeps its shape and `</s>` stays visible."""
    if isinstance(value, int) and not isinstance(value, bool):
        text = f"{value:,}"
    elif value is None:
        text = "none"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _check_info(info: ModelCardInfo) -> None:
    if info.kind not in KINDS:
        raise ValueError(f"Unknown model card kind {info.kind!r}; the allowed kinds are {', '.join(KINDS)}.")
    if info.family not in FAMILIES:
        raise ValueError(f"Unknown family {info.family!r}; the allowed families are {', '.join(FAMILIES)}.")
    local = [name for name in info.datasets if not is_hub_id(name)]
    if local:
        raise ValueError(
            f"`datasets` holds Hub dataset ids only, got {local}; describe local data in `dataset_description`."
        )
    if info.eval_results and not (info.task_type or info.pipeline_tag):
        raise ValueError("`eval_results` need a `task_type` (or a `pipeline_tag`) for the model-index entry.")
    if info.eval_results and not (info.eval_dataset or info.datasets):
        raise ValueError("`eval_results` need an `eval_dataset` naming the data they were measured on.")
    for name, value in info.eval_results.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"eval result {name!r} must be a finite number, got {value!r}.")


def _eval_results(info: ModelCardInfo) -> list[EvalResult]:
    dataset_name = info.eval_dataset or info.datasets[0]
    dataset_type = dataset_name if dataset_name in info.datasets else LOCAL_DATASET_TYPE
    return [
        EvalResult(
            task_type=info.task_type or info.pipeline_tag,
            task_name=info.task_name,
            dataset_type=dataset_type,
            dataset_name=dataset_name,
            metric_type=name,
            metric_name=name,
            metric_value=float(value),
        )
        for name, value in info.eval_results.items()
    ]


def render_model_card(info: ModelCardInfo, path_hint: str = "path/to/folder") -> ModelCard:
    """The card of `info` from `model_cards/<kind>.md`; `path_hint` is what the how-to-load lines pass to
    from_pretrained (a folder or a Hub id)."""
    _check_info(info)
    base_model = info.base_model if info.base_model and is_hub_id(info.base_model) else None
    card_data = ModelCardData(
        license=info.license,
        library_name="transformers",
        pipeline_tag=info.pipeline_tag,
        tags=["coreformer", info.family, info.kind, *info.tags, "custom_code"],
        base_model=base_model,
        datasets=list(info.datasets) or None,
        eval_results=_eval_results(info) or None,
        model_name=info.title if info.eval_results else None,
    )
    data = info.dataset_description or ", ".join(f"`{name}`" for name in info.datasets) or "not recorded"
    return ModelCard.from_template(
        card_data,
        template_path=str(template_dir() / f"{info.kind}.md"),
        title=info.title,
        summary=info.summary.strip(),
        family_description=FAMILIES[info.family].description,
        parameters=f"{info.num_parameters:,}",
        data=data,
        base_model_text=f"`{info.base_model}`" if info.base_model else "not recorded",
        auto_class=info.auto_class,
        path=path_hint,
        usage=info.usage.strip(),
        hyperparameters=[(format_cell(name), format_cell(value)) for name, value in info.hyperparameters],
        eval_dataset=info.eval_dataset or (info.datasets[0] if info.datasets else None),
        metric_rows=[(format_cell(name), format_metric(float(value))) for name, value in info.eval_results.items()],
        intended_use=info.intended_use.strip(),
        limitations=info.limitations.strip(),
    )


def write_model_card(folder: str | Path, info: ModelCardInfo, path_hint: str | None = None) -> Path:
    """Render `info` into `folder/README.md` atomically and return its path; `path_hint` defaults to `folder`."""
    folder = Path(folder)
    text = str(render_model_card(info, str(folder) if path_hint is None else path_hint))
    validate_model_card(text)  # a card we write must pass our own check
    path = folder / CARD_NAME
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{CARD_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(temporary, 0o644)  # mkstemp makes 0600 files; a card is meant to be read
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _read_card_text(path_or_text: str | Path) -> tuple[str, str]:
    """(text, where) from a card file, a folder holding README.md, or the card text itself."""
    if isinstance(path_or_text, str) and ("\n" in path_or_text or path_or_text.lstrip().startswith("---")):
        return path_or_text, "the card"
    path = Path(path_or_text)
    if path.is_dir():
        path = path / CARD_NAME
    if not path.is_file():
        raise ValueError(f"{path} does not exist: no model card to validate.")
    return path.read_text(encoding="utf-8"), str(path)


def _require_text(value: Any, name: str, where: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: `{name}` must be a non-empty string, got {value!r}.")


def _check_model_index(model_index: Any, where: str) -> None:
    """The model-index shape the Hub accepts: [{name, results: [{task: {type}, dataset: {type, name},
    metrics: [{type, value}]}]}]."""
    if not isinstance(model_index, list) or not model_index:
        raise ValueError(f"{where}: `model-index` must be a non-empty list, got {model_index!r}.")
    for entry in model_index:
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: each `model-index` entry must be a mapping, got {entry!r}.")
        _require_text(entry.get("name"), "model-index[].name", where)
        results = entry.get("results")
        if not isinstance(results, list) or not results:
            raise ValueError(f"{where}: `model-index[].results` must be a non-empty list, got {results!r}.")
        for result in results:
            if not isinstance(result, dict):
                raise ValueError(f"{where}: each model-index result must be a mapping, got {result!r}.")
            task, dataset, metrics = result.get("task"), result.get("dataset"), result.get("metrics")
            if not isinstance(task, dict):
                raise ValueError(f"{where}: a model-index result has no `task` mapping (task.type), got {task!r}.")
            _require_text(task.get("type"), "model-index[].results[].task.type", where)
            if not isinstance(dataset, dict):
                raise ValueError(f"{where}: a model-index result has no `dataset` mapping (type, name).")
            _require_text(dataset.get("type"), "model-index[].results[].dataset.type", where)
            _require_text(dataset.get("name"), "model-index[].results[].dataset.name", where)
            if not isinstance(metrics, list) or not metrics:
                raise ValueError(f"{where}: a model-index result needs a non-empty `metrics` list, got {metrics!r}.")
            for metric in metrics:
                if not isinstance(metric, dict):
                    raise ValueError(f"{where}: each metric must be a mapping with type and value, got {metric!r}.")
                _require_text(metric.get("type"), "model-index[].results[].metrics[].type", where)
                value = metric.get("value")
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise ValueError(
                        f"{where}: metric {metric.get('type')!r} needs a finite numeric `value`, got {value!r}."
                    )


def validate_model_card(path_or_text: str | Path) -> ModelCard:
    """Check a card offline, like the Hub's metadata validation: the YAML block parses to a mapping, `license` and
    `library_name` are set, tags/datasets are lists of strings, and every model-index entry has a task type, a
    dataset (type and name) and metrics with a type and a numeric value. Returns the parsed ModelCard; raises
    ValueError naming the first problem. Accepts a README.md path, a folder holding one, or the card text."""
    import yaml
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    text, where = _read_card_text(path_or_text)
    match = REGEX_YAML_BLOCK.search(text)
    if match is None:
        raise ValueError(
            f"{where}: no metadata block (a `---` YAML header) at the top; write the card with "
            f"coreformer.hub.model_card.write_model_card."
        )
    try:
        metadata = yaml.safe_load(match.group(2))
    except yaml.YAMLError as error:
        raise ValueError(f"{where}: the metadata block is not valid YAML: {error}") from error
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: the metadata block must be a YAML mapping, got {type(metadata).__name__}.")
    _require_text(metadata.get("license"), "license", where)
    _require_text(metadata.get("library_name"), "library_name", where)
    for name in ("tags", "datasets"):
        value = metadata.get(name)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{where}: `{name}` must be a list of strings, got {value!r}.")
    base_model = metadata.get("base_model")
    if base_model is not None and not isinstance(base_model, str | list):
        raise ValueError(f"{where}: `base_model` must be a Hub id or a list of them, got {base_model!r}.")
    if "model-index" in metadata:
        _check_model_index(metadata["model-index"], where)
    try:
        return ModelCard(text)
    except ValueError as error:
        raise ValueError(f"{where}: huggingface_hub cannot read the metadata: {error}") from error
