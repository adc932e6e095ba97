"""The embedded corpora: real text found on every machine, the Python standard library's own source.

    stdlib_root()                          the running interpreter's standard library folder
    stdlib_source_files(package=None)      its .py files (one package, or all outside the skipped folders), sorted
    read_source(path)                      a file's text, None when it is not readable UTF-8
    stdlib_definitions()                   every documented function and class of EMBEDDED_PACKAGES (cached)
    first_paragraph / seeded_sample / split_rows    the pieces every task's embedded dataset is built from

The pretraining corpus (`data.load_embedded_corpus`) is every readable source file, one document each; the
fine-tuning tasks' embedded datasets (tasks/*.py) are facts about the definitions of four packages (asyncio, email,
logging, xml: in every CPython 3 since 3.4, about 1.3 MB of source, parsed in ~0.4 s). Both read files through
`read_source`, so the two see the same text. Whatever the interpreter ships is what they hold: identical across
runs on one installation, not across Python versions.
"""

import ast
import os
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import datasets

# Directories of the standard library that are not its own prose and code: third-party packages, test suites (large,
# repetitive, full of deliberately broken text), and `encodings`, whose ~120 modules are generated charmap tables so
# alike that splitting them between train and validation would leak one into the other.
_SKIPPED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
)
EMBEDDED_PACKAGES = ("asyncio", "email", "logging", "xml")  # what the fine-tuning tasks' embedded datasets read
EMBEDDED_SEED = 0  # fixed: the embedded datasets are the same whatever the run's --seed
EMBEDDED_VALIDATION = 0.2


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(package: str | None = None) -> list[Path]:
    """The .py files of the standard library (or of one of its packages) outside `_SKIPPED_STDLIB_DIRS`, sorted, so
    the list is the same every call."""
    root = stdlib_root() / package if package else stdlib_root()
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in _SKIPPED_STDLIB_DIRS]  # prune the walk
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files)


def read_source(path: Path) -> str | None:
    """The text of a source file, or None when it cannot be read or is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class Definition:
    package: str
    path: str  # relative to the standard library root
    lineno: int
    name: str
    kind: str  # "function" | "class"
    doc: str
    params: tuple[tuple[str, str | None], ...]  # (name, default source) of ordinary parameters, self/cls dropped
    source: str  # dedented, docstring included
    source_without_doc: str


def _strip_lines(lines: list[str], start: int, stop: int) -> str:
    return textwrap.dedent("".join(lines[:start] + lines[stop:])).rstrip() + "\n"


@lru_cache(maxsize=1)
def stdlib_definitions() -> tuple[Definition, ...]:
    """Every function and class with a docstring in EMBEDDED_PACKAGES, in file and line order."""
    root = stdlib_root()
    found = []
    for package in EMBEDDED_PACKAGES:
        for path in stdlib_source_files(package):
            found.extend(_definitions_in(package, path, root))
    found.sort(key=lambda d: (d.path, d.lineno))
    return tuple(found)


def _definitions_in(package: str, path: Path, root: Path) -> list[Definition]:
    """The documented functions and classes of one source file (none when it does not read or parse)."""
    source = read_source(path)
    try:
        tree = ast.parse(source) if source is not None else None
    except SyntaxError:
        tree = None
    if tree is None:
        return []
    found = []
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or not doc.strip():
            continue
        params: list[tuple[str, str | None]] = []
        if not isinstance(node, ast.ClassDef):
            positional = node.args.posonlyargs + node.args.args
            defaults = [None] * (len(positional) - len(node.args.defaults)) + list(node.args.defaults)
            for argument, default in zip(positional, defaults, strict=True):
                if argument.arg not in ("self", "cls"):
                    params.append((argument.arg, None if default is None else ast.unparse(default)))
        first, last = node.lineno - 1, node.end_lineno  # the def / class line (after decorators) .. end
        body = lines[first:last]
        doc_node = node.body[0]
        found.append(
            Definition(
                package=package,
                path=path.relative_to(root).as_posix(),
                lineno=node.lineno,
                name=node.name,
                kind="class" if isinstance(node, ast.ClassDef) else "function",
                doc=doc,
                params=tuple(params),
                source=textwrap.dedent("".join(body)).rstrip() + "\n",
                source_without_doc=_strip_lines(body, doc_node.lineno - 1 - first, doc_node.end_lineno - first),
            )
        )
    return found


def first_paragraph(doc: str, limit: int = 300) -> str:
    """A docstring's first paragraph on one line, cut at `limit` characters."""
    return " ".join(doc.strip().split("\n\n")[0].split())[:limit]


def seeded_sample(items: list, count: int) -> list:
    """`count` of `items` in an order fixed by EMBEDDED_SEED (whatever the run's --seed)."""
    items = list(items)
    random.Random(EMBEDDED_SEED).shuffle(items)
    return items[:count]


def split_rows(rows: list[dict]) -> datasets.DatasetDict:
    """Rows (already in a seeded order) -> train / validation, the last 20% held out."""
    held_out = max(1, round(len(rows) * EMBEDDED_VALIDATION))
    columns = list(rows[0])
    return datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({column: [row[column] for row in part] for column in columns})
            for name, part in (("train", rows[:-held_out]), ("validation", rows[-held_out:]))
        }
    )
