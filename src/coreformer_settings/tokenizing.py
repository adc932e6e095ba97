"""The settings of `coreformer tokenize` (coreformer.training.shards), importable without torch: its flags, its checks,
and the half of a shard folder's rules that needs no tokenizer.

    TokenizeSettings                          what `coreformer tokenize` reads, where it writes, and how it shards
    DESCRIPTION, add_arguments(parser)        `--help`'s text and the flags
    prepare(args, parser) -> TokenizeSettings the command line's checks: the numbers, SOURCE, --tokenizer and OUT
    ShardsError                               a refused input, or a folder of other shards (a PretrainingError: the
                                              shards are pretraining's input, and a run prints it as one line)
    MANIFEST, FORMAT_VERSION                  the shard folder's record and the version of its layout
    source_record(source, config) -> dict     what a manifest records of a source: its name, and its local files
                                              with their sizes (so a file changed since is noticed)
    check_output_folder(out)                  OUT may be written: absent, empty, or a shard folder
    check_same_recipe(manifest, settings)     a rerun into OUT continues the same source and settings, or is refused
    check_shard_folder(folder) -> manifest    a folder pretraining may read (--data-dir): complete shards of our
                                              format
    shard_tokenizer(folder, manifest)         the tokenizer the shards were made with: the copy saved beside them

The command line (coreformer_cli) runs `prepare` before anything heavy is imported; the writer
(coreformer.training.shards.write_shards) runs the same checks again, since it can be called without the command line,
and then the one check that needs the tokenizer loaded: its content hash against the manifest's.
"""

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import PretrainingError
from .command_line import check_model_location
from .data_sources import local_builder

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"  # the tokenizer's files, saved beside the shards once they are complete
FORMAT_VERSION = 1  # raised whenever a reader of the old layout would misread the new one
DEFAULT_SHARD_TOKENS = 100_000_000  # nanoGPT's FineWeb shards: 200 MB of uint16 per file, few files per corpus
DEFAULT_VALIDATION_FRACTION = 0.05  # pretraining's --validation-fraction default


class ShardsError(PretrainingError):
    """A bad input to `coreformer tokenize`, or shards that do not match what reads them; one line, the fix in it."""


@dataclass(frozen=True)
class TokenizeSettings:
    """What `coreformer tokenize` reads, where it writes, and how it shards."""

    source: str  # a local file or glob (.txt: one document per non-blank line), or a Hub dataset name
    out: str  # the shard folder
    tokenizer: str  # a tokenizer folder (a run's output) or a Hub name
    text_column: str = "text"
    dataset_config: str | None = None  # a Hub dataset's configuration
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # a shard is closed at the first document that takes it to this many
    num_proc: int = 1  # tokenizing processes; the files do not depend on it
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION  # held-out share, chosen by document hash
    seed: int = 0  # salts the document hash

    def recipe(self) -> dict[str, Any]:
        """What decides the shards' bytes besides the tokenizer: a rerun into the same folder must repeat it.
        `num_proc` is not in it: the files are the same for any number of processes."""
        return {
            "source": source_record(self.source, self.dataset_config),
            "text_column": self.text_column,
            "shard_tokens": self.shard_tokens,
            "validation_fraction": self.validation_fraction,
            "seed": self.seed,
        }


DESCRIPTION = """\
Tokenize text once into shards of token ids that pretraining reads by memory map.

    coreformer tokenize "data/*.jsonl" data/shards --tokenizer outputs/decoder-tiny --num-proc 8
    coreformer tokenize wikitext data/wikitext --dataset-config wikitext-103-raw-v1 --tokenizer gpt2

OUT gets manifest.json (the source, the tokenizer's name and content hash, the counts, each completed shard) and
train-00000.bin, train-00001.bin, ..., validation-00000.bin: token ids, uint16 when the vocabulary fits 65536 ids
(uint32 otherwise), documents back to back, each .bin beside a .idx of where its documents end (the layout:
coreformer.training.shards). A .txt file gives one document per non-blank line, other files one per row. The
held-out split is the source's own validation split when it has one, else the documents whose hash (salted with
--seed) falls under --validation-fraction: the same documents on every run, whatever --num-proc.

Each shard is written under a temporary name and renamed when whole; the manifest records it then. Rerun the same
command after a stop or a crash to go on from the last shard written (the files come out as if it had never
stopped); OUT holding shards of another source, settings or tokenizer is refused, naming both.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="SOURCE",
        help="a local file or glob (.txt/.json/.jsonl/.csv/.parquet; quote globs), or a datasets Hub name",
    )
    parser.add_argument("out", metavar="OUT", help="the shard folder to write (created; a rerun continues it)")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder (a run's output) or Hub name")
    parser.add_argument("--text-column", default="text", help="column holding the text (default: %(default)s)")
    parser.add_argument("--dataset-config", default=None, help="configuration of a Hub dataset")
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help="close a shard at the first document that takes it to N ids; documents are never cut "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--num-proc",
        type=int,
        default=1,
        metavar="P",
        help="tokenizing processes of one thread each; 1 (the default) tokenizes here, on every core through "
        "`tokenizers`' threads, but converts the ids on one",
    )
    parser.add_argument(
        "--validation-fraction",
        type=float,
        default=DEFAULT_VALIDATION_FRACTION,
        metavar="F",
        help="held-out share of documents, chosen by hash, when the source has no validation split "
        "(default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="salts the document hash (default: 0)")


def settings_from(namespace: argparse.Namespace) -> TokenizeSettings:
    """The parsed arguments as settings; ShardsError names a number out of range."""
    for name in ("shard_tokens", "num_proc"):
        if getattr(namespace, name) < 1:
            raise ShardsError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(namespace, name)}.")
    if not (0.0 <= namespace.validation_fraction < 1.0 and math.isfinite(namespace.validation_fraction)):
        raise ShardsError(f"--validation-fraction must be in [0, 1), got {namespace.validation_fraction}.")
    return TokenizeSettings(
        source=namespace.source,
        out=namespace.out,
        tokenizer=namespace.tokenizer,
        text_column=namespace.text_column,
        dataset_config=namespace.dataset_config,
        shard_tokens=namespace.shard_tokens,
        num_proc=namespace.num_proc,
        validation_fraction=namespace.validation_fraction,
        seed=namespace.seed,
    )


def prepare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TokenizeSettings:
    """The command line's checks, each one line before torch is imported: the numbers, a missing or empty SOURCE
    file, a mistyped --tokenizer folder, OUT that is a file or a folder of something else, or shards in OUT made from
    another source or with other settings."""
    settings = settings_from(args)
    source_record(settings.source, settings.dataset_config)  # a missing file, before `datasets` is imported
    check_model_location(settings.tokenizer)
    manifest = check_output_folder(Path(settings.out).expanduser())
    if manifest is not None:
        check_same_recipe(manifest, settings)
    return settings


def source_record(source: str, config: str | None = None) -> dict[str, Any]:
    """The manifest's record of a source: the name as given, its Hub configuration, and for a local source each
    file's absolute path and size. ShardsError for a local file that is missing, empty or of an unknown kind."""
    try:
        _, files = local_builder(source)
    except ValueError as refusal:
        raise ShardsError(str(refusal)) from None
    record: dict[str, Any] = {"name": source, "config": config}
    if files is not None:
        record["files"] = [[str(Path(file).resolve()), os.path.getsize(file)] for file in files]
    return record


def check_output_folder(out: Path) -> dict[str, Any] | None:
    """The manifest of the shard folder at `out`, None when `out` is absent or empty; ShardsError when it is a file,
    or a non-empty folder without a manifest (it holds something else, which the shards would be written among)."""
    if out.exists() and not out.is_dir():
        raise ShardsError(f"{out} is a file; OUT must be a folder (new, empty, or one `coreformer tokenize` wrote).")
    # a temporary file alone is what a run stopped while writing its first manifest leaves
    if not out.is_dir() or all(_temporary(path) for path in out.iterdir()):
        return None
    if not (out / MANIFEST).is_file():
        raise ShardsError(
            f"{out} is not empty and holds no {MANIFEST}: it is not a shard folder; pass a new or empty folder."
        )
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise ShardsError(f"{out / MANIFEST} cannot be read ({error}); delete {out} and tokenize again.") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ShardsError(
            f"{out} holds shards of format {manifest.get('format')!r}; this coreformer writes format "
            f"{FORMAT_VERSION}: tokenize into another folder."
        )
    return manifest


def check_shard_folder(folder: str | Path) -> dict[str, Any]:
    """The manifest of the shard folder pretraining reads (--data-dir); ShardsError when it is not one or is not
    complete, each naming the fix."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ShardsError(f"--data-dir {folder}: no such folder; pass a folder `coreformer tokenize` wrote.")
    if not (path / MANIFEST).is_file():
        raise ShardsError(
            f"--data-dir {folder} holds no {MANIFEST}: not a shard folder; write one with `coreformer tokenize "
            f"SOURCE {folder} --tokenizer T`, or pass text files with --dataset."
        )
    manifest = check_output_folder(path)
    assert manifest is not None  # it holds a manifest
    if not manifest["complete"]:
        raise ShardsError(
            f"--data-dir {folder} is not complete: `coreformer tokenize` stopped before its last shard; run the same "
            f"command again to finish it."
        )
    return manifest


def shard_tokenizer(folder: str | Path, manifest: dict[str, Any]) -> str:
    """Where to load the shards' tokenizer from: the copy `coreformer tokenize` saved beside them, else (a folder
    written before it saved one) the name it was given."""
    saved = Path(folder).expanduser() / TOKENIZER_DIR
    return str(saved) if saved.is_dir() else manifest["tokenizer"]["name"]


def check_same_recipe(manifest: dict[str, Any], settings: TokenizeSettings) -> None:
    """Refuse, naming both, a rerun into a shard folder made from another source or with other settings: continuing
    it would mix two corpora (or two shardings) in one folder."""
    recorded, given = manifest["recipe"], settings.recipe()
    out, before, after = settings.out, recorded["source"], given["source"]
    if (before["name"], before["config"]) != (after["name"], after["config"]):
        raise ShardsError(
            f"{out} holds shards of {_source_name(before)}, not of {_source_name(after)}: tokenize into another folder."
        )
    if before != after:  # the same name, other files or sizes
        raise ShardsError(
            f"the files of {after['name']!r} changed since {out} was written ({_changed_files(before, after)}): "
            f"tokenize into another folder."
        )
    for key, value in given.items():
        if recorded.get(key) != value:
            flag = "--" + key.replace("_", "-")
            raise ShardsError(
                f"{out} was tokenized with {flag} {recorded.get(key)!r}, not {value!r}: rerun with "
                f"{flag} {recorded.get(key)}, or tokenize into another folder."
            )


def _temporary(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _source_name(record: dict[str, Any]) -> str:
    return repr(record["name"]) + (f" ({record['config']})" if record.get("config") else "")


def _changed_files(recorded: dict[str, Any], given: dict[str, Any]) -> str:
    before, after = dict(recorded.get("files", [])), dict(given.get("files", []))
    changes = [
        f"{path}: {before.get(path, 'absent')} -> {after.get(path, 'absent')} bytes"
        for path in sorted(set(before) | set(after))
        if before.get(path) != after.get(path)
    ]
    return "; ".join(changes[:3]) + (f"; {len(changes) - 3} more" if len(changes) > 3 else "")
