"""What a decoder's cache holds per layer after a prompt, by layer type: the decode state that generation carries.

For each layer type a decoder of that type on every layer (the sizes below, one shape for all; Gated DeltaNet, which
needs an attention layer beside it, on the first with a full layer after it) prefills prompts of growing length into
transformers' `DynamicCache`, and the bytes of every tensor the cache then holds for the layers of that type are
counted, per layer and per prompt token. The count comes from the tensors themselves, not from a formula: what a type
keeps (keys and values, a window of them, a fixed-size state, a latent) is what is measured. The numbers depend on the
shapes and the dtype only, not on the machine.

Writes results/decode_state.json and decode_state.md (machine, date, command at the top).

    python benchmarks/decode_state.py
    python benchmarks/decode_state.py --lengths 64 128 --output-dir /tmp/decode-state     # a smoke run
"""

import argparse
import shlex
import sys
from pathlib import Path

import torch
from results_files import report_head, results_header, write_results
from transformers.cache_utils import DynamicCache

import coreformer as cf

ROOT = Path(__file__).resolve().parents[1]
# layer type -> the config fields it needs besides the shared shape (the window, the latent's widths)
TYPES = {
    "full": {},
    "sliding": {"sliding_window": 256},
    "linear": {},
    "differential": {},
    "sigmoid": {},
    "mla": {"kv_lora_rank": 128, "qk_nope_head_dim": 64, "v_head_dim": 64},
    "gated_deltanet": {"linear_num_value_heads": 8, "linear_conv_kernel_dim": 4},
}
# The types that cannot make a stack alone -> the stack measured (its cache layer counts no tokens: an attention layer
# beside it does)
STACKS = {"gated_deltanet": ["gated_deltanet", "full"]}
SHAPE = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, head_dim=64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths")
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    parser.add_argument("--note", default="", help="how the machine was")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "benchmarks/decode_state.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def layer_bytes(layer) -> int:
    """The bytes of every tensor a cache layer holds (keys, values, states: whatever its attributes are, and the
    tensors of the dicts transformers' linear-attention layer keeps its states in)."""
    tensors = []
    for value in vars(layer).values():
        tensors += list(value.values()) if isinstance(value, dict) else [value]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if isinstance(tensor, torch.Tensor))


@torch.no_grad()
def state_after_prompt(layer_type: str, length: int) -> float:
    """The bytes the cache holds per layer of `layer_type` after a prompt of `length` tokens."""
    layer_types = STACKS.get(layer_type, [layer_type] * SHAPE["num_hidden_layers"])
    config = cf.CoreformerDecoderConfig(
        vocab_size=256, intermediate_size=4 * SHAPE["hidden_size"], max_position_embeddings=max(length, 512),
        position_embedding_type="rotary", layer_types=layer_types, **SHAPE, **TYPES[layer_type],
    )  # fmt: skip
    torch.manual_seed(0)
    model = cf.CoreformerDecoderForCausalLM(config).eval()
    cache = DynamicCache(config=config)
    model(input_ids=torch.randint(0, 256, (1, length)), past_key_values=cache, use_cache=True, logits_to_keep=1)
    measured = [layer_bytes(layer) for layer, kind in zip(cache.layers, layer_types) if kind == layer_type]
    return sum(measured) / len(measured)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = report_head(args) | {"shape": SHAPE, "types": {name: TYPES[name] for name in args.types}, "rows": []}
    for layer_type in args.types:
        for length in args.lengths:
            per_layer = state_after_prompt(layer_type, length)
            report["rows"].append({"type": layer_type, "length": length, "per_layer": per_layer})
            print(f"{layer_type} {length}: {per_layer / length:,.1f} bytes per token per layer", file=sys.stderr)
    lines = results_header("Decode state by layer type: what the cache holds after a prompt", report)
    shape = ", ".join(f"{key} {value}" for key, value in SHAPE.items())
    lines += [
        "",
        f"A decoder of one layer type ({shape}; fp32; gated_deltanet on the first layer, a full layer after it), "
        "`DynamicCache` after one prefill: the bytes of every tensor the cache holds for a layer of the type, and "
        "per prompt token. A type whose state does not grow with the prompt shows a per-token figure falling as the "
        "prompt grows.",
        "",
        "| type | settings | " + " | ".join(f"L={length:,}: KiB / layer" for length in args.lengths) + " | "
        + " | ".join(f"L={length:,}: bytes / token" for length in args.lengths) + " |",
        "|---|---|" + "---|" * (2 * len(args.lengths)),
    ]  # fmt: skip
    for layer_type in args.types:
        rows = [row for row in report["rows"] if row["type"] == layer_type]
        settings = ", ".join(f"{key} {value}" for key, value in TYPES[layer_type].items()) or "—"
        kib = " | ".join(f"{row['per_layer'] / 1024:,.0f}" for row in rows)
        per_token = " | ".join(f"{row['per_layer'] / row['length']:,.1f}" for row in rows)
        lines.append(f"| {layer_type} | {settings} | {kib} | {per_token} |")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_results(args.output_dir, "decode_state", report, "\n".join(lines + [""]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
