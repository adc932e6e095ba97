"""Attention maps of the core's variants after a short pretraining: what each layer type's weights look like on one
sentence once a model has learned something (a random model's maps are noise).

For each layer type the modern decoder recipe (`--preset tiny-modern`, every layer of that type) pretrains for
`--steps` steps on the same data and tokenizer, and the last layer's heads are drawn for one line of Python
(`coreformer.probes.attention_maps`, as `coreformer attention-map` draws them): what `output_attentions` returns,
softmax probabilities for full attention and multi-head latent attention, each query head's softmax for differential
attention (the maps its differential heads subtract in pairs), independent sigmoid weights for sigmoid attention
(rows need not sum to one). Gated DeltaNet attends over no keys and has no map.

Writes results/attention_map_TYPE.png per type and attention_maps.md / .json (machine, date, command at the top).

    python benchmarks/attention_maps.py
    python benchmarks/attention_maps.py --steps 5 --types full --output-dir /tmp/maps      # a smoke run
"""

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from results_files import report_head, results_header, write_results

from coreformer.probes.attention_maps import save_attention_map
from coreformer.training.pretraining import run_pretraining
from coreformer.training.pretraining.run import resolve_arguments

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("full", "differential", "sigmoid", "mla")
TYPE_FIELDS = {"mla": {"kv_lora_rank": 64}}
TEXT = "def add(first, second):\n    return first + second"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--steps", type=int, default=300, help="pretraining steps per type")
    parser.add_argument("--note", default="", help="how the machine was")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "benchmarks/attention_maps.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def pretrained(layer_type: str, steps: int, folder: Path, tokenizer: Path | None) -> dict:
    """The modern decoder with every layer `layer_type`, pretrained for `steps` steps into `folder`."""
    model = {"layer_types": [layer_type] * 4, **TYPE_FIELDS.get(layer_type, {})}
    overrides = dict(model=model, output_dir=str(folder), overwrite=True, max_steps=steps, save_every=0)
    overrides.update(eval_every=0, report_to="none", zero_shot_pairs=0, warmup_steps=max(1, steps // 10))
    if tokenizer is not None:
        overrides["tokenizer"] = str(tokenizer)
    settings = resolve_arguments(
        family="decoder", preset="tiny-modern", overrides=overrides, configs_dir=ROOT / "training" / "configs"
    )
    return run_pretraining(settings)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = report_head(args) | {"text": TEXT, "steps": args.steps, "types": {}}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coreformer-maps-") as scratch:
        tokenizer = None  # the first run trains it; the others reuse it, so every map has the same tokens
        for layer_type in args.types:
            folder = Path(scratch) / layer_type
            metrics = pretrained(layer_type, args.steps, folder, tokenizer)
            tokenizer = tokenizer or folder
            picture = args.output_dir / f"attention_map_{layer_type}.png"
            weights = save_attention_map(folder, TEXT, picture)  # (heads, queries, keys) of the last layer
            report["types"][layer_type] = {
                "picture": picture.name,
                "final_eval_loss": metrics["final_eval_loss"],
                "negative_weights": bool((weights < 0).any()),
                "largest_row_sum": float(weights.sum(-1).max()),
            }
    lines = results_header("Attention maps of the layer types after a short pretraining", report)
    lines += [
        "",
        f"The modern decoder recipe with every layer of one type, {args.steps} steps, the last layer's heads on "
        f"`{TEXT!r}`.",
        "",
        "| type | held-out loss | negative weights | largest row sum | picture |",
        "|---|---|---|---|---|",
    ]
    for layer_type, row in report["types"].items():
        lines.append(
            f"| {layer_type} | {row['final_eval_loss']:.4f} | {'yes' if row['negative_weights'] else 'no'} | "
            f"{row['largest_row_sum']:.3f} | ![{layer_type}]({row['picture']}) |"
        )
    write_results(args.output_dir, "attention_maps", report, "\n".join(lines + [""]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
