"""Attention maps: a coreformer model's attention probabilities for one text, drawn as heatmaps with token labels.

    attention_maps(model, tokenizer, text, *, target=None) -> {stack: AttentionMaps}
        stacks: "encoder" (encoder models, seq2seq encoder), "decoder" (decoder models, seq2seq decoder self-attention),
        "cross" (seq2seq decoder over the encoder); each holds per-layer probabilities (heads, queries, keys) and the
        query / key token labels. Computed under the model's own backend: layers whose kernel forms no probabilities
        recompute them beside it (linear layers write out φ(q)·φ(k) normalised), see `Attention._probabilities`.
    plot_head(maps, layer, head, ax=None) -> np.ndarray          one heatmap; returns exactly the array it drew
    plot_layer(maps, layer) -> (Figure, np.ndarray)              every head of a layer in a grid; (heads, queries, keys)
    save_attention_map(model, text, output, ...) -> np.ndarray   model object or saved folder -> PNG; returns the arrays

From a shell (the same as `save_attention_map`):

    coreformer attention-map FOLDER "text" [--layer L] [--head H] [--stack cross] -o map.png

Plots use matplotlib's object-oriented `Figure` (no pyplot state, no display needed); matplotlib is imported only
when something is drawn.
"""

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase

from ..hub.folders import folder_tokenizer


@dataclass
class AttentionMaps:
    """The attention probabilities of one stack for one text.

    probabilities: one entry per layer: (heads, queries, keys) float32, rows summing to 1 (kernels that never form
        the matrix write it out: `LayerKernel.probabilities`). A Linformer layer's keys are its `lowrank_k`
        projected rows.
    query_tokens / key_tokens: the token labels of the rows / columns.
    """

    stack: str
    probabilities: list[np.ndarray]
    query_tokens: list[str]
    key_tokens: list[str]

    @property
    def num_layers(self) -> int:
        return len(self.probabilities)

    def layer(self, layer: int) -> np.ndarray:
        """(heads, queries, keys) of `layer` (negative counts from the end); a clear error where there is none."""
        if not -self.num_layers <= layer < self.num_layers:
            raise ValueError(f"The {self.stack} stack has {self.num_layers} layers: layer {layer} does not exist.")
        return self.probabilities[layer]

    def labels(self, layer: int) -> tuple[list[str], list[str]]:
        """Row and column labels; Linformer layers' columns are projected rows, not tokens."""
        keys = self.layer(layer).shape[-1]
        key_tokens = self.key_tokens if keys == len(self.key_tokens) else [f"row {i}" for i in range(keys)]
        return self.query_tokens, key_tokens


def _token_labels(tokenizer: PreTrainedTokenizerBase, ids: torch.Tensor) -> list[str]:
    return tokenizer.convert_ids_to_tokens(ids.tolist())


def _layers(weights: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    # (1, H, T, S) per layer -> (H, T, S)
    return [w[0].detach().float().cpu().numpy() for w in weights]


@torch.no_grad()
def attention_maps(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    target: str | None = None,
) -> dict[str, AttentionMaps]:
    """The attention probabilities of `model` on `text`, per stack (under any backend).

    Args:
        model: any coreformer model (base model or head).
        tokenizer: its tokenizer.
        text: the input (the source, for seq2seq models).
        target: seq2seq only: the decoder-side text, fed as decoder inputs shifted right behind the start token (as in
            training). Default: the source shifted right (the model's own default decoder input).

    Returns:
        {"encoder": ...} for encoder models, {"decoder": ...} for decoder models, {"encoder", "decoder", "cross"} for
        seq2seq models.
    """
    if not text:
        raise ValueError("Attention maps need a non-empty text.")
    encoding = tokenizer(text, return_tensors="pt").to(model.device)
    inputs = {key: value for key, value in encoding.items() if key in ("input_ids", "attention_mask", "token_type_ids")}
    source_tokens = _token_labels(tokenizer, encoding["input_ids"][0])
    is_seq2seq = model.config.is_encoder_decoder
    if target is not None and not is_seq2seq:
        raise ValueError("`target` is the decoder-side text of a seq2seq model; this model has a single stack.")
    if is_seq2seq:
        source = inputs["input_ids"]
        if target is not None:
            source = tokenizer(text_target=target, return_tensors="pt")["input_ids"].to(model.device)
        start = torch.full_like(source[:, :1], model.config.decoder_start_token_id)
        inputs["decoder_input_ids"] = torch.cat([start, source[:, :-1]], dim=1)  # (1, T) shifted right

    was_training = model.training
    model.eval()
    no_cache = {"use_cache": False} if is_seq2seq or model.config.is_causal_stack else {}  # nothing to decode after
    try:
        output = model(**inputs, output_attentions=True, **no_cache)
    finally:
        model.train(was_training)

    if not is_seq2seq:
        stack = "decoder" if model.config.is_causal_stack else "encoder"
        return {stack: AttentionMaps(stack, _layers(output.attentions), source_tokens, source_tokens)}
    decoder_tokens = _token_labels(tokenizer, inputs["decoder_input_ids"][0])
    return {
        "encoder": AttentionMaps("encoder", _layers(output.encoder_attentions), source_tokens, source_tokens),
        "decoder": AttentionMaps("decoder", _layers(output.decoder_attentions), decoder_tokens, decoder_tokens),
        "cross": AttentionMaps("cross", _layers(output.cross_attentions), decoder_tokens, source_tokens),
    }


def plot_head(maps: AttentionMaps, layer: int, head: int, ax=None) -> np.ndarray:
    """Draw one head's (queries, keys) probabilities on `ax` (a new figure's axes if None), rows = queries.

    Returns the array drawn, which is `maps.layer(layer)[head]` itself.
    """
    from matplotlib.figure import Figure

    probabilities = maps.layer(layer)
    if not -probabilities.shape[0] <= head < probabilities.shape[0]:
        raise ValueError(f"{maps.stack} layer {layer} has {probabilities.shape[0]} heads: head {head} does not exist.")
    array = probabilities[head]
    if ax is None:
        size = max(4.0, 0.35 * max(array.shape))
        ax = Figure(figsize=(size, size), layout="constrained").add_subplot()
    queries, keys = maps.labels(layer)
    ax.imshow(array, vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest", aspect="auto")
    ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
    ax.set_yticks(range(len(queries)), queries, fontsize=7)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(f"{maps.stack} layer {layer % maps.num_layers} head {head % probabilities.shape[0]}", fontsize=9)
    return array


def plot_layer(maps: AttentionMaps, layer: int):
    """Every head of `layer` in a grid (as square as the head count allows), with one shared colour bar.

    Returns (Figure, array of shape (heads, queries, keys)), the array being exactly what was drawn.
    """
    from matplotlib.figure import Figure

    probabilities = maps.layer(layer)
    heads = probabilities.shape[0]
    columns = math.ceil(math.sqrt(heads))
    rows = math.ceil(heads / columns)
    cell = max(3.0, 0.3 * max(probabilities.shape[1:]))
    figure = Figure(figsize=(cell * columns + 1.0, cell * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    for head in range(heads):
        plot_head(maps, layer, head, ax=axes.flat[head])
    for ax in axes.flat[heads:]:
        ax.set_visible(False)
    figure.colorbar(axes.flat[0].images[0], ax=axes.ravel().tolist(), shrink=0.6, label="attention probability")
    figure.suptitle(f"{maps.stack} layer {layer % maps.num_layers}: all {heads} heads")
    return figure, probabilities


def _load(folder: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    # The base model holds every attention layer of any head; loading it eager avoids a backend switch.
    model = AutoModel.from_pretrained(folder, attn_implementation="eager")
    return model, folder_tokenizer(folder)


def save_attention_map(
    model: PreTrainedModel | str | os.PathLike,
    text: str,
    output: str | os.PathLike,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    layer: int = -1,
    head: int | None = None,
    stack: str | None = None,
    target: str | None = None,
    dpi: int = 120,
) -> np.ndarray:
    """Write the attention map of `text` to `output` (PNG, or any format matplotlib writes) and return what it drew.

    Args:
        model: a model object (then pass `tokenizer`) or a saved folder with its tokenizer.
        layer: the layer (default the last; negative counts from the end).
        head: one head, drawn alone; None draws every head of the layer in a grid.
        stack: "encoder" | "decoder" | "cross"; default the model's only stack, or "cross" for seq2seq models.
        target: decoder-side text of a seq2seq model (see `attention_maps`).

    Returns:
        (queries, keys) for one head, (heads, queries, keys) for the grid.
    """
    from matplotlib.figure import Figure

    if isinstance(model, (str, os.PathLike)):
        model, loaded_tokenizer = _load(model)
        tokenizer = tokenizer or loaded_tokenizer
    if tokenizer is None:
        raise ValueError("Pass the model's tokenizer with a model object (a folder brings its own).")
    maps = attention_maps(model, tokenizer, text, target=target)
    stack = stack or ("cross" if "cross" in maps else next(iter(maps)))
    if stack not in maps:
        raise ValueError(f"This model's stacks are {', '.join(maps)}; there is no {stack!r} stack.")
    if head is None:
        figure, arrays = plot_layer(maps[stack], layer)
    else:
        size = max(4.0, 0.35 * len(maps[stack].query_tokens))
        figure = Figure(figsize=(size + 1.0, size), layout="constrained")
        ax = figure.add_subplot()
        arrays = plot_head(maps[stack], layer, head, ax=ax)
        figure.colorbar(ax.images[0], ax=ax, shrink=0.8, label="attention probability")
    figure.savefig(output, dpi=dpi)
    return arrays
