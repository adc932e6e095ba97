"""Where a run's data comes from, decided without torch or `datasets`: a local file (or glob) by its extension, or a
Hub dataset name. The command line checks a run's data sources with these before the heavy imports; the runs load
them with the same functions (coreformer.training.data), so a missing file gets one message, at once.

    DATA_BUILDERS                                    file extension -> `datasets` builder (one map)
    local_builder(source) -> (builder, files)        a local source's builder and files, (None, None) for a Hub name;
                                                     ValueError for a local file that is missing, empty or unreadable
    local_data(source, must_be_local=..., error=...)   the same, the ValueError raised as the run's own error
"""

import glob
import os
from pathlib import Path

# File extension -> `datasets` builder. A .txt file gives one example per line (pass `sample_by="document"` through
# `load_text_dataset(**load_kwargs)` for one per file).
DATA_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}


def local_builder(source: str) -> tuple[str | None, list[str] | None]:
    """(builder, files) for a local source, (None, None) for a Hub name; raises the local-file ValueErrors."""
    path = Path(source).expanduser()
    is_glob = any(char in source for char in "*?[")
    files = sorted(glob.glob(str(path))) if is_glob else None
    suffix = path.suffix.lower()
    # A Hub name is "name" or "owner/name"; anything that exists, looks like a path, or ends in a data extension is
    # local, so a typo in a file name is reported here instead of becoming a Hub request.
    looks_local = (
        is_glob
        or path.exists()
        or source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or "\\" in source  # a Windows path; Hub names never hold a backslash
        or suffix in DATA_BUILDERS
    )
    if not looks_local:
        return None, None
    if files is None:
        if not path.exists():
            raise ValueError(f"Local data file {source!r} does not exist.")
        if path.is_dir():
            raise ValueError(f"{source!r} is a directory; pass a file or a glob such as '{source}/*.jsonl'.")
        files = [str(path)]
    if not files:
        raise ValueError(f"No local data file matches {source!r}.")
    if suffix not in DATA_BUILDERS:
        raise ValueError(
            f"Cannot load {source!r}: unknown extension {suffix or '(none)'!r}; expected one of "
            f"{', '.join(DATA_BUILDERS)}."
        )
    if all(os.path.getsize(file) == 0 for file in files):  # `datasets` fails on empty files with no useful message
        raise ValueError(f"{source!r} is empty: no text to train on.")
    return DATA_BUILDERS[suffix], files


def local_data(source: str, *, must_be_local: bool = False, error: type[Exception] = ValueError) -> tuple:
    """`local_builder(source)` with its refusals raised as `error`; `must_be_local` refuses a Hub name too (a
    `--train-file` that does not exist)."""
    try:
        builder, files = local_builder(source)
    except ValueError as refusal:
        raise error(str(refusal)) from None
    if builder is None and must_be_local:
        raise error(f"Data file {source!r} does not exist.")
    return builder, files
