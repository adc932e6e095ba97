"""`coreformer tokenize`: text -> a folder of token-id shards that pretraining reads by memory map.

    tokenize(settings, prog) -> exit code   the handler (arguments and checks: coreformer_settings.tokenizing)

It loads the tokenizer, hands the work to coreformer.training.shards.write_shards (the layout, the held-out split and
how a rerun continues are described there) and prints one line of what the folder holds. Exit codes: 0 written (or
already whole), 2 a bad input or a folder of other shards (one line on stderr; shards already there are kept), 130
stopped by Ctrl-C (the command line says how to go on).
"""

import sys

from coreformer_settings.command_line import USAGE_ERROR
from coreformer_settings.tokenizing import ShardsError, TokenizeSettings


def tokenize(settings: TokenizeSettings, prog: str) -> int:
    from ..hub.folders import MissingTokenizerError, folder_tokenizer
    from ..training.shards import write_shards

    try:
        tokenizer = folder_tokenizer(settings.tokenizer)
    except MissingTokenizerError as error:
        return _refused(prog, f"--tokenizer: {error}")
    except Exception as error:  # OSError for an unknown Hub name, ValueError for broken files
        return _refused(prog, f"cannot load tokenizer {settings.tokenizer!r}: {error}")
    try:
        manifest = write_shards(settings, tokenizer, progress=True)
    except ShardsError as error:
        return _refused(prog, str(error))
    splits = ", ".join(
        f"{name} {split['documents']} documents / {split['tokens']} tokens in {len(split['shards'])} shards"
        for name, split in manifest["splits"].items()
    )
    print(f"{settings.out}: {manifest['dtype']} ids of {manifest['tokenizer']['name']}; {splits}")
    return 0


def _refused(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return USAGE_ERROR
