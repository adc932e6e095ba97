"""The arguments of the tool commands, importable without torch: `coreformer convert`, `export` and `attention-map`.

    add_convert_arguments(parser)         SRC DST [--check] [--overwrite] [--skip-tokenizer]
    add_export_arguments(parser)          FOLDER OUT [--to native|onnx|gguf] [--check] [--overwrite] [--gguf-dtype D]
    add_attention_map_arguments(parser)   FOLDER TEXT [--layer L] [--head H] [--stack S] [--target T] -o IMAGE

The command line (coreformer_cli) builds its parsers from these; the native architectures, formats and tolerance
they quote are read from where they are declared.
"""

import argparse

from .exports import CHECK_TOLERANCE, EXPORT_FORMATS, GGUF_DTYPES
from .registries import native_list


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help=f"a local transformers checkpoint folder (config.json + weights): {native_list()}")
    parser.add_argument("dst", help="the folder to write the coreformer checkpoint to (created; see --overwrite)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="run both models on a padded sample batch and fail (exit 1, nothing written) if any output differs by "
        f"more than {CHECK_TOLERANCE}",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists and is not empty")
    parser.add_argument("--skip-tokenizer", action="store_true", help="convert the weights only; copy no tokenizer")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder",
        help="a saved coreformer model folder (pretraining, fine-tuning or convert output), or a transformers folder "
        "of an architecture `coreformer convert` reads",
    )
    parser.add_argument(
        "out", help="the folder to write (for --to gguf: a .gguf file, or a folder receiving model-<dtype>.gguf)"
    )
    parser.add_argument(
        "--to",
        choices=EXPORT_FORMATS,
        default="native",
        help=f"native: the transformers architecture computing the same function ({native_list()}), loadable "
        "without coreformer; onnx; gguf (decoders exporting to Llama, GPT-2 or GPT-NeoX: the decoder presets)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="read OUT back (native: plain transformers in a fresh process without coreformer; onnx: onnxruntime; "
        "gguf: the file's weights and tokenizer), compare logits, greedy tokens and tokenizer ids with the source, "
        f"print the maximum difference and its tolerance; exit 1 and write nothing above it ({CHECK_TOLERANCE} in "
        "fp32)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    parser.add_argument("--gguf-dtype", choices=GGUF_DTYPES, default="f32", help="tensor type of --to gguf")


def add_attention_map_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="a saved coreformer model folder (with its tokenizer), or a Hub repo id")
    parser.add_argument("text", help="the text to encode")
    parser.add_argument("--layer", type=int, default=-1, help="layer index, negative from the end (default: the last)")
    parser.add_argument("--head", type=int, default=None, help="one head (default: a grid of every head)")
    parser.add_argument(
        "--stack",
        choices=["encoder", "decoder", "cross"],
        default=None,
        help="which attention to draw: encoder or decoder self-attention, or seq2seq cross-attention (default: the "
        "model's own stack; a seq2seq model's encoder)",
    )
    parser.add_argument("--target", default=None, help="seq2seq only: the decoder-side text")
    parser.add_argument("-o", "--output", required=True, help="the image to write, e.g. map.png")
