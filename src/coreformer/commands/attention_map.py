"""`coreformer attention-map`: a saved model's attention probabilities for a text, drawn to an image.

attention_map(args, prog) -> exit code   the handler (arguments: coreformer_settings.tools), over
                                         coreformer.probes.attention_maps.save_attention_map
"""

import argparse

from .base import CommandError, tool_command


@tool_command
def attention_map(args: argparse.Namespace) -> int:
    from ..probes.attention_maps import save_attention_map

    try:
        arrays = save_attention_map(
            args.folder, args.text, args.output, layer=args.layer, head=args.head, stack=args.stack, target=args.target
        )
    except ValueError as error:
        raise CommandError(str(error)) from error
    shape = " x ".join(str(size) for size in arrays.shape)
    print(f"wrote {args.output} ({shape} attention probabilities)")
    return 0
