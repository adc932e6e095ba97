"""What Muon costs on FSDP2 shards against AdamW: the tiny decoder preset (`--family decoder --preset tiny`, whose
optimizer is Muon) on CPU processes under training/configs/accelerate/fsdp.yaml, built as pretraining builds it
(CpuFsdp2Engine.setup: fully_shard per block, then build_optimizer), one model per optimizer from the same seed:

    step time          forward, backward and optimizer step of one micro-batch of the preset (16 x 128 tokens per
                       process), the slowest process's; the two optimizers alternate step by step (A B B A ...), so
                       that a machine that slows down slows both; the median
    forward/backward   and optimizer.step() alone, the same way
    Muon's exchange    bytes each process sends per step in ShardedMuon's two all-to-alls (each matrix's rows to its
                       owner, the orthogonalised rows back; bf16), counted by wrapping torch.distributed's
                       all_to_all_single, beside the same number from the shapes alone, and the seconds spent in them
    FSDP's own         bytes each process sends per step in FSDP2's parameter all-gathers and gradient reduce-scatters
                       (counted the same way): what every optimizer pays, the scale Muon's exchange adds to

Writes results/sharded_muon.json and sharded_muon.md (machine, date and command at the top).

    python benchmarks/sharded_muon.py --note "2 cores shared with other jobs"
    python benchmarks/sharded_muon.py --steps 2 --warmup 1 --output-dir /tmp/sharded-muon   # a smoke run
"""

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from results_files import report_head, results_header, write_results

ROOT = Path(__file__).resolve().parents[1]
FSDP_CONFIG = ROOT / "training" / "configs" / "accelerate" / "fsdp.yaml"
OPTIMIZERS = ("muon", "adamw")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each optimizer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each optimizer first")
    parser.add_argument("--note", default="", help="how the machine was (e.g. 'under load from other jobs')")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # a launched process: its output
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", "benchmarks/sharded_muon.py", *(sys.argv[1:] if argv is None else argv)])
    return args


# ---------------------------------------------------------------------------------------------------------------------
# A launched process
# ---------------------------------------------------------------------------------------------------------------------


class Traffic:
    """Bytes this process sends to the others, and seconds spent, per collective: torch.distributed's functions
    wrapped while `counting` (each caller looks them up on the module when it calls)."""

    WRAPPED = ("all_to_all_single", "all_gather_single", "reduce_scatter_single")  # ShardedMuon's, FSDP2's

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.sent = dict.fromkeys(self.WRAPPED, 0)
        self.seconds = dict.fromkeys(self.WRAPPED, 0.0)

    def _sent(self, name: str, args: tuple, kwargs: dict) -> int:
        tensor = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))  # (output, input)
        if name == "all_to_all_single":  # the splits the caller passed; its own part stays here
            splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            rows = sum(splits) - splits[self.rank] if splits else tensor.shape[0] * (self.world - 1) // self.world
            return rows * (tensor.numel() // max(tensor.shape[0], 1)) * tensor.element_size()
        everything = tensor.numel() * tensor.element_size()
        # all-gather: this shard to every other process; reduce-scatter: every other process's part of the input
        if name == "all_gather_single":
            return everything * (self.world - 1)
        return everything // self.world * (self.world - 1)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in self.WRAPPED}

        def wrap(name: str, original: Callable) -> Callable:
            def counted(*args, **kwargs):
                self.sent[name] += self._sent(name, args, kwargs)
                start = time.perf_counter()
                work = original(*args, **kwargs)
                self.seconds[name] += time.perf_counter() - start  # the call (an async one's wait comes later)
                return work

            return counted

        for name, original in originals.items():
            setattr(dist, name, wrap(name, original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)


def exchange_bytes_from_shapes(shapes: list[tuple[int, int]], rank: int, world: int) -> int:
    """Bytes `rank` sends per step in ShardedMuon's exchange, from the shapes alone: its rows (torch.chunk's split, as
    fully_shard makes it) of every matrix another rank owns, and the rows of its own matrices that the others hold,
    in bf16 (2 bytes)."""
    import torch

    from coreformer.training.optimizers import muon_owners

    sent = 0
    for (rows, columns), owner in zip(shapes, muon_owners(shapes, world)):
        split = [len(chunk) for chunk in torch.arange(rows).chunk(world)] + [0] * world
        sent += (split[rank] if owner != rank else rows - split[rank]) * columns * 2
    return sent


def worker(args: argparse.Namespace) -> None:
    """One process of the launch: build both runs, step them in turn, write the timings (rank 0)."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from coreformer.training.engine import CpuFsdp2Engine, requested_engine, resolve_engine
    from coreformer.training.families import TRAINING_FACTS
    from coreformer.training.optimizers import build_optimizer, build_schedule, muon_owners
    from coreformer.training.pretraining.run import resolve_arguments

    preset = resolve_arguments(family="decoder", preset="tiny", overrides={"output_dir": str(args.worker.parent)})
    accelerator = Accelerator(dynamo_backend="no")
    engine = resolve_engine(accelerator, requested_engine(), "no")
    assert isinstance(engine, CpuFsdp2Engine), engine.line()
    rank, world = accelerator.process_index, accelerator.num_processes
    config = TRAINING_FACTS["decoder"].config_class(vocab_size=preset.vocab_size, **preset.model)
    generator = torch.Generator().manual_seed(rank)  # each process its own micro-batch, the same for both runs
    batch = torch.randint(0, preset.vocab_size, (preset.batch_size, preset.block_size), generator=generator)
    runs = {}
    for name in OPTIMIZERS:
        settings = dataclasses.replace(preset, optimizer=name)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        runs[name] = engine.setup(
            accelerator,
            model,
            lambda module, settings=settings: build_optimizer(module, settings, accelerator.device),
            lambda optimizer, settings=settings: build_schedule(optimizer, settings),
        )[:2]
    muon = runs["muon"][1].optimizer.muon
    parameters = [p for group in muon.param_groups for p in group["params"]]
    traffic = {name: Traffic(rank, world) for name in OPTIMIZERS}

    def step(name: str) -> tuple[float, float, float]:
        model, optimizer = runs[name]
        dist.barrier()
        start = time.perf_counter()
        with traffic[name].counting():
            model(input_ids=batch, labels=batch).loss.backward()
            stepping = time.perf_counter()
            optimizer.step()
            stepped = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()  # the step ends when the slowest process ends it
        return time.perf_counter() - start, stepping - start, stepped - stepping

    for _ in range(args.warmup):
        for name in OPTIMIZERS:
            step(name)
    counted_from = {name: (dict(t.sent), dict(t.seconds)) for name, t in traffic.items()}
    times = {name: {"step": [], "forward_backward": [], "optimizer_step": []} for name in OPTIMIZERS}
    for repeat in range(args.steps):
        for name in OPTIMIZERS if repeat % 2 == 0 else OPTIMIZERS[::-1]:  # A B B A: neither always follows the other
            for key, seconds in zip(times[name], step(name)):
                times[name][key].append(seconds)
    # the slowest process's time of each step; the bytes of every process
    for name in OPTIMIZERS:
        for key, values in times[name].items():
            tensor = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            times[name][key] = tensor.tolist()
    per_step = {}
    for name in OPTIMIZERS:
        sent, seconds = counted_from[name]
        counts = [traffic[name].sent[k] - sent[k] for k in Traffic.WRAPPED]
        spent = [traffic[name].seconds[k] - seconds[k] for k in Traffic.WRAPPED]
        gathered = [None] * world
        dist.all_gather_object(gathered, (counts, spent))
        per_step[name] = {
            collective: {
                "bytes_sent_per_process": [c[0][i] / args.steps for c in gathered],
                "seconds_per_process": [c[1][i] / args.steps for c in gathered],
            }
            for i, collective in enumerate(Traffic.WRAPPED)
        }
    shapes = [tuple(p.shape) for p in parameters]
    from_shapes = [exchange_bytes_from_shapes(shapes, r, world) for r in range(world)]
    if accelerator.is_main_process:
        report = {
            "world_size": world,
            "preset": {key: getattr(preset, key) for key in ("vocab_size", "block_size", "batch_size", "model")},
            "parameters": sum(p.numel() for p in runs["adamw"][0].parameters()),
            "muon_matrices": [list(s) for s in shapes],
            "muon_owners": muon_owners(shapes, world),
            "muon_parameters": sum(p.numel() for p in parameters),
            "exchange_bytes_from_shapes": from_shapes,
            "times": times,
            "per_step": per_step,
        }
        args.worker.write_text(json.dumps(report))
    dist.barrier()


# ---------------------------------------------------------------------------------------------------------------------
# The launcher and the report
# ---------------------------------------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, output: Path) -> None:
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "--config_file", str(FSDP_CONFIG), "--num_processes", str(args.processes)]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--worker", str(output)]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env, cwd=ROOT)


def summary(measured: dict) -> dict:
    medians = {
        name: {key: statistics.median(values) for key, values in measured["times"][name].items()} for name in OPTIMIZERS
    }
    exchange = measured["per_step"]["muon"]["all_to_all_single"]
    fsdp = {
        name: sum(max(measured["per_step"][name][c]["bytes_sent_per_process"]) for c in Traffic.WRAPPED[1:])
        for name in OPTIMIZERS
    }
    return {
        "median_seconds": medians,
        "muon_over_adamw_step": medians["muon"]["step"] / medians["adamw"]["step"],
        "exchange_bytes_per_process": max(exchange["bytes_sent_per_process"]),
        "exchange_bytes_from_shapes": max(measured["exchange_bytes_from_shapes"]),
        "exchange_seconds_per_process": max(exchange["seconds_per_process"]),
        "fsdp_bytes_per_process": fsdp,
    }


def markdown(report: dict) -> str:
    measured, result = report["measured"], report["summary"]
    medians = result["median_seconds"]
    mib = 1024 * 1024
    lines = results_header("Muon on FSDP2 shards against AdamW (tiny decoder preset, CPU processes)", report)
    lines += [
        "",
        f"{measured['world_size']} processes under training/configs/accelerate/fsdp.yaml (ACCELERATE_USE_CPU=1, "
        f"gloo, one thread each), the tiny decoder preset ({measured['parameters']:,} parameters, "
        f"{len(measured['muon_matrices'])} matrices under Muon holding {measured['muon_parameters']:,}), one "
        f"micro-batch of {measured['preset']['batch_size']} x {measured['preset']['block_size']} tokens per process "
        f"per step; {report['settings']['steps']} timed steps of each optimizer after "
        f"{report['settings']['warmup']}, alternating (A B B A ...); medians of the slowest process.",
        "",
        "| optimizer | step (ms) | forward + backward (ms) | optimizer.step (ms) | Muon's exchange sent per process "
        "per step | in it (ms) | FSDP's own sent per process per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in OPTIMIZERS:
        exchange = (
            f"{result['exchange_bytes_per_process'] / mib:.3f} MiB"
            f" ({result['exchange_bytes_from_shapes'] / mib:.3f} MiB from the shapes)"
            if name == "muon"
            else "none"
        )
        spent = f"{result['exchange_seconds_per_process'] * 1e3:.1f}" if name == "muon" else "-"
        lines.append(
            f"| {name} | {medians[name]['step'] * 1e3:.1f} | {medians[name]['forward_backward'] * 1e3:.1f} | "
            f"{medians[name]['optimizer_step'] * 1e3:.1f} | "
            f"{exchange} | {spent} | {result['fsdp_bytes_per_process'][name] / mib:.3f} MiB |"
        )
    extra = result["exchange_bytes_per_process"] / result["fsdp_bytes_per_process"]["adamw"]
    lines += [
        "",
        f"Muon's step takes {result['muon_over_adamw_step']:.2f}x AdamW's; its optimizer step alone "
        f"{(medians['muon']['optimizer_step'] - medians['adamw']['optimizer_step']) * 1e3:.1f} ms more than AdamW's "
        f"({(medians['muon']['optimizer_step'] - medians['adamw']['optimizer_step']) / medians['adamw']['step']:.0%} "
        f"of AdamW's step: the steady part of the difference, where the whole steps also carry the machine's noise), "
        f"{result['exchange_seconds_per_process'] * 1e3:.1f} ms of it in the two all-to-alls. Its exchange adds "
        f"{extra:.0%} to the bytes FSDP2 already sends per step (parameters all-gathered in fp32 for forward and "
        f"backward, gradients reduce-scattered in fp32): each matrix's rows travel once to their owner and once back, "
        f"in bf16, the precision Newton-Schulz starts from. Owners (the costliest matrix first, each to the least "
        f"loaded process): {measured['muon_owners']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    args.output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "measured.json"
        launch(args, output)
        measured = json.loads(output.read_text())
    report = {**report_head(args), "measured": measured}
    report["summary"] = summary(measured)
    table = markdown(report)
    write_results(args.output_dir, "sharded_muon", report, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
