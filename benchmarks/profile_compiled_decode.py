"""Where a compiled static-cache decoding step spends its time, GPT-2 against coreformer.

compare.py's "decoder generation, compiled static cache" rows put coreformer at 0.94x GPT-2 (batch 1) and 0.93x
(batch 8) with the same compile config. This script takes the same pair (compare.py's reference shapes and
`gpt2_pair`: GPT2LMHeadModel and its coreformer conversion, same weights) and the same generate() options (static
cache, `CompileConfig(fullgraph=True)`), generates once per model to compile, then:

1. times `--repeats` generate() calls per model, interleaved, without the profiler (ms per new token);
2. profiles one more call per model with torch.profiler and sorts every operator's self CPU time into groups: inside
   the compiled step the matrix products, attention, the static cache's writes, other operators and inductor's
   generated code itself (its fused kernels and wrapper); entering the compiled step (Dynamo's guards and cache
   lookup); and generate()'s own per-token work outside the compiled step (the eager prefill, logits processing,
   stopping criteria, the next step's inputs).

It writes the per-token table of both models side by side, and each model's 15 largest operators, as markdown.

    python benchmarks/profile_compiled_decode.py --batch 1 --output benchmarks/results/profile_compiled_decode_b1.md
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import compile_settings, gpt2_pair, reference_shapes  # noqa: E402

COMPILED_REGION = "Torch-Compiled Region"
ENTERING = "entering the compiled step (Dynamo's guards and cache lookup)"
# the self time of inductor's generated code: its fused C++ kernels, which the profiler does not record as operators,
# and the Python wrapper that calls them and the extern kernels (the products, sdpa)
GRAPH_CODE = "step: inductor's generated code (fused kernels, wrapper)"
OUTSIDE = "generate() outside the compiled step (the eager prefill included)"
# operators inside the compiled step -> group, by the first pattern the name contains
GROUPS = (
    ("step: matrix products", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn")),
    ("step: attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
    ("step: cache writes", ("index_copy", "index_put", "copy_")),
)
REST_OF_STEP = "step: other operators (views, allocations)"
ORDER = [name for name, _ in GROUPS] + [REST_OF_STEP, GRAPH_CODE, ENTERING, OUTSIDE]


def group_of(event) -> str:
    """The group of a profiler event: by its name inside the compiled step, else entering it or outside it."""
    if "CompiledFxGraph" in event.name:
        return GRAPH_CODE
    if event.name.startswith(COMPILED_REGION) or "Cache Lookup" in event.name:
        return ENTERING
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(COMPILED_REGION):
        parent = parent.cpu_parent
    if parent is None:
        return OUTSIDE
    for group, patterns in GROUPS:
        if any(pattern in event.name for pattern in patterns):
            return group
    return REST_OF_STEP


def generate_settings(args: argparse.Namespace) -> dict:
    return dict(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0
    ) | compile_settings(args)


def timed(models: dict, ids: torch.Tensor, mask: torch.Tensor, settings: dict, repeats: int) -> dict[str, float]:
    """Median ms per new token of each model, the models' calls interleaved."""
    times = defaultdict(list)
    with torch.no_grad():
        for _ in range(repeats):
            for name, model in models.items():
                start = time.perf_counter()
                model.generate(ids, attention_mask=mask, **settings)
                times[name].append((time.perf_counter() - start) * 1e3 / settings["max_new_tokens"])
    return {name: statistics.median(values) for name, values in times.items()}


def profiled(model, ids: torch.Tensor, mask: torch.Tensor, settings: dict) -> dict[tuple[str, str], list[float]]:
    """{(operator, group): [self CPU ms per new token, calls per new token]} of one generate() call."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as recorded:
        model.generate(ids, attention_mask=mask, **settings)
    tokens = settings["max_new_tokens"]
    operators = defaultdict(lambda: [0.0, 0.0])
    for event in recorded.events():
        totals = operators[event.name, group_of(event)]
        totals[0] += event.self_cpu_time_total / 1e3 / tokens
        totals[1] += 1 / tokens
    return operators


def by_group(operators: dict[tuple[str, str], list[float]]) -> dict[str, float]:
    groups = dict.fromkeys(ORDER, 0.0)
    for (_, group), (milliseconds, _) in operators.items():
        groups[group] += milliseconds
    return groups


def markdown(args, wall: dict[str, float], operators: dict[str, dict]) -> str:
    groups = {name: by_group(ops) for name, ops in operators.items()}
    lines = [
        f"Compiled static-cache greedy decoding, batch {args.batch}, {args.layers} layers x {args.width}, vocab "
        f"{args.vocab}, prompt {args.prompt}, {args.new_tokens} new tokens, backend {args.compile_backend}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}. {args.label}",
        "",
        f"Without the profiler (median of {args.repeats}, interleaved): GPT-2 {wall['reference']:.3f} ms per token, "
        f"coreformer {wall['coreformer']:.3f} ms ({wall['reference'] / wall['coreformer']:.2f}x GPT-2's speed).",
        "",
        "Self CPU time per new token under the profiler (ms; the profiler adds its own cost per operator):",
        "",
        "| group | GPT-2 | coreformer | coreformer - GPT-2 |",
        "|---|---|---|---|",
    ]
    for group in groups["reference"]:
        mine, theirs = groups["coreformer"][group], groups["reference"][group]
        lines.append(f"| {group} | {theirs:.3f} | {mine:.3f} | {mine - theirs:+.3f} |")
    totals = {name: sum(values.values()) for name, values in groups.items()}
    lines.append(
        f"| total | {totals['reference']:.3f} | {totals['coreformer']:.3f} | "
        f"{totals['coreformer'] - totals['reference']:+.3f} |"
    )
    for name, label in (("reference", "GPT-2"), ("coreformer", "coreformer")):
        lines += ["", f"{label}: the 15 largest operators by self CPU time per new token", ""]
        lines += ["| operator | group | ms per token | calls per token |", "|---|---|---|---|"]
        largest = sorted(operators[name].items(), key=lambda item: -item[1][0])[:15]
        for (operator, group), (milliseconds, calls) in largest:
            cell = operator.replace("|", "\\|")[:90]
            lines.append(f"| `{cell}` | {group} | {milliseconds:.4f} | {calls:.3g} |")
    return "\n".join(lines) + "\n"


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, help="default: compare.py's 128")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--tiny", action="store_true", help="toy shapes: checks the script, measures nothing")
    parser.add_argument("--label", default="", help='how the run was taken, e.g. "measured under load"')
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    shapes = reference_shapes(torch.device("cpu"))
    if args.tiny:
        shapes.update(layers=1, width=32, heads=2, vocab=128, prompt=8, new_tokens=4)
        args.repeats = 1
    new_tokens = args.new_tokens
    vars(args).update(shapes, device=torch.device("cpu"))
    args.new_tokens = new_tokens or shapes["new_tokens"]
    return args


def main() -> None:
    args = parse_arguments()
    models = dict(zip(("reference", "coreformer"), (model.eval() for model in gpt2_pair(args))))
    ids = torch.randint(5, args.vocab, (args.batch, args.prompt))
    mask = torch.ones_like(ids)
    mask[1:, : args.prompt // 4] = 0  # left padding on every row but the first, as compare.py
    settings = generate_settings(args)
    with torch.no_grad():
        outputs = [model.generate(ids, attention_mask=mask, **settings) for model in models.values()]  # compiles
    if not torch.equal(*outputs):
        raise SystemExit("the two models generated different tokens: not profiling")
    wall = timed(models, ids, mask, settings, args.repeats)
    operators = {name: profiled(model, ids, mask, settings) for name, model in models.items()}
    report = markdown(args, wall, operators)
    print(report)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report)


if __name__ == "__main__":
    main()
