"""The settings base of both runs, importable without torch: the error classes, RunSettings, typed fields with their
help text, config files, value coercion and one argparse flag per field.

    RunError / PretrainingError / FinetuningError   one clear message about a bad input, nothing written yet
    RunStoppedError, INTERRUPTED                Ctrl-C during a run: the one line to print, and the exit code (130)
    RunSettings                            the settings base: resolve(config file values + flags), cli_fields(),
                                           setting_names(), and the range checks the __post_init__ methods use
    arg(default, help, **metadata)         a dataclass field whose metadata carries its CLI help (and `choices`,
                                           `aliases`, `cli=False`, `show_default=False`)
    load_config_file(path, error=...)      a YAML / JSON run config as a dict ("_"-prefixed keys are comments)
    coerce(name, value, annotation, ...)   a config-file or CLI value -> the field's type
    add_flags(parser, arguments, fields)   one argparse flag per dataclass field, defaults suppressed
    export_arg(), EXPORT_FOLDER            the `--export native` setting of both runs and where it writes
    threads_arg()                          the `--threads` setting of both runs
    RUN_CONFIG, CHECKPOINTS_DIR,           the run folder's layout, and the check that a folder may take a new run
      holds_run, check_output_dir
    installed_version()                    the installed coreformer's version, from its metadata (nothing imported)

Each run raises its own subclass of RunError, so a script catches exactly its run's refusals; a message reads the
same whichever module found it. `coreformer.training.arguments` re-exports all of this beside the parts that need
the package (output-folder checks, the export itself).
"""

import argparse
import copy
import dataclasses
import json
import typing
from collections.abc import Iterable, Sequence
from dataclasses import field
from importlib import metadata
from pathlib import Path
from typing import Any

from .exports import RUN_EXPORT_FORMATS

_UNION_TYPE = type(int | None)


def installed_version() -> str:
    """The installed coreformer's version (from its metadata, so nothing heavy is imported)."""
    try:
        return metadata.version("coreformer")
    except metadata.PackageNotFoundError:  # a source tree on sys.path without an install
        return "unknown (not installed; run `pip install -e .`)"


class RunError(ValueError):
    """One clear message about a bad input; raised before anything in the output directory is touched."""


class PretrainingError(RunError):
    """A bad input to a pretraining run."""


class FinetuningError(RunError):
    """A bad input to a fine-tuning run."""


INTERRUPTED = 130  # the exit status a shell gives a program stopped by Ctrl-C (128 + SIGINT)


class RunStoppedError(Exception):
    """Ctrl-C during a run; the message is the one line a script prints: the step reached and how to go on."""


class RunSettings:
    """The base of both runs' settings dataclasses. `error` is the run's RunError subclass."""

    error: typing.ClassVar[type[RunError]] = RunError

    @classmethod
    def cli_fields(cls) -> list[dataclasses.Field]:
        """The fields the CLI exposes as flags, in declaration order."""
        return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]

    @classmethod
    def setting_names(cls) -> list[str]:
        """The names `resolve` takes: the fields (a subclass adds settings it gathers into one field)."""
        return [spec.name for spec in dataclasses.fields(cls)]

    @classmethod
    def resolve(cls, values: dict[str, Any], *, source: str | None = None) -> "RunSettings":
        """Settings from a mapping of names to raw values (a config file updated by the flags given): unknown names
        are refused with the known ones, each value is coerced to its field's type."""
        hints, known = typing.get_type_hints(cls), cls.setting_names()
        unknown = sorted(set(values) - set(known))
        if unknown:
            where = f" in {source}" if source else ""
            raise cls.error(f"Unknown setting(s) {', '.join(unknown)}{where}; known: {', '.join(sorted(known))}.")
        return cls(**{name: coerce(name, value, hints[name], error=cls.error) for name, value in values.items()})

    def check_choices(self, **allowed: Sequence[str]) -> None:
        for name, choices in allowed.items():
            if getattr(self, name) not in choices:
                raise self.error(f"`{name}` must be one of {', '.join(choices)}; got {getattr(self, name)!r}.")

    def check_at_least(self, minimum: int, names: Iterable[str], *, unset_ok: bool = False, note: str = "") -> None:
        """Each named setting is >= minimum (None passes when `unset_ok`); `note` follows the bound in the message."""
        for name in names:
            value = getattr(self, name)
            if not (unset_ok and value is None) and value < minimum:
                raise self.error(f"`{name}` must be >= {minimum}{note}, got {value}.")

    def check_between(self, name: str, low: float, high: float, *, low_open: bool, high_open: bool) -> None:
        """`name` lies between `low` and `high`, each end open or closed as given."""
        value = getattr(self, name)
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (above and below):
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise self.error(f"`{name}` must be in {interval}, got {value}.")

    def check_positive(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) <= 0:
                raise self.error(f"`{name}` must be > 0, got {getattr(self, name)}.")


def arg(default: Any, help: str, **metadata: Any) -> Any:  # noqa: A002 - `help` reads as argparse's
    """A dataclass field with `help` (and any other CLI metadata); a dict default becomes a per-instance copy."""
    if isinstance(default, dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def load_config_file(path: str | Path, *, error: type[Exception] = ValueError) -> dict[str, Any]:
    """A YAML (.yaml/.yml) or JSON (.json) run config. Top-level keys that start with "_" are comments (JSON has no
    other kind) and are dropped. Every problem with the file raises `error`."""
    path = Path(path)
    if not path.is_file():
        raise error(f"Config file {str(path)!r} does not exist.")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            values = json.loads(text)
        elif path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            # libyaml's safe loader where PyYAML has it (the same values, read faster: every command's --help reads
            # every preset file); PyYAML's own otherwise.
            values = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        else:
            raise error(f"Config file {str(path)!r}: expected a .yaml, .yml or .json file.")
    except (json.JSONDecodeError, ImportError) as problem:
        raise error(f"Config file {str(path)!r} does not parse: {problem}") from problem
    except Exception as problem:  # yaml.YAMLError, without importing yaml at module level
        if type(problem).__module__.startswith("yaml"):
            raise error(f"Config file {str(path)!r} does not parse: {problem}") from problem
        raise
    if not isinstance(values, dict):
        raise error(f"Config file {str(path)!r} must hold a mapping of settings.")
    return {key: value for key, value in values.items() if not str(key).startswith("_")}


def coerce(name: str, value: Any, annotation: Any, *, error: type[Exception] = ValueError) -> Any:
    """Turn a config-file or CLI value into the field's type (YAML reads 1e-3 as a string, for instance)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, _UNION_TYPE) else ()
    if options:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        annotation = next(option for option in options if option is not type(None))
    if annotation is dict:
        return value
    try:
        if annotation is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if annotation is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if annotation is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError) as problem:
        raise error(f"`{name}` must be {annotation.__name__}, got {value!r}.") from problem


def _flag_type(annotation: Any) -> Any:
    """int | None -> int; the library checks and converts again, this only gives argparse a parser."""
    options = [option for option in typing.get_args(annotation) if option is not type(None)]
    return options[0] if options else annotation


def add_flags(
    parser: argparse.ArgumentParser,
    arguments: type,
    fields: Iterable[dataclasses.Field],
    *,
    underscore_names: bool = False,
    default_text: dict[str, str] | None = None,
) -> None:
    """Add a flag per field of the dataclass `arguments`: `--field-name`, also `--field_name` when
    `underscore_names`, and the names in metadata["aliases"] (transformers' example scripts' names).

    Every flag defaults to argparse.SUPPRESS: the parsed namespace holds only the flags given on the command line,
    which override the preset or config file. Booleans are store_true switches; other flags show their default in
    the help unless metadata["show_default"] is False; `default_text` replaces the shown default of the fields it
    names (where a preset, not the dataclass, decides).
    """
    default_text = default_text or {}
    hints = typing.get_type_hints(arguments)
    for spec in fields:
        names = ["--" + spec.name.replace("_", "-")]
        underscored = ("--" + spec.name,) if underscore_names else ()
        names += [name for name in (*underscored, *spec.metadata.get("aliases", ())) if name not in names]
        kind = _flag_type(hints[spec.name])
        help_text = spec.metadata["help"]
        options = dict(dest=spec.name, default=argparse.SUPPRESS)
        if kind is bool:
            parser.add_argument(*names, action="store_true", help=help_text, **options)
            continue
        choices = spec.metadata.get("choices")
        parser.add_argument(
            *names,
            type=kind,
            choices=choices,
            metavar=None if choices else spec.name.split("_")[-1].upper(),
            help=f"{help_text} (default: {default_text.get(spec.name, spec.default)})"
            if spec.metadata.get("show_default", True)
            else help_text,
            **options,
        )


EXPORT_FOLDER = "native"  # inside the run folder


def threads_arg() -> Any:
    """The `--threads` setting of both runs (coreformer.training.threads decides the default)."""
    return arg(
        None,
        "torch threads of each process (default: the cores this process may use, less those other processes keep "
        "busy; OMP_NUM_THREADS sets it too)",
        show_default=False,
    )


RUN_CONFIG = "run_config.json"  # the run's settings, in the run folder and in each checkpoint
CHECKPOINTS_DIR = "checkpoints"  # the run folder's checkpoints/step-N


def holds_run(folder: Path, markers: Sequence[str]) -> bool:
    """Whether `folder` holds a previous run: any of the files or folders a run writes (`markers`)."""
    return any((folder / marker).exists() for marker in markers)


def check_output_dir(
    output_dir: Path, overwrite: bool, *, markers: Sequence[str], error: type[Exception], otherwise: str
) -> None:
    """Refuse a folder that holds something, unless it is a previous run (see `holds_run`) and `overwrite` is set.
    `otherwise` ends the message for a run folder without `overwrite`: what else the user can do. Torch-free, so
    the command line checks the folder before the heavy imports."""
    if output_dir.exists() and not output_dir.is_dir():
        raise error(f"--output-dir {str(output_dir)!r} is a file.")
    if not output_dir.is_dir() or not any(output_dir.iterdir()):
        return
    if not holds_run(output_dir, markers):
        raise error(
            f"--output-dir {str(output_dir)!r} is not empty and holds no previous run; choose an empty or new folder "
            f"(--overwrite only replaces a run folder)."
        )
    if not overwrite:
        raise error(
            f"--output-dir {str(output_dir)!r} already holds a run. Pass --overwrite to replace it, or {otherwise}."
        )


def export_arg() -> Any:
    """The `--export` setting of both runs."""
    return arg(
        None,
        f"after training, also write OUTPUT_DIR/{EXPORT_FOLDER}: the model as transformers' own architecture, served "
        f"without coreformer (`coreformer export`; skipped with the reason when no native architecture computes the "
        f"same function)",
        choices=RUN_EXPORT_FORMATS,
    )
