"""ONNX export of a coreformer model folder: one graph per piece of the head, checked with onnxruntime.

    export_onnx(source, out, check=False) -> report       the folder `out`: graphs, config, tokenizer, manifest

What is exported (`torch.onnx.export(..., dynamo=True)`, eager attention, every axis but the hidden ones dynamic):

    family   head                           graph                    inputs -> outputs
    encoder  every head                     model.onnx               input_ids, attention_mask[, token_type_ids]
                                                                     -> the head's outputs (logits, start_logits /
                                                                     end_logits, last_hidden_state); multiple choice
                                                                     takes (batch, choices, sequence) inputs
    decoder  causal LM                      model.onnx               input_ids, attention_mask
                                                                     -> logits, present.N.key, present.N.value
                                            decoder_with_past.onnx   input_ids, attention_mask (past + new),
                                                                     past_key_values.N.key / .value
                                                                     -> logits, present.N.key / .value
             base model, classification     model.onnx               input_ids, attention_mask -> the head's outputs
    seq2seq  conditional generation         encoder_model.onnx       input_ids, attention_mask -> last_hidden_state
                                            decoder_model.onnx       decoder_input_ids, encoder_hidden_states,
                                                                     encoder_attention_mask -> logits,
                                                                     present.N.decoder.key / .value,
                                                                     present.N.encoder.key / .value (cross-attention)
                                            decoder_with_past_model  decoder_input_ids, encoder_attention_mask,
                                              .onnx                  past_key_values.N.decoder.* / .encoder.*
                                                                     -> logits, present.N.decoder.key / .value
             base model, classification     model.onnx               input_ids, attention_mask -> the head's outputs
                                                                     (decoder inputs: input_ids shifted right, the
                                                                     heads' default; the classifier reads the last eos)

Key/value tensors are (batch, kv_heads, length, head_dim), as transformers' caches hold them ("mla" layers: the
(batch, 1, length, kv_lora_rank) latents and (batch, 1, length, head_dim) rotary keys they cache); every layer keeps
every key (a sliding layer's window is applied by its mask), so all of them share one length. Greedy decoding with
the cache graphs: run model.onnx on the prompt, then decoder_with_past.onnx on each new token with the presents of
the previous step as its past and the attention mask grown by one column (seq2seq: encoder_model.onnx once,
decoder_model.onnx on the start token, then decoder_with_past_model.onnx with the decoder presents of the previous
step and the encoder presents of the first).

Attention is exported in its eager form (matmul + softmax over the mask transformers' mask builders make): under
`torch.export` the sdpa path's causal flag depends on the symbolic query length, and the sliding / strided sparse
kernels run only under sdpa, so the eager form is the one graph that holds every layer type. Layer types that
cannot be exported are refused by name: the causal LM and seq2seq generation graphs carry keys and values, so layer
types whose cache holds something else ("linear": running sums of feature-mapped keys) are refused there
(`refuse_uncachable`); every layer type exports in the graphs without a cache (encoder heads, base models,
classification heads).

`check=True` runs every graph with onnxruntime at two batch/length shapes different from the export shape (padded
rows included) against the same computation in PyTorch, and for causal LMs and seq2seq generation greedy decoding
through the cache graphs against `model.generate`; the report holds the largest difference and the tokens.
"""

import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from ..compat import output_cache, with_cache
from ..families import Family, family_of_model_type, head_of_class
from ..hub.folders import prepare_for_serving, saved_tokenizer, staged_folder
from ..hub.publishing import CONFIG_FILES, PUSHED_TOKENIZER_FILES
from ..layer_types import LAYER_TYPES
from ..native.parity import (
    SAMPLE_TEXTS,
    ExportCheckError,
    allowed_difference,
    check_summary,
    magnitude,
    max_abs_difference,
)

GREEDY_STEPS = 5
EXPORT_SHAPE = (2, 7)  # (batch, length) the graphs are traced at; checks use others
CHECK_SHAPES = ((1, 4), (3, 11))
MANIFEST_NAME = "onnx_export.json"

# The cache layers the graphs' key/value tensors can carry (a layer type's `cache_layer`, layer_types.py).
KEY_VALUE_CACHE_LAYERS = ("full_attention", "sliding_attention")

# Layer types no graph can hold, and why.
UNEXPORTABLE_LAYER_TYPES = {
    "lsh": "its hash-sort-chunk kernel pads to whole chunks and sorts, which the exporter traces at one length only",
    "gated_deltanet": "its chunked delta rule solves triangular systems (torch.linalg.solve_triangular), which no ONNX "
    "operator computes",
}

# Inputs of the heads whose tensors are not (batch, sequence).
INPUT_AXES = {"AutoModelForMultipleChoice": ("batch", "choices", "sequence")}


@dataclass
class Graph:
    """One ONNX graph: a module taking its inputs positionally, their names and dynamic axes, its output names.

    `example(batch, length)` makes inputs of that shape (the cache graph: a past of `length` tokens and new tokens).
    """

    name: str
    module: nn.Module
    input_names: list[str]
    output_names: list[str]
    axes: dict[str, dict[int, str]]  # input name -> {axis: dimension name}
    example: Callable[[int, int], list[torch.Tensor]]
    per_token: dict[str, str] = field(default_factory=dict)  # output -> the (batch, sequence) mask input it follows

    @property
    def file_name(self) -> str:
        return f"{self.name}.onnx"


class NamedInputs(nn.Module):
    """Calls `function(model, **inputs)` with the positional tensors named, and returns the named outputs as a tuple
    (torch.onnx.export traces positional tensors in and a tuple out)."""

    def __init__(self, model: nn.Module, input_names: list[str], function: Callable[..., tuple[torch.Tensor, ...]]):
        super().__init__()
        self.model = model
        self.input_names = input_names
        self.function = function

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.function(self.model, **dict(zip(self.input_names, inputs, strict=True)))


def head_outputs(output, names: list[str]) -> tuple[torch.Tensor, ...]:
    return tuple(output[name] for name in names)


def output_names_of(model: nn.Module, inputs: dict[str, torch.Tensor], **options) -> list[str]:
    """The tensor fields a head returns (no loss, cache, hidden states or attentions)."""
    with torch.no_grad():
        output = model(**inputs, **options)
    return [name for name, value in output.items() if name != "loss" and isinstance(value, torch.Tensor)]


def random_ids(shape: tuple[int, ...], vocab_size: int, generator: torch.Generator, low: int = 3) -> torch.Tensor:
    return torch.randint(low, vocab_size, shape, generator=generator)


def padding_mask(shape: tuple[int, ...], *, left: bool) -> torch.Tensor:
    """Ones, with the last rows (along the first axis) padded by 1, 2, ... positions (left or right); (..., T)."""
    mask = torch.ones(shape, dtype=torch.long)
    for row in range(1, shape[0]):
        pad = min(row, shape[-1] - 1)
        if left:
            mask[row, ..., :pad] = 0
        else:
            mask[row, ..., shape[-1] - pad :] = 0
    return mask


# --- graph builders, one per family ---


def encoder_graphs(model: nn.Module, family: Family, auto_class: str) -> list[Graph]:
    """One graph of the whole head over (batch, sequence) inputs (multiple choice: (batch, choices, sequence))."""
    config = model.config
    axes_names = INPUT_AXES.get(auto_class, ("batch", "sequence"))
    input_names = ["input_ids", "attention_mask"] + (["token_type_ids"] if config.type_vocab_size > 0 else [])

    def example(batch: int, length: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(batch * 1000 + length)
        shape = (batch, 2, length) if len(axes_names) == 3 else (batch, length)
        tensors = {
            "input_ids": random_ids(shape, config.vocab_size, generator),
            "attention_mask": padding_mask(shape, left=False),
            "token_type_ids": torch.randint(0, max(config.type_vocab_size, 1), shape, generator=generator),
        }
        return [tensors[name] for name in input_names]

    outputs = output_names_of(model, dict(zip(input_names, example(*EXPORT_SHAPE), strict=True)))

    def run(model, **inputs):
        return head_outputs(model(**inputs), outputs)

    axes = {name: dict(enumerate(axes_names)) for name in input_names}
    per_token = {name: "attention_mask" for name in outputs if name not in ("pooler_output",)}
    return [Graph("model", NamedInputs(model, input_names, run), input_names, outputs, axes, example, per_token)]


def cache_names(prefix: str, num_layers: int) -> list[str]:
    return [f"{prefix}.{layer}.{kind}" for layer in range(num_layers) for kind in ("key", "value")]


def flat_cache(cache) -> list[torch.Tensor]:
    """(key, value) of every layer of a transformers Cache, in order: each (B, kv_heads, length, head_dim)."""
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]


def refuse_uncachable(layer_types: list[str]) -> None:
    """ValueError for layer types whose cache is not keys and values, naming them and what would export."""
    refused = [
        name for name in dict.fromkeys(layer_types) if LAYER_TYPES[name].cache_layer not in KEY_VALUE_CACHE_LAYERS
    ]
    if refused:
        cached = [name for name, layer_type in LAYER_TYPES.items() if layer_type.cache_layer in KEY_VALUE_CACHE_LAYERS]
        raise ValueError(
            f"This decoder has {refused} attention layers, whose cache is not keys and values (a running state "
            f"in a custom cache layer), so the ONNX cache graphs (past_key_values in, present out) cannot carry it. "
            f"Layer types that export with a cache: {', '.join(cached)}; the base models and classification heads "
            f"export with every layer type (no cache)."
        )


def refuse_unexportable(config) -> None:
    """ValueError for a model with layer types that no ONNX graph can hold, naming them and why."""
    used = {name for stack in config.stack_layer_types() for name in getattr(config, stack)}
    refused = sorted(used & set(UNEXPORTABLE_LAYER_TYPES))
    if refused:
        reasons = "; ".join(f"'{name}': {UNEXPORTABLE_LAYER_TYPES[name]}" for name in refused)
        raise ValueError(
            f"This model has {refused} attention layers, which do not export to ONNX ({reasons}). Export a model "
            f"whose layer types are among {sorted(set(LAYER_TYPES) - set(UNEXPORTABLE_LAYER_TYPES))}."
        )


def decoder_graphs(model: nn.Module, family: Family, auto_class: str) -> list[Graph]:
    """The causal LM: a prefill graph returning the cache and a graph taking it; other heads: one graph, no cache."""
    config = model.config
    input_names = ["input_ids", "attention_mask"]

    def example(batch: int, length: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(batch * 1000 + length)
        return [random_ids((batch, length), config.vocab_size, generator), padding_mask((batch, length), left=True)]

    axes = {name: {0: "batch", 1: "sequence"} for name in input_names}
    if auto_class != family.language_model_auto_class:
        return [_decoder_head_graph(model, input_names, axes, example)]
    return _decoder_cache_graphs(model, input_names, axes, example)


def _decoder_head_graph(
    model: nn.Module, input_names: list[str], axes: dict, example: Callable[[int, int], list[torch.Tensor]]
) -> Graph:
    """A decoder head other than the causal LM (sequence classification, ...): one graph, no cache."""
    outputs = output_names_of(model, dict(zip(input_names, example(*EXPORT_SHAPE), strict=True)), use_cache=False)

    def run(model, **inputs):
        return head_outputs(model(**inputs, use_cache=False), outputs)

    per_token = {name: "attention_mask" for name in outputs}
    return Graph("model", NamedInputs(model, input_names, run), input_names, outputs, axes, example, per_token)


def _decoder_cache_graphs(
    model: nn.Module, input_names: list[str], axes: dict, example: Callable[[int, int], list[torch.Tensor]]
) -> list[Graph]:
    """The causal LM: a prefill graph returning the cache (`model`) and a graph taking it (`decoder_with_past`)."""
    config = model.config
    refuse_uncachable(model.model.decoder.layer_types)
    num_layers = config.num_hidden_layers
    presents = cache_names("present", num_layers)
    pasts = cache_names("past_key_values", num_layers)

    # A plain DynamicCache keeps every key of every layer: sliding layers too (their window is the mask's, which
    # the stack builds for each layer type whatever the cache holds), so all past tensors share one length.
    def prefill(model, input_ids, attention_mask):
        output = model(input_ids=input_ids, attention_mask=attention_mask, **with_cache(DynamicCache()))
        return (output.logits, *flat_cache(output_cache(output)))

    def step(model, input_ids, attention_mask, **past):
        cache = DynamicCache()
        for layer in range(num_layers):
            cache.update(past[f"past_key_values.{layer}.key"], past[f"past_key_values.{layer}.value"], layer)
        output = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **with_cache(cache))
        return (output.logits, *flat_cache(output_cache(output)))

    prefill_module = NamedInputs(model, input_names, prefill)

    def example_with_past(batch: int, length: int) -> list[torch.Tensor]:
        # a prompt of `length` tokens through the prefill graph's computation, then 1 + length // 4 new tokens
        generator = torch.Generator().manual_seed(batch * 1000 + length + 1)
        prompt = example(batch, length)
        with torch.no_grad():
            past = list(prefill_module(*prompt))[1:]
        new = 1 + length // 4
        ids = random_ids((batch, new), config.vocab_size, generator)
        mask = torch.cat([prompt[1], torch.ones(batch, new, dtype=torch.long)], dim=1)
        return [ids, mask, *past]

    step_inputs = [*input_names, *pasts]
    step_axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "past_and_sequence"}}
    step_axes.update({name: {0: "batch", 2: "past_sequence"} for name in pasts})
    return [
        Graph("model", prefill_module, input_names, ["logits", *presents], axes, example, {"logits": "attention_mask"}),
        Graph(
            "decoder_with_past",
            NamedInputs(model, step_inputs, step),
            step_inputs,
            ["logits", *presents],
            step_axes,
            example_with_past,
        ),
    ]


def seq2seq_source(config, batch: int, length: int) -> list[torch.Tensor]:
    """Random source ids, each row ending in eos (sequence classification pools at the last eos), unpadded."""
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    ids = random_ids((batch, length), config.vocab_size, generator)
    ids[:, -1] = config.eos_token_id
    return [ids, torch.ones(batch, length, dtype=torch.long)]


def seq2seq_target(config, batch: int, length: int) -> torch.Tensor:
    """Random decoder ids behind the start token."""
    generator = torch.Generator().manual_seed(batch * 1000 + length + 2)
    ids = random_ids((batch, length), config.vocab_size, generator)
    ids[:, 0] = config.decoder_start_token_id
    return ids


def seq2seq_whole_model_graph(model: nn.Module) -> Graph:
    """Base model and classification heads: one graph of the whole model; its decoder inputs are input_ids shifted
    right, the heads' own default (the classifier reads them at the eos)."""
    input_names = ["input_ids", "attention_mask"]
    source = partial(seq2seq_source, model.config)
    outputs = output_names_of(model, dict(zip(input_names, source(*EXPORT_SHAPE), strict=True)))

    def run(model, **inputs):
        return head_outputs(model(**inputs), outputs)

    axes = {name: {0: "batch", 1: "sequence"} for name in input_names}
    return Graph("model", NamedInputs(model, input_names, run), input_names, outputs, axes, source)


def seq2seq_encoder_graph(model: nn.Module) -> Graph:
    """Generation, step 1: the encoder, on right-padded sources -> last_hidden_state."""
    input_names = ["input_ids", "attention_mask"]

    def encode(encoder, input_ids, attention_mask):
        return (encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state,)

    def example(batch: int, length: int) -> list[torch.Tensor]:
        ids, _ = seq2seq_source(model.config, batch, length)
        return [ids, padding_mask((batch, length), left=False)]

    return Graph(
        "encoder_model",
        NamedInputs(model.get_encoder(), input_names, encode),
        input_names,
        ["last_hidden_state"],
        {name: {0: "batch", 1: "encoder_sequence"} for name in input_names},
        example,
        {"last_hidden_state": "attention_mask"},
    )


def seq2seq_present_names(num_layers: int, part: str, prefix: str = "present") -> list[str]:
    """<prefix>.N.<part>.key / .value of every layer; part "decoder" (self-attention) or "encoder" (cross); prefix
    "present" (outputs) or "past_key_values" (inputs)."""
    return [f"{prefix}.{layer}.{part}.{kind}" for layer in range(num_layers) for kind in ("key", "value")]


def seq2seq_first_decoder_graph(model: nn.Module, encoder_graph: Graph) -> Graph:
    """Generation, step 2: the decoder on a target prefix with the encoder output -> logits and every present (its
    own keys/values and the cross-attention ones, which later steps reuse)."""
    num_layers = model.config.decoder_layers
    input_names = ["decoder_input_ids", "encoder_hidden_states", "encoder_attention_mask"]

    def decode(model, decoder_input_ids, encoder_hidden_states, encoder_attention_mask):
        output = model(
            attention_mask=encoder_attention_mask,
            decoder_input_ids=decoder_input_ids,
            encoder_outputs=(encoder_hidden_states,),
            **with_cache(EncoderDecoderCache(DynamicCache(), DynamicCache())),
            use_cache=True,
        )
        cache = output_cache(output)
        return (output.logits, *flat_cache(cache.self_attention_cache), *flat_cache(cache.cross_attention_cache))

    def example(batch: int, length: int) -> list[torch.Tensor]:
        source_ids, source_mask = encoder_graph.example(batch, length + 2)
        with torch.no_grad():
            (hidden_states,) = encoder_graph.module(source_ids, source_mask)
        return [seq2seq_target(model.config, batch, length), hidden_states, source_mask]

    outputs = ["logits", *seq2seq_present_names(num_layers, "decoder"), *seq2seq_present_names(num_layers, "encoder")]
    axes = {
        "decoder_input_ids": {0: "batch", 1: "decoder_sequence"},
        "encoder_hidden_states": {0: "batch", 1: "encoder_sequence"},
        "encoder_attention_mask": {0: "batch", 1: "encoder_sequence"},
    }
    return Graph("decoder_model", NamedInputs(model, input_names, decode), input_names, outputs, axes, example)


def seq2seq_cached_step_graph(model: nn.Module, first_graph: Graph) -> Graph:
    """Generation, step 3 onwards: new decoder tokens with the pasts (the decoder's growing, the encoder's from the
    first decoder graph) -> logits and the decoder's presents."""
    num_layers = model.config.decoder_layers
    self_presents = seq2seq_present_names(num_layers, "decoder")
    self_pasts = seq2seq_present_names(num_layers, "decoder", prefix="past_key_values")
    cross_pasts = seq2seq_present_names(num_layers, "encoder", prefix="past_key_values")

    def step(model, decoder_input_ids, encoder_attention_mask, **past):
        # The cross-attention keys/values are the cache's: marked computed, never projected again, so the encoder
        # output is only needed for its shape (zeros stand in for it).
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        for layer in range(num_layers):
            for part, attention_cache in (
                ("decoder", cache.self_attention_cache),
                ("encoder", cache.cross_attention_cache),
            ):
                attention_cache.update(
                    past[f"past_key_values.{layer}.{part}.key"], past[f"past_key_values.{layer}.{part}.value"], layer
                )
            cache.is_updated[layer] = True
        encoder_key = past["past_key_values.0.encoder.key"]  # (B, kv_heads, S, head_dim)
        placeholder = encoder_key.new_zeros(encoder_key.shape[0], encoder_key.shape[2], model.config.hidden_size)
        output = model(
            attention_mask=encoder_attention_mask,
            decoder_input_ids=decoder_input_ids,
            encoder_outputs=(placeholder,),
            use_cache=True,
            **with_cache(cache),
        )
        return (output.logits, *flat_cache(output_cache(output).self_attention_cache))

    def example(batch: int, length: int) -> list[torch.Tensor]:
        # a target prefix of `length` tokens through the first decoder graph's computation, then 1 + length // 4 new
        first = first_graph.example(batch, length)
        with torch.no_grad():
            presents = list(first_graph.module(*first))[1:]
        new = random_ids((batch, 1 + length // 4), model.config.vocab_size, torch.Generator().manual_seed(length))
        return [new, first[2], *presents]

    input_names = ["decoder_input_ids", "encoder_attention_mask", *self_pasts, *cross_pasts]
    axes = {
        "decoder_input_ids": {0: "batch", 1: "decoder_sequence"},
        "encoder_attention_mask": {0: "batch", 1: "encoder_sequence"},
    }
    axes.update({name: {0: "batch", 2: "past_decoder_sequence"} for name in self_pasts})
    axes.update({name: {0: "batch", 2: "encoder_sequence"} for name in cross_pasts})
    module = NamedInputs(model, input_names, step)
    return Graph("decoder_with_past_model", module, input_names, ["logits", *self_presents], axes, example)


def seq2seq_graphs(model: nn.Module, family: Family, auto_class: str) -> list[Graph]:
    """Conditional generation: the encoder graph, the first decoder graph and the cached step; other heads: the
    whole model."""
    if auto_class != family.language_model_auto_class:
        return [seq2seq_whole_model_graph(model)]
    refuse_uncachable(model.model.decoder.layer_types)
    encoder = seq2seq_encoder_graph(model)
    first = seq2seq_first_decoder_graph(model, encoder)
    return [encoder, first, seq2seq_cached_step_graph(model, first)]


GRAPH_BUILDERS: dict[str, Callable[[nn.Module, Family, str], list[Graph]]] = {
    "encoder": encoder_graphs,
    "decoder": decoder_graphs,
    "seq2seq": seq2seq_graphs,
}


# --- loading, refusing, exporting, checking ---


def load_source(source: Path, label: str) -> tuple[nn.Module, Family, str]:
    """The model of a coreformer folder, loaded with the Auto class of its head under eager attention; errors name
    the folder as `label`."""
    import transformers  # the Auto classes know coreformer's: importing this module imported the package

    config_path = source / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{label} has no config.json: pass a model folder saved with save_pretrained.")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    try:
        family = family_of_model_type(model_type)
    except ValueError:
        raise ValueError(
            f"{label} holds a {model_type!r} model, not a coreformer one: export_onnx exports coreformer folders. "
            f"`coreformer export FOLDER OUT --to onnx` (coreformer.export.export_to) also takes a native folder of "
            f"an architecture coreformer reads, converting it first."
        ) from None
    architectures = config.get("architectures") or [family.language_model.class_name]
    _, head = head_of_class(architectures[0])
    model = getattr(transformers, head.auto_class).from_pretrained(source, attn_implementation="eager")
    return model.eval(), family, head.auto_class


def export_graph(graph: Graph, folder: Path) -> None:
    import torch.onnx

    dims: dict[str, torch.export.Dim] = {}
    dynamic_shapes = tuple(
        {axis: dims.setdefault(name, torch.export.Dim(name)) for axis, name in graph.axes.get(input_name, {}).items()}
        for input_name in graph.input_names
    )
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            graph.module,
            tuple(graph.example(*EXPORT_SHAPE)),
            folder / graph.file_name,
            input_names=graph.input_names,
            output_names=graph.output_names,
            dynamic_shapes={"inputs": dynamic_shapes},
            dynamo=True,
            verbose=False,
        )


def _session(path: Path):
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def check_graph(graph: Graph, folder: Path) -> tuple[float, float]:
    """The largest |onnxruntime - PyTorch| over every output at the CHECK_SHAPES, and the largest |PyTorch output|
    (the scale the tolerance grows with: native.parity.allowed_difference)."""
    session = _session(folder / graph.file_name)
    largest, scale = 0.0, 0.0
    for shape in CHECK_SHAPES:
        inputs = graph.example(*shape)
        with torch.no_grad():
            expected = graph.module(*inputs)
        got = session.run(graph.output_names, {name: t.numpy() for name, t in zip(graph.input_names, inputs)})
        named = dict(zip(graph.input_names, inputs, strict=True))
        for name, reference, value in zip(graph.output_names, expected, got, strict=True):
            mask = named.get(graph.per_token.get(name, ""))
            largest = max(largest, max_abs_difference(reference, torch.from_numpy(value), mask))
            scale = max(scale, magnitude(reference, mask))
    return largest, scale


def without_eos(logits: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """(B, vocab) logits with eos ruled out, as generate's min_new_tokens does (so both run every step)."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return logits.index_fill(-1, torch.tensor(eos, dtype=torch.long), float("-inf")) if eos else logits


def check_greedy(model: nn.Module, folder: Path, graphs: list[Graph]) -> dict[str, list[list[int]]]:
    """Greedy tokens from the prefill + cache graphs and from `model.generate` on the same prompt."""
    prefill, step = (_session(folder / graph.file_name) for graph in graphs)
    generator = torch.Generator().manual_seed(7)
    prompt = random_ids((2, 5), model.config.vocab_size, generator)
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        expected = model.generate(
            prompt, attention_mask=mask, max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS, do_sample=False
        )[:, prompt.shape[1] :]
    outputs = prefill.run(None, {"input_ids": prompt.numpy(), "attention_mask": mask.numpy()})
    tokens = []
    for _ in range(GREEDY_STEPS):
        next_ids = without_eos(torch.from_numpy(outputs[0][:, -1]), model).argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(next_ids)
        mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
        feeds = {"input_ids": next_ids.numpy(), "attention_mask": mask.numpy()}
        feeds.update(zip(graphs[1].input_names[2:], outputs[1:]))
        outputs = step.run(None, feeds)
    return {"onnxruntime": torch.cat(tokens, 1).tolist(), "pytorch": expected.tolist()}


def check_seq2seq_greedy(model: nn.Module, folder: Path, graphs: list[Graph]) -> dict[str, list[list[int]]]:
    """Greedy tokens from the encoder, first-step decoder and cached decoder graphs, and from `model.generate`."""
    encoder, first, step = (_session(folder / graph.file_name) for graph in graphs)
    generator = torch.Generator().manual_seed(7)
    source = random_ids((2, 6), model.config.vocab_size, generator)
    source[:, -1] = model.config.eos_token_id
    mask = torch.ones_like(source)
    with torch.no_grad():
        expected = model.generate(
            source, attention_mask=mask, max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS, do_sample=False
        )[:, 1:]  # after the decoder start token
    (hidden,) = encoder.run(None, {"input_ids": source.numpy(), "attention_mask": mask.numpy()})
    start = np.full((2, 1), model.config.decoder_start_token_id, dtype=np.int64)
    outputs = first.run(
        None, {"decoder_input_ids": start, "encoder_hidden_states": hidden, "encoder_attention_mask": mask.numpy()}
    )
    layers = model.config.decoder_layers
    self_past, cross_past = outputs[1 : 1 + 2 * layers], outputs[1 + 2 * layers :]
    past_names = graphs[2].input_names[2:]
    tokens = []
    for _ in range(GREEDY_STEPS):
        next_ids = without_eos(torch.from_numpy(outputs[0][:, -1]), model).argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(next_ids)
        feeds = {"decoder_input_ids": next_ids.numpy(), "encoder_attention_mask": mask.numpy()}
        feeds.update(zip(past_names, [*self_past, *cross_past], strict=True))
        outputs = step.run(None, feeds)
        self_past = outputs[1:]
    return {"onnxruntime": torch.cat(tokens, 1).tolist(), "pytorch": expected.tolist()}


# graph names -> the greedy decoding check through them
GREEDY_CHECKS = {
    ("model", "decoder_with_past"): check_greedy,
    ("encoder_model", "decoder_model", "decoder_with_past_model"): check_seq2seq_greedy,
}


def copy_companions(source: Path, folder: Path) -> list[str]:
    """config.json, generation_config.json and the tokenizer files, so the folder serves on its own."""
    copied = []
    for name in (*CONFIG_FILES, *PUSHED_TOKENIZER_FILES):
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)
            copied.append(name)
    return copied


def export_onnx(source: Path, out: Path, *, check: bool = False, label: str | None = None) -> dict:
    """Export the coreformer model folder `source` to ONNX graphs in the folder `out` (replaced atomically).
    `label`: how errors and the manifest name the source (default: the folder), e.g. the native folder a temporary
    coreformer folder was converted from.

    Returns {"source", "graphs": {name: {"inputs", "outputs"}}, "files": [...], "head": auto class, and with `check`
    "max_abs_diff" (onnxruntime against PyTorch at two shapes other than the export shape), "tolerance", for causal
    LMs and seq2seq generation "greedy_tokens" (onnxruntime through the cache graphs, and model.generate), and
    "check" (coreformer.native.parity.check_summary)}. ValueError when the folder is not a coreformer model or holds
    a layer type that does not export; ExportCheckError (a RuntimeError) when a check fails (nothing written).
    """
    source, out = Path(source), Path(out)
    label = str(source) if label is None else str(label)
    model, family, auto_class = load_source(source, label)
    refuse_unexportable(model.config)
    graphs = GRAPH_BUILDERS[family.name](model, family, auto_class)
    report: dict = {
        "source": label,
        "head": auto_class,
        "graphs": {graph.name: {"inputs": graph.input_names, "outputs": graph.output_names} for graph in graphs},
    }
    with staged_folder(out) as staging:
        for graph in graphs:
            export_graph(graph, staging)
        copy_companions(source, staging)
        if check:
            report.update(check_graphs(model, staging, graphs, tokenizer_ids_equal(source, staging)))
        prepare_for_serving(staging, causal_lm=auto_class == "AutoModelForCausalLM")
        report["files"] = sorted(path.name for path in staging.iterdir()) + [MANIFEST_NAME]
        (staging / MANIFEST_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def tokenizer_ids_equal(source: Path, folder: Path) -> bool | None:
    """Whether the tokenizer copied into `folder` gives the source folder's ids for the sample texts, as the native
    check compares them; None where the source holds no tokenizer."""
    reference = saved_tokenizer(source)
    if reference is None:
        return None
    copied = saved_tokenizer(folder)
    return copied is not None and all(
        reference(text)["input_ids"] == copied(text)["input_ids"] for text in SAMPLE_TEXTS
    )


def check_graphs(model: nn.Module, folder: Path, graphs: list[Graph], tokenizer_equal: bool | None = None) -> dict:
    """Every graph against PyTorch, greedy decoding through the cache graphs, and the copied tokenizer's ids
    (`tokenizer_equal`, from `tokenizer_ids_equal`); ExportCheckError when apart."""

    differences, scales = zip(*(check_graph(graph, folder) for graph in graphs), strict=True)
    report: dict = {"max_abs_diff": max(differences), "tolerance": allowed_difference(max(scales))}
    greedy_check = GREEDY_CHECKS.get(tuple(graph.name for graph in graphs))
    tokens = None
    if greedy_check is not None:
        tokens = report["greedy_tokens"] = greedy_check(model, folder, graphs)
    tokens_equal = None if tokens is None else tokens["onnxruntime"] == tokens["pytorch"]
    report["check"] = check_summary(report["max_abs_diff"], report["tolerance"], tokens_equal, tokenizer_equal)
    if report["max_abs_diff"] > report["tolerance"] or tokens_equal is False or tokenizer_equal is False:
        raise ExportCheckError(
            f"check failed: the ONNX graphs differ from PyTorch by {report['max_abs_diff']:.3g} (tolerance "
            f"{report['tolerance']:.3g}), greedy tokens equal: {tokens_equal}, tokenizer ids equal: {tokenizer_equal}"
            + (
                ""
                if tokens_equal is not False
                else f" (onnxruntime {tokens['onnxruntime']}, PyTorch {tokens['pytorch']})"
            )
            + "; nothing was written."
        )
    return report
