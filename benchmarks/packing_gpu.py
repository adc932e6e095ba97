"""Packed rows on one GPU, in one call of at most 10 minutes: exactness under flash, flex and sdpa, and packed against
padded training speed.

Part "exact": for each family (encoder, decoder, seq2seq: both sides, the decoder with its labels), layer type and
backend, one packed row of three documents against the documents run one by one under sdpa in fp32 (the reference):
hidden states, logits, loss and gradients, as tests/modeling/test_packing.py checks on CPU (eager, sdpa). The packing
is described by restarting position ids, as DataCollatorWithFlattening and TRL's padding-free batches describe it;
under flash the model derives the varlen arguments (cu_seq_lens, max_length) itself. Backends:

    flash   a varlen flash kernel, registered as an attention function under a flash name (`flash_attention_varlen`,
            so the model treats it as transformers' flash_attention_2: no mask, position ids and the varlen
            arguments in its kwargs): torch's own FlashAttention-2 varlen kernel (torch.nn.attention.varlen), bf16
            inside attention, the rest of the model fp32. Without CUDA (the smoke run) a stand-in of the same
            signature runs sdpa document by document. Its documents also run alone, to show the kernel's own
            (bf16) share of the difference.
    sdpa    transformers' sdpa on the GPU (fp32).
    flex    transformers' flex_attention (fp32), gradients included (torch has no flex backward on CPU).

A cell passes when every compared tensor's largest difference is within the backend's tolerance relative to the
largest value of its kind (fp32 kernels 1e-4; flash, bf16 inside attention, 2e-2). Beside it stands a control: the
same row read as one document (no position ids), whose difference must be far larger, so the check can fail. A layer
type the backend refuses is reported with the refusal's first line. Cells run in order (flex last: it compiles a
kernel per cell) until --time-budget is spent.

Part "speed": benchmarks/packing.py's runs (every packing mode of each family's default objective, equal real-token
budgets, variable-length documents) with --preset (`small`) in bf16 on the GPU.

Each part writes its own results file, results/packing_gpu_exact.json / .md and packing_gpu_speed.json / .md
(machine, date and command at the top), after every cell and section, so a call cut off at its time limit keeps what
it finished; a speed run that fails is reported with its error.

    python benchmarks/packing_gpu.py                    # on the GPU machine
    python benchmarks/packing_gpu.py --tiny             # a CPU smoke run of the same code (the test)
"""

import argparse
import datetime
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from results_files import sibling, write_results
from torch.nn import functional
from transformers import AttentionInterface

import coreformer as cf

ROOT = Path(__file__).resolve().parents[1]
FLASH = "flash_attention_varlen"
FAMILIES = ("encoder", "decoder", "seq2seq")
PACKED_LAYER_TYPES = ("full", "sliding", "strided", "linear", "block", "lsh")
BACKENDS = ("flash", "sdpa", "flex")  # flex last: it compiles a kernel per cell
TOLERANCE = {"flash": 2e-2, "flex": 1e-4, "sdpa": 1e-4}  # relative to each tensor's largest value
HEADS = {
    "encoder": (cf.CoreformerEncoderConfig, cf.CoreformerEncoderForMaskedLM),
    "decoder": (cf.CoreformerDecoderConfig, cf.CoreformerDecoderForCausalLM),
    "seq2seq": (cf.CoreformerSeq2SeqConfig, cf.CoreformerSeq2SeqForConditionalGeneration),
}
VOCAB, PAD, BOS, EOS = 211, 0, 1, 2
# Documents crossing the kernels' tiles, blocks and LSH chunks mid-way; the seq2seq decoder's answer them one by one.
LENGTHS, TARGET_LENGTHS = (70, 130, 33), (41, 77, 20)
TINY_LENGTHS, TINY_TARGET_LENGTHS = (5, 9, 3), (4, 6, 2)
PARAMETERS = dict(sliding_window=8, stride=5, block_size=16, lsh_bucket_size=8, lsh_num_hashes=2, lsh_num_buckets=8)


def _packing_benchmark():
    """benchmarks/packing.py as a module (its runs are reused, not copied)."""
    return sibling("packing")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=["exact", "speed"], default=["exact", "speed"])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--layer-types", nargs="+", choices=PACKED_LAYER_TYPES, default=list(PACKED_LAYER_TYPES))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--time-budget", type=float, default=150.0, help="seconds after which no new cell starts")
    parser.add_argument("--documents", nargs="+", choices=["files", "lines"], default=["lines"])
    parser.add_argument("--preset", default="small", help="the speed part's preset")
    parser.add_argument("--budget", type=int, default=500_000, help="real tokens per speed run")
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], default=None, help="speed runs (GPU: bf16)")
    parser.add_argument("--note", default="")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="tiny documents and runs on CPU: a smoke run")
    args = parser.parse_args(argv)
    args.command = "python benchmarks/packing_gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return args


# --- the flash kernel -------------------------------------------------------------------------------------------


def _varlen_flash(query, key, value, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, window):
    """torch's FlashAttention-2 varlen kernel (what torch.nn.attention.varlen wraps; called as the aten op, whose
    signature and autograd formula have held across torch releases where the wrapper's have not): (total, H, D) bf16
    in, (total, H, D) out."""
    left, right = window if window is not None else (None, None)
    output, *_ = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return output


def _varlen_reference(query, key, value, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, window):
    """The same contract on CPU, document by document through sdpa: what the smoke run exercises."""
    out = torch.empty_like(query)
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        q, k, v = (t.transpose(0, 1) for t in (query[q0:q1], key[k0:k1], value[k0:k1]))  # (H, T, D)
        rows, cols = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None]
        allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if causal:
            allowed &= cols <= rows
        if window is not None:
            allowed &= (rows - cols).abs() <= window[0]
        out[q0:q1] = functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1)
    return out


def flash_attention_varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention function in transformers' signature over a varlen flash kernel: (B, H, T, D) query/key/value ->
    ((B, T, H, D), None). Packed rows arrive with cu_seq_lens_q/k and max_length_q/k (the model derives them under a
    flash name); unpacked rows are one sequence each."""
    if dropout:
        raise ValueError("flash_attention_varlen runs without attention dropout")
    batch, heads, length_q, head_dim = query.shape
    length_k = key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError("flash_attention_varlen takes unpadded rows: pack them (position ids) instead of padding")
    if "cu_seq_lens_q" in kwargs:
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    else:
        cu_q = torch.arange(batch + 1, device=query.device, dtype=torch.int32) * length_q
        cu_k = torch.arange(batch + 1, device=query.device, dtype=torch.int32) * length_k
        max_q, max_k = length_q, length_k
    if key.shape[1] != heads:  # grouped-query attention: each key/value head serves heads // kv_heads queries
        key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
    causal = bool(kwargs.get("is_causal", module.is_causal)) and length_q > 1
    window = kwargs.get("sliding_window")
    window = (window - 1, window - 1) if window is not None else None  # transformers' convention: the query counted
    flat = [t.transpose(1, 2).reshape(-1, heads, head_dim) for t in (query, key, value)]  # (B * T, H, D)
    kernel = _varlen_flash if query.is_cuda else _varlen_reference
    dtype = torch.bfloat16 if query.is_cuda else query.dtype
    scale = scaling if scaling is not None else head_dim**-0.5
    out = kernel(*(t.to(dtype) for t in flat), cu_q, cu_k, max_q, max_k, causal, scale, window)
    return out.to(query.dtype).reshape(batch, length_q, heads, head_dim), None  # (B, T, H, D)


AttentionInterface.register(FLASH, flash_attention_varlen)


# --- one cell: a packed row against its documents ---------------------------------------------------------------


def tiny_model(family: str, layer_type: str, device: str):
    config_class, model_class = HEADS[family]
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=256,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        layer_types=[layer_type] * 2,
        **PARAMETERS,
    )
    if family == "seq2seq":
        fields.update(
            encoder_layers=2, decoder_layers=2, decoder_start_token_id=EOS, decoder_layer_types=[layer_type] * 2
        )
    else:
        fields.update(num_hidden_layers=2)
    torch.manual_seed(0)
    return model_class(config_class(**fields)).to(device).train(False)


def document_batches(family: str, tiny: bool, device: str) -> tuple[list[dict], dict, dict]:
    """(each document's inputs alone, the packed row, the packed row read as one document)."""
    lengths, target_lengths = (TINY_LENGTHS, TINY_TARGET_LENGTHS) if tiny else (LENGTHS, TARGET_LENGTHS)
    generator = torch.Generator().manual_seed(1)
    sources = [torch.randint(3, VOCAB, (1, n), generator=generator) for n in lengths]
    targets = [torch.randint(3, VOCAB, (1, n), generator=generator) for n in target_lengths]
    alone = []
    for ids, target in zip(sources, targets):
        if family == "encoder":
            alone.append(dict(input_ids=ids, labels=ids.masked_fill(torch.arange(ids.shape[1])[None] % 3 == 1, -100)))
        elif family == "decoder":
            alone.append(dict(input_ids=ids, labels=ids))
        else:
            start = torch.full((1, 1), EOS)
            alone.append(dict(input_ids=ids, labels=target, decoder_input_ids=torch.cat([start, target[:, :-1]], 1)))
    packed = {name: torch.cat([inputs[name] for inputs in alone], 1) for name in alone[0]}
    if family == "decoder":  # a document's first token is no target of the previous one's last
        packed["labels"] = torch.cat([inputs["labels"].index_fill(1, torch.tensor([0]), -100) for inputs in alone], 1)
    one_document = dict(packed)
    packed["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, T), restarting
    if family == "seq2seq":
        packed["decoder_position_ids"] = torch.cat([torch.arange(n) for n in target_lengths])[None]
    move = lambda batch: {name: tensor.to(device) for name, tensor in batch.items()}  # noqa: E731
    return [move(inputs) for inputs in alone], move(packed), move(one_document)


def targets_of(family: str, inputs: dict) -> int:
    labels = inputs["labels"]
    return int((labels[:, 1:] if family == "decoder" else labels).ne(-100).sum())


def run(model, family: str, batches: list[dict], weights: list[float]) -> dict[str, torch.Tensor]:
    """Hidden states, logits, loss and gradients of `batches`, joined along the sequence; the loss weighted so that
    documents run one by one give the packed row's mean."""
    model.zero_grad()
    outputs = [model(**inputs, output_hidden_states=True) for inputs in batches]
    loss = sum(weight * output.loss for weight, output in zip(weights, outputs))
    loss.backward()
    states = [
        output.encoder_hidden_states + output.decoder_hidden_states if family == "seq2seq" else output.hidden_states
        for output in outputs
    ]
    result = {f"hidden {i}": torch.cat(layer, 1).detach() for i, layer in enumerate(zip(*states))}
    result["logits"] = torch.cat([output.logits for output in outputs], 1).detach()
    result["loss"] = loss.detach()
    result.update({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    return result


def largest_difference(ours: dict, reference: dict) -> tuple[float, str]:
    """The largest difference of any tensor, relative to the largest value of its kind in the reference
    (activations: hidden states, logits, loss; or gradients), and which tensor has it. Per kind, not per tensor:
    a gradient that is zero in exact arithmetic (a key projection's bias) is all rounding noise."""

    def kind(name: str) -> str:
        return "activations" if name.startswith("hidden") or name in ("logits", "loss") else "gradients"

    scale = {}
    for name, tensor in reference.items():
        scale[kind(name)] = max(scale.get(kind(name), 0.0), tensor.abs().max().item())
    worst, where = 0.0, ""
    for name, tensor in reference.items():
        difference = (ours[name] - tensor).abs().max().item() / (scale[kind(name)] or 1.0) if name in ours else 1.0
        if difference > worst:
            worst, where = difference, name
    return worst, where


def use_backend(model, backend: str) -> None:
    if backend == "flash":  # set_attn_implementation would look for a flash package or hub kernel by this name
        model.config._attn_implementation = FLASH
    else:
        model.set_attn_implementation({"flex": "flex_attention", "sdpa": "sdpa"}[backend])


def exact_cell(family: str, layer_type: str, backend: str, args, device: str) -> dict:
    """The packed row under `backend` against its documents run one by one under sdpa (fp32: the reference); the
    control is the row read as one document. Flash also runs the documents alone, which shows how much of its
    difference is its bf16 rounding rather than the packing (flex would compile for every length: not run)."""
    model = tiny_model(family, layer_type, device)
    alone, packed, one_document = document_batches(family, args.tiny, device)
    total = sum(targets_of(family, inputs) for inputs in alone)
    weights = [targets_of(family, inputs) / total for inputs in alone]
    use_backend(model, "sdpa")
    reference = run(model, family, alone, weights)
    control, _ = largest_difference(run(model, family, [one_document], [1.0]), reference)
    use_backend(model, backend)
    try:
        result = run(model, family, [packed], [1.0])
        alone_here = run(model, family, alone, weights) if backend == "flash" else None
    except ValueError as refusal:  # the model's one-line refusal of this layer type under this backend
        return {"outcome": "refused", "why": str(refusal).splitlines()[0]}
    difference, where = largest_difference(result, reference)
    cell = {"difference": difference, "at": where, "control": control}
    if alone_here is not None:
        cell["alone_vs_sdpa"], _ = largest_difference(alone_here, reference)
    passed = difference <= TOLERANCE[backend] and control > 10 * difference
    return {"outcome": "pass" if passed else "FAIL", **cell}


def exact_part(args, report: dict, device: str, deadline: float) -> None:
    for backend in args.backends:
        for family in args.families:
            for layer_type in args.layer_types:
                if time.perf_counter() > deadline:
                    report["exact_cut_off"] = "--time-budget spent; later cells not run"
                    return
                started = time.perf_counter()
                cell = exact_cell(family, layer_type, backend, args, device)
                cell.update(family=family, layer_type=layer_type, backend=backend)
                cell["seconds"] = time.perf_counter() - started
                report["exact"].append(cell)
                print(json.dumps(cell), flush=True)
                write(report, args, "exact")


# --- speed: packed against padded training ----------------------------------------------------------------------


def speed_part(args, report: dict, device: str) -> None:
    packing = _packing_benchmark()
    precision = args.mixed_precision or ("bf16" if device == "cuda" else "no")
    speed_args = packing.parse_args(
        ["--budget", str(args.budget), "--preset", args.preset, "--families", *args.families]
        + ["--documents", *args.documents, "--mixed-precision", precision]
        + (["--tiny"] if args.tiny else [])
    )
    report["mixed_precision"] = precision
    with tempfile.TemporaryDirectory() as scratch:
        for kind in args.documents:
            for family in args.families:
                try:
                    section = packing.family_section(family, kind, speed_args, Path(scratch))
                except (ValueError, RuntimeError) as failure:  # a run that fails is reported, the others still run
                    section = {"documents": kind, "failed": str(failure).splitlines()[0]}
                report["speed"].append({"family": family, **section})
                write(report, args, "speed")


# --- the report -------------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    lines = [
        "# Packed rows on one GPU: exactness per backend, and packed against padded training speed",
        "",
        f"- machine: {report['machine']['device']}, {report['machine']['platform']}, torch "
        f"{report['machine']['torch']}" + (f" ({report['note']})" if report["note"] else ""),
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        "",
    ]
    if report["exact"]:
        lines += [
            "## A packed row against its documents run one by one",
            "",
            "Largest difference over hidden states, logits, loss and gradients, relative to each tensor's largest "
            "value. The reference is the documents run one by one under sdpa (fp32); the control reads the same row as "
            "one document; flash also runs the documents alone, showing its own (bf16) share of the difference. "
            "Tolerance: "
            + ", ".join(f"{backend} {value:g}" for backend, value in TOLERANCE.items())
            + " (flash runs bf16 inside attention).",
            "",
            "| backend | family | layer type | outcome | packed vs alone under sdpa (where) | control | "
            "alone vs alone under sdpa |",
            "|---|---|---|---|---|---|---|",
        ]
        for cell in report["exact"]:
            if cell["outcome"] == "refused":
                detail, control, agreement = f"refused: {cell['why']}", "—", "—"
            else:
                detail, control = f"{cell['difference']:.2e} ({cell['at']})", f"{cell['control']:.2e}"
                agreement = f"{cell['alone_vs_sdpa']:.2e}" if "alone_vs_sdpa" in cell else "—"
            lines.append(
                f"| {cell['backend']} | {cell['family']} | {cell['layer_type']} | {cell['outcome']} | {detail} | "
                f"{control} | {agreement} |"
            )
        if "exact_cut_off" in report:
            lines.append(f"\n{report['exact_cut_off']}.")
        lines.append("")
    for section in report["speed"]:
        if "failed" in section:
            lines += [f"## Training speed, {section['family']}, documents: {section['documents']}: failed", "",
                      f"{section['failed']}", ""]  # fmt: skip
            continue
        heading = (
            f"## Training speed, {section['family']}, documents: {section['documents']} (rows of "
            f"{section['block_size']}, preset {report['settings']['preset']}, "
            f"mixed precision: {report['mixed_precision']})"
        )
        lines += [heading, "", *_packing_benchmark().section_table(section), ""]
    return "\n".join(lines)


def write(report: dict, args, part: str) -> None:
    name = f"packing_gpu_{part}" + ("_tiny" if args.tiny else "")
    write_results(args.output_dir, name, report, markdown(report))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets.disable_progress_bars()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 cells compare at 1e-4
    for part in ("exact", "speed"):
        if part not in args.parts:
            continue
        started = time.perf_counter()
        report = {
            "machine": {
                "device": torch.cuda.get_device_name()
                if device == "cuda"
                else f"CPU ({torch.get_num_threads()} threads)",
                "platform": platform.platform(),
                "torch": torch.__version__,
            },
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": args.command,
            "note": args.note,
            "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
            "exact": [],
            "speed": [],
        }
        if part == "exact":
            exact_part(args, report, device, started + args.time_budget)
        else:
            speed_part(args, report, device)
        report["wall_time_s"] = time.perf_counter() - started
        write(report, args, part)
        print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
