"""Model folders on disk: atomic saves, and loading the tokenizer a folder should hold.

Atomic saves: every folder coreformer writes (a converted model, a fine-tuned run, a training checkpoint) is
filled in a hidden sibling and swapped into place in one step, so a kill at any moment leaves either the previous
folder or the new one at the destination, never a mix and never nothing.

    with staged_folder(destination) as staging:   # .NAME.partial-HOST-PID-TOKEN, deleted if the block raises
        model.save_pretrained(staging)
    # here `destination` is the new folder; the previous one is gone

On Linux the swap is renameat2(RENAME_EXCHANGE), one system call; elsewhere (or on filesystems without it) it is two
renames, with a moment in which the previous folder sits at .NAME.replaced-HOST-PID-TOKEN. Leftovers of killed saves
are removed (or put back) by the next save to the same destination. Before the swap every file in the folder gets the
mode the user's umask gives new files (0644 under the usual 022): transformers writes the weights through a private
temporary file (0600), which would otherwise be the one file others cannot read.

A run started over in its folder (`--overwrite`) moves the previous run aside (`set_aside`, to .NAME.overwritten)
instead of deleting it; the new run drops it once it has saved something of its own (`drop_set_aside`) and puts it
back if it stops before that (`restore_set_aside`), so a stopped rerun never leaves the user with less than before.

`prepare_for_serving(folder, causal_lm=...)` readies an exported folder for plain transformers: no `auto_map` naming
code the folder does not hold, and a decoder's tokenizer padding on the left. `folder_tokenizer(folder)` loads a local
folder's tokenizer, or says that the folder has none and how to add one
(transformers' own error for a missing tokenizer is about sentencepiece).
"""

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path


class DestinationExistsError(ValueError):
    """A destination holds something and replacing it was not asked for. Its text speaks to Python callers
    (`overwrite=True`); the commands print `command_line_message()` (`--overwrite`)."""

    def __init__(self, path: Path, state: str = "exists and is not empty"):
        self.path, self.state = path, state
        super().__init__(f"{path} {state}; pass overwrite=True to replace it.")

    def command_line_message(self) -> str:
        return f"{self.path} {self.state}; pass --overwrite to replace it."


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse a destination that is a file, or a folder with something in it unless `overwrite`."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DestinationExistsError(out)


_AT_FDCWD = -100  # paths relative to the working directory (linux/fcntl.h)
_RENAME_EXCHANGE = 2  # linux/fs.h


@cache
def _renameat2():
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return getattr(libc, "renameat2", None)  # glibc >= 2.28


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one atomic step; False where the system or filesystem cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def replace_folder(staging: Path, destination: Path) -> None:
    """Put the finished folder `staging` at `destination`, replacing (and deleting) whatever is there."""
    if not destination.exists():
        staging.rename(destination)
        return
    if exchange(staging, destination):
        shutil.rmtree(staging)  # it now holds the previous folder
        return
    retired = destination.with_name(f".{destination.name}.replaced-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    destination.rename(retired)
    staging.rename(destination)
    shutil.rmtree(retired)


_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _staging_name(destination: Path, pid: int, token: str) -> str:
    # Host, pid and a random token: saves from other machines (a shared filesystem) or other pid namespaces never
    # take one another's folder, and a leftover can be told stale only where its pid can be asked about.
    return f".{destination.name}.partial-{_HOST}-{pid}-{token}"


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_saves(parent: Path, name: str | None = None) -> None:
    """Delete what killed saves into `parent` (to its entry `name`, or to any) on this machine left behind, once
    their process is gone: a staged folder is deleted, a previous folder caught between the fallback's two renames is
    put back. Live saves, and saves from other machines, are left alone."""
    if not parent.is_dir():
        return
    target = re.escape(name) if name is not None else ".+"
    leftover = re.compile(rf"\.({target})\.(partial|replaced)-{re.escape(_HOST)}-(\d+)-\w+")
    for path in parent.iterdir():
        match = leftover.fullmatch(path.name)
        if match is None or _is_running(int(match.group(3))):
            continue
        destination = parent / match.group(1)
        if match.group(2) == "replaced" and not destination.exists():
            path.rename(destination)
        elif path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)


def link_into(source: Path, target: Path) -> None:
    """Give `target` what `source` holds without copying data: hard links to its files (recursively for a folder).

    For carrying a run's checkpoints and logs into the staged replacement of its folder: the links share the files,
    so the swap moves nothing and deleting the replaced folder deletes only its links.
    """
    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(str(source), str(target))


def umask() -> int:
    """The process's umask, read without changing it where the system shows it (/proc), else set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normalize_modes(folder: Path) -> None:
    """Give every file under `folder` the mode a newly created file gets (0666 & ~umask; 0777 & ~umask when its
    owner may execute it). Symlinks and files of other users are left as they are."""
    mask = umask()
    for path in folder.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        mode = path.stat().st_mode & 0o777
        wanted = (0o777 if mode & 0o100 else 0o666) & ~mask
        if mode != wanted:
            with contextlib.suppress(PermissionError):
                path.chmod(wanted)


@contextlib.contextmanager
def staged_folder(
    destination: str | Path, *, main_process: bool = True, launcher_pid: int | None = None
) -> Iterator[Path]:
    """Yield an empty hidden sibling of `destination` to fill; when the block finishes it replaces `destination`
    atomically. When the block raises, `destination` is untouched and the sibling is deleted; when the process is
    killed, the sibling is left and the next save to `destination` deletes it. Its files get the umask's usual mode
    (`normalize_modes`) before the swap.

    `destination` is resolved first (through symlinks and ".."): the folder itself is replaced, and a process working
    inside it follows it to the new one.

    Multi-process launches (torchrun, accelerate launch): every process passes the launcher's pid (`os.getppid()`),
    so that all of them stage into one folder; only the process with `main_process=True` cleans up and swaps, the
    others only write into it (make them finish before the main process leaves the block).
    """
    destination = Path(destination).expanduser().resolve()
    destination.parent.mkdir(parents=True, exist_ok=True)
    if main_process:
        remove_stale_saves(destination.parent, destination.name)
    if launcher_pid is None:
        staging = destination.with_name(_staging_name(destination, os.getpid(), uuid.uuid4().hex[:8]))
    else:
        staging = destination.with_name(_staging_name(destination, launcher_pid, "launch"))
    staging.mkdir(exist_ok=launcher_pid is not None)  # a plain mkdir, unlike mkdtemp: the user's usual permissions
    try:
        yield staging
        if main_process:
            normalize_modes(staging)
            working = Path.cwd()
            replace_folder(staging, destination)
            if working == destination or destination in working.parents:
                # The old folder (this process's working directory) is gone: work in the new one instead.
                os.chdir(working if working.exists() else destination)
    except BaseException:
        if main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise


# Files of which a saved tokenizer has at least one (fast, WordPiece, BPE, SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")


def set_aside_path(folder: Path) -> Path:
    """Where a folder being started over waits until the new run has saved something (`set_aside`)."""
    return folder.with_name(f".{folder.name}.overwritten")


def set_aside(folder: Path) -> Path:
    """Move `folder` to `set_aside_path(folder)` and create it again, empty; returns where it went."""
    aside = set_aside_path(folder)
    folder.rename(aside)
    folder.mkdir()
    return aside


def restore_set_aside(folder: Path) -> bool:
    """Put the folder set aside for `folder` back in its place, deleting what `folder` holds now; False when none
    was set aside."""
    aside = set_aside_path(folder)
    if not aside.is_dir():
        return False
    replace_folder(aside, folder)
    return True


def drop_set_aside(folder: Path) -> None:
    """Delete the folder set aside for `folder` (the new run has saved something of its own)."""
    shutil.rmtree(set_aside_path(folder), ignore_errors=True)


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def saved_tokenizer(folder: str | Path):
    """The tokenizer saved in the local `folder` (`folder_tokenizer`), or None when it holds no tokenizer files."""
    return folder_tokenizer(folder) if has_tokenizer(folder) else None


class MissingTokenizerError(ValueError):
    """A tokenizer was asked of a folder that holds none, or of a path that does not exist."""


def folder_tokenizer(name_or_path: str | Path):
    """AutoTokenizer of a model folder or Hub name; a folder without a tokenizer, or a path that does not exist, is
    a `MissingTokenizerError` saying what to do (transformers' own error for these is about sentencepiece, or about
    the form of Hub repo ids)."""
    from transformers import AutoTokenizer

    from .model_card import is_hub_id

    path = Path(name_or_path).expanduser()
    if not path.exists() and not is_hub_id(str(name_or_path)):
        raise MissingTokenizerError(f"{name_or_path} does not exist: pass a folder holding a tokenizer, or a Hub name.")
    if path.is_dir() and not has_tokenizer(path):
        raise MissingTokenizerError(
            f"{name_or_path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the model's tokenizer "
            f"next to it with tokenizer.save_pretrained({str(name_or_path)!r}), or pass the tokenizer explicitly."
        )
    return AutoTokenizer.from_pretrained(name_or_path)


def _present_code(auto_map: dict, folder: Path) -> dict:
    """The entries of an `auto_map` whose module ("module.Class", or a tokenizer's [slow, fast] pair) is a file in
    `folder`."""

    def present(reference) -> bool:
        references = reference if isinstance(reference, list | tuple) else [reference]
        return any(
            isinstance(ref, str) and (folder / f"{ref.split('--')[-1].split('.')[0]}.py").is_file()
            for ref in references
        )

    return {name: reference for name, reference in auto_map.items() if present(reference)}


def prepare_for_serving(folder: str | Path, *, causal_lm: bool) -> None:
    """Ready an exported folder (native or ONNX) for plain transformers, without coreformer and without remote code:

    - config.json and tokenizer_config.json keep only the `auto_map` entries whose code file is in the folder; an
      entry naming absent code makes every AutoConfig / AutoTokenizer load ask "Do you wish to run the custom
      code? [y/N]" for code that is not there;
    - a causal LM's tokenizer pads on the left (`padding_side`), as batched generation needs: right padding puts the
      pad tokens between a prompt and what is generated after it, and transformers warns.
    """
    folder = Path(folder)
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        saved = json.loads(path.read_text())
        changed = dict(saved)
        if isinstance(saved.get("auto_map"), dict):
            changed["auto_map"] = _present_code(saved["auto_map"], folder)
            if not changed["auto_map"]:
                del changed["auto_map"]
        if causal_lm and name == "tokenizer_config.json":
            changed["padding_side"] = "left"
        if changed != saved:
            path.write_text(json.dumps(changed, indent=2, sort_keys=True) + "\n")
