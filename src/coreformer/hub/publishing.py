"""Publish a saved coreformer folder to a Hub repository: check the folder, then one commit with what a user needs.

    check_folder(folder) -> [files]          the files that would be pushed; PublishError naming the first problem
    publish_folder(folder, repo_id, ...)     create_repo(exist_ok=True) + one create_commit; returns the commit URL
    card_for_repo(text, repo_id)             the card with its from_pretrained("...") paths pointing at the repo

What is pushed, from the folder's top level only:

    config.json, generation_config.json     the configuration (with its auto_map)
    *.safetensors (+ index)                 the weights; pickles (*.bin, *.pt, *.pth) are never pushed
    *.py                                    the modeling code save_pretrained copies, for trust_remote_code
    tokenizer files                         tokenizer.json, tokenizer_config.json, vocab / merges, chat template
    README.md                               the model card, checked with model_card.validate_model_card

Everything else (metrics.json, loss.png, checkpoints/, logs/) stays local. The Hub address is huggingface_hub's
(the HF_ENDPOINT environment variable, read when huggingface_hub is imported; https://huggingface.co by default);
this module never names another. The token is the argument, else HF_TOKEN or the one `hf auth login` stored; a
401 or 403 from the Hub is a HubAuthError saying so.
"""

import json
import re
from pathlib import Path

from .model_card import CARD_NAME, validate_model_card

CONFIG_FILES = ("config.json", "generation_config.json")
# Every file a tokenizer's save_pretrained may write (folders.TOKENIZER_FILES: any one of them shows a tokenizer).
PUSHED_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# The first argument of every from_pretrained call in a card: the folder it was written in, until it is published.
_FROM_PRETRAINED_PATH = re.compile(r'(\.from_pretrained\()"[^"\n]*"')


class PublishError(ValueError):
    """One clear message about a folder that cannot be published; raised before anything is sent."""


class HubAuthError(PermissionError):
    """The Hub refused the token (HTTP 401 / 403): none was found, it is invalid, or it cannot write to the repo."""


_AUTH_STATUSES = {401: "no valid token was sent", 403: "the token may not write to this repository"}


def _is_published(path: Path) -> bool:
    name = path.name
    if name in CONFIG_FILES or name in PUSHED_TOKENIZER_FILES or name == CARD_NAME:
        return True
    return name.endswith((".safetensors", ".safetensors.index.json", ".py"))


def check_folder(folder: str | Path) -> list[Path]:
    """Check that `folder` holds a publishable model and return the files publish_folder would push."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PublishError(f"{folder} does not exist or is not a folder; pass the folder save_pretrained wrote.")
    if not (folder / "config.json").is_file():
        raise PublishError(
            f"{folder} has no config.json: not a saved model folder (model.save_pretrained(folder) writes one)."
        )
    if not list(folder.glob("*.safetensors")):
        pickles = sorted(path.name for path in folder.iterdir() if path.name.endswith(PICKLE_SUFFIXES))
        found = ""
        if pickles:
            found = f" It holds {', '.join(pickles)}, which is never pushed (pickle files run code when loaded)."
        raise PublishError(
            f"{folder} has no safetensors weights (*.safetensors); only safetensors are published, never .bin / "
            f"pickle files.{found} Re-save with model.save_pretrained(folder), which writes model.safetensors."
        )
    if not (folder / CARD_NAME).is_file():
        raise PublishError(
            f"{folder} has no model card ({CARD_NAME}). Write one with coreformer.hub.model_card.write_model_card("
            f"folder, ModelCardInfo(...)); `coreformer pretrain`, `finetune` and `convert` write it for you."
        )
    try:
        validate_model_card(folder / CARD_NAME)
    except ValueError as error:
        raise PublishError(
            f"the model card's metadata is invalid: {error} Fix {folder / CARD_NAME} (or rewrite it with "
            f"coreformer.hub.model_card.write_model_card)."
        ) from error
    config = json.loads((folder / "config.json").read_text())
    for auto_class, references in (config.get("auto_map") or {}).items():
        references = references if isinstance(references, list) else [references]  # AutoTokenizer: [slow, fast]
        for reference in filter(None, references):
            module = reference.split("--")[-1].split(".")[0]  # "repo--module.Class" or "module.Class"
            if not (folder / f"{module}.py").is_file():
                raise PublishError(
                    f"config.json maps {auto_class} to {reference}, but {folder / (module + '.py')} is missing: "
                    f"trust_remote_code loads would fail. Re-save the model with save_pretrained."
                )
    return sorted(path for path in folder.iterdir() if path.is_file() and _is_published(path))


def card_for_repo(text: str, repo_id: str) -> str:
    """The card with every `from_pretrained("<path>"` pointing at `repo_id`, so its how-to-load lines work for
    whoever reads it on the Hub."""
    return _FROM_PRETRAINED_PATH.sub(lambda match: f'{match[1]}"{repo_id}"', text)


def publish_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Push the checked files of `folder` to the model repository `repo_id` in one commit (created if missing; a
    `revision` branch is created from main if missing) and return the commit URL.

    The same commit deletes the repo's model files (weights, configs, code, tokenizer files, pickles) that the folder
    no longer has: a single-file model pushed over a sharded one must not leave the old shards to be loaded.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    files = check_folder(folder)
    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision is not None and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        pushed = {path.name for path in files}
        existing = api.list_repo_files(repo_id, revision=revision, repo_type="model")
        operations = [
            CommitOperationDelete(path_in_repo=name)
            for name in existing
            if name not in pushed and (_is_published(Path(name)) or name.endswith(PICKLE_SUFFIXES))
        ]
        for path in files:
            if path.name == CARD_NAME:
                card = card_for_repo(path.read_text(encoding="utf-8"), repo_id)
                operations.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card.encode("utf-8")))
            else:
                operations.append(CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path)))
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or f"Upload {Path(folder).name} with coreformer",
            revision=revision,
            repo_type="model",
        )
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        if status not in _AUTH_STATUSES:
            raise
        raise HubAuthError(
            f"the Hub at {constants.ENDPOINT} answered {status} ({_AUTH_STATUSES[status]}) for {repo_id}: pass a token "
            f"with write access with --token or the HF_TOKEN environment variable (or run `hf auth login`)."
        ) from error
    return commit.commit_url
