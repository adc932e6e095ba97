"""Publish a saved coreformer folder to a Hub model repository (a thin command line over coreformer.publishing).

    python training/publish.py outputs/decoder-tiny --repo-id me/coreformer-decoder-tiny [--private] [--revision dev]

Checks the folder first (config.json, safetensors weights, a valid model card) and stops with one message when
something is missing; then pushes config, safetensors weights, modeling code, tokenizer files and README.md in one
commit. The Hub is huggingface_hub's endpoint: set HF_ENDPOINT to use another. The token comes from --token, HF_TOKEN
or `hf auth login`. Exit codes: 0 pushed, 2 the folder cannot be published, 1 the Hub refused or failed, 130 stopped
by Ctrl-C. The arguments are parsed before coreformer (and with it torch) is imported, so --help and --version answer
at once.
"""

import argparse
import sys

from coreformer_cli import add_version_argument
from coreformer_settings.base import INTERRUPTED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the folder save_pretrained (or pretraining / coreformer convert) wrote")
    parser.add_argument("--repo-id", required=True, help="model repository, owner/name")
    parser.add_argument("--private", action="store_true", help="create the repository private (if it is new)")
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the stored login)")
    parser.add_argument("--revision", default=None, help="branch to commit to (created from main if missing)")
    parser.add_argument("--commit-message", default=None, help="the commit's summary line")
    add_version_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from coreformer.publishing import PublishError, publish_folder  # torch and transformers: only after parsing

    try:
        url = publish_folder(
            args.folder,
            args.repo_id,
            private=args.private,
            token=args.token,
            revision=args.revision,
            commit_message=args.commit_message,
        )
    except PublishError as error:
        print(f"publish: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "publish: stopped by Ctrl-C before it finished; the folder goes up in one commit, so the repository holds "
            "all of it or none of it; run the same command again",
            file=sys.stderr,
        )
        return INTERRUPTED
    except Exception as error:  # the Hub's answer (HfHubHTTPError, a refused token, no connection): say it once
        print(f"publish: the Hub did not take the upload: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"published {args.folder} -> {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
