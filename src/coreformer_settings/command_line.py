"""The command line's shared parts, importable without torch: what every coreformer command line uses.

    add_version_argument(parser)         `--version` for any coreformer command line (training scripts too)
    SuggestingParser                     argparse, naming the closest known flag to an unknown one
    check_model_location(name) -> name   a local folder, or a Hub repo id; NoSuchFolderError for a local-looking path
                                         that does not exist, or a Hub id while the Hub is offline or unreachable (in
                                         one connection attempt, before any Hub call and its retries)
    check_local_folder(name) -> name     an existing local folder; NoSuchFolderError otherwise
    hub_unreachable(), in_hub_cache(repo_id), looks_local(name)   what those checks ask
    USAGE_ERROR, HUB_FAILED              the exit codes of a bad input and of a refused upload (INTERRUPTED: base.py)

The `coreformer` command line (coreformer_cli) and the package's command handlers (coreformer.commands) build on
these, so the package never imports the command line.
"""

import argparse
import difflib
import os
import re
import socket
import urllib.parse
from pathlib import Path

from .base import installed_version as version

USAGE_ERROR = 2  # argparse's exit code for a bad command line; a missing folder or a refused setting is one too
HUB_FAILED = 1  # `publish`: the Hub refused or failed the upload


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    """Give `parser` a `--version` that prints `coreformer <version>` and exits 0."""
    parser.add_argument(
        "--version", action="version", version=f"coreformer {version()}", help="print the version and exit"
    )


def flag_words(flag: str) -> set[str]:
    """The words of a flag: "--num_train-epochs" -> {"num", "train", "epochs"}."""
    return set(re.split(r"[-_]+", flag.strip("-").lower()))


def closest_flag(given: str, known: list[str]) -> str | None:
    """The known flag `given` most likely meant: among the flags holding every word of it (`--epochs` ->
    `--num-train-epochs`), else among all, the closest spelling; None where nothing is close (`--epochs` is not
    `--export`, 0.62 alike: the cutoff sits above that and below `--save-steps` / `--save-every`, 0.67)."""
    name = given.split("=")[0]
    holding = [flag for flag in known if flag_words(name) <= flag_words(flag)]
    candidates = holding or known
    if "_" not in name:  # the hyphenated spelling of a flag that also takes transformers' underscored one
        candidates = [flag for flag in candidates if "_" not in flag] or candidates
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.0 if holding else 0.65)
    return close[0] if close else None


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose "unrecognized arguments" error names the closest known flag (`--lerning-rate` ->
    "did you mean --learning-rate?", `closest_flag`); Python 3.12's argparse suggests only for choices, and 3.11's
    not at all."""

    def error(self, message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = [option for option in self._option_string_actions if option.startswith("--")]
            for given in message[len(prefix) :].split():
                close = closest_flag(given, known) if given.startswith("--") else None
                if close:
                    message += f" (did you mean {close}?)"
                    break
        super().error(message)


class NoSuchFolderError(ValueError):
    """A path meant as a local folder does not exist."""


# A Hub repo id: "name" or "owner/name"; each part starts with a letter or digit, has no "--" or "..", and does not
# end with "-" or "." (huggingface_hub's validate_repo_id, written out so that nothing is imported).
_HUB_ID_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?:{_HUB_ID_PART}/)?{_HUB_ID_PART}")
_LOCAL_PREFIXES = ("./", "../", "/", "~", ".\\", "..\\")


def looks_local(name: str) -> bool:
    """True when `name` can only be meant as a local path: it starts with ./ ../ / or ~, has more than one slash, is
    not a valid Hub repo id, or its first part is an existing local folder (`outputs/run` where `outputs/` exists)."""
    if name.startswith(_LOCAL_PREFIXES) or name.count("/") > 1 or name in (".", ".."):
        return True
    if not _HUB_ID.fullmatch(name) or "--" in name or ".." in name:
        return True
    return "/" in name and Path(name).parent.is_dir()


_TRUE = ("1", "ON", "YES", "TRUE")
_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable() -> str | None:
    """Why the Hub cannot be asked right now (offline mode, or its endpoint refuses or does not answer a connection
    within 3 s), or None. One connection attempt, no retries: huggingface_hub's own retries take a minute."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").upper() in _TRUE:
            return f"{variable} is set"
    if any(os.environ.get(variable) for variable in _PROXIES):
        return None  # the connection goes through a proxy: let huggingface_hub make it
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urllib.parse.urlsplit(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except OSError as error:
        return f"the Hub at {endpoint} cannot be reached ({error.strerror or type(error).__name__})"
    return None


def in_hub_cache(repo_id: str) -> bool:
    """True when the local Hub cache holds something of the model repository `repo_id` (it loads offline)."""
    from huggingface_hub import constants  # torch-free, light

    return (Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}").is_dir()


def check_model_location(name: str | Path) -> str:
    """Return `name` when it is an existing local path or a Hub repo id the Hub can be asked for; raise
    NoSuchFolderError (one line naming what is missing and what to pass) when it looks local and does not exist, or
    when it is a Hub id, not in the local cache, and the Hub is offline or unreachable (instead of a minute of
    retries)."""
    name = str(name)
    path = Path(name).expanduser()
    if path.exists():
        return name
    if looks_local(name):
        raise NoSuchFolderError(
            f"no such folder: {name} (looked for {path.resolve()}); check the path, or pass a Hub repo id like "
            f"owner/name."
        )
    if not in_hub_cache(name) and (reason := hub_unreachable()) is not None:
        raise NoSuchFolderError(
            f"{name} is not a local folder, and the Hub cannot be asked for it: {reason}; check the name, or pass a "
            f"local folder (./{name} if you meant one here)."
        )
    return name


def check_local_folder(name: str | Path) -> str:
    """Return `name` when it is an existing local folder; NoSuchFolderError otherwise (for inputs never fetched)."""
    path = Path(name).expanduser()
    if not path.is_dir():
        what = "not a folder" if path.exists() else "no such folder"
        raise NoSuchFolderError(f"{what}: {name} (looked for {path.resolve()}); pass a local checkpoint folder.")
    return str(name)
