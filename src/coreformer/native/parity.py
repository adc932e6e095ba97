"""THE parity check: how far two models' outputs are apart, and whether that is within the one tolerance of a dtype.

    tolerance(dtype="f32") -> float                       coreformer_settings.exports.CHECK_TOLERANCES, one per dtype
    allowed_difference(scale, dtype="f32") -> float       THE rule: that tolerance, times the outputs' scale above 1
    sample_inputs(model, tokenizer=None) -> dict          the right-padded batch every check runs both sides on
    SAMPLE_TEXTS                                          its texts, when there is a tokenizer (and whose ids an
                                                          exported tokenizer must reproduce)
    max_abs_difference(reference, found, mask) -> float   one output; per-token outputs over real tokens only
    magnitude(reference, mask) -> float                   its largest |value| there: the scale of one output
    output_differences(reference, found, mask) -> dict    every floating output both sides have, by name
    output_scale(reference, found, mask) -> float         the largest magnitude among those outputs
    compare_models(reference, model, inputs) -> Comparison   run both models in fp32 on `inputs`, then the above two
    greedy_tokens(model, inputs, new_tokens) -> tensor    the tokens greedy decoding adds (generative heads)
    within_tolerance(differences, dtype="f32", scale=0.0) -> bool
    check_summary(...) -> dict, ExportCheckError            what every exporter reports, and raises when apart

Every check compares with these: `coreformer convert --check` (transformers source vs converted folder),
`export --check` (coreformer vs the native folder reloaded in plain transformers), the ONNX check (onnxruntime vs
PyTorch) and the GGUF check (the file read back vs the native model). Padding positions are left out: no supported
architecture defines what a padding position outputs, and nothing attends to them.

The rule is relative where the outputs are large. Float rounding is relative to the values rounded: a trained model's
logits reach 10-20, where fp32 reordering alone (onnxruntime's kernels against PyTorch's) moves them by about 1e-5, a
relative 1e-6; a wrong conversion or export is off by a share of the outputs themselves. So a check accepts a largest
difference up to the dtype's tolerance times the largest output magnitude it compared, where that exceeds 1, and
exactly the tolerance below (an untrained model's outputs, near 0, are held to it absolutely).
"""

from collections.abc import Mapping
from typing import NamedTuple

import torch

from coreformer_settings.exports import CHECK_TOLERANCES

SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Converted and exported models compute the same logits.",
    "Short one.",
)
RANDOM_ROW_LENGTHS = (12, 9, 5)


def tolerance(dtype: str = "f32") -> float:
    """The largest max-abs output difference a check in `dtype` accepts."""
    if dtype not in CHECK_TOLERANCES:
        raise ValueError(f"no parity tolerance for dtype {dtype!r}; known: {', '.join(CHECK_TOLERANCES)}.")
    return CHECK_TOLERANCES[dtype]


def _random_rows(config, seed: int) -> list[list[int]]:
    """Rows of random ordinary ids (no special token), each ending in eos where the model has one (BART's classifier
    pools at the eos token)."""
    generator = torch.Generator().manual_seed(seed)
    special = {
        config.pad_token_id,
        config.bos_token_id,
        config.eos_token_id,
        getattr(config, "decoder_start_token_id", None),
    }
    ordinary = torch.tensor([i for i in range(config.vocab_size) if i not in special])
    rows = []
    for length in RANDOM_ROW_LENGTHS:
        row = ordinary[torch.randint(len(ordinary), (length,), generator=generator)].tolist()
        if config.eos_token_id is not None:
            row[-1] = config.eos_token_id
        rows.append(row)
    return rows


def sample_inputs(model: torch.nn.Module, tokenizer=None, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small right-padded batch for `model`: SAMPLE_TEXTS tokenized, or random ordinary ids without a tokenizer;
    token types for encoders that have them. Right padding is what every native architecture reproduces exactly on
    its real tokens (RoBERTa numbers positions of right-padded rows as coreformer does). Without a pad id there is
    one row: nothing can pad the others."""
    config = model.config
    if tokenizer is not None:
        rows = [tokenizer(text)["input_ids"] for text in SAMPLE_TEXTS]
    else:
        rows = _random_rows(config, seed)
    if config.pad_token_id is None:
        rows = rows[:1]
    longest = max(len(row) for row in rows)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    input_ids = torch.tensor([row + [pad] * (longest - len(row)) for row in rows])  # (B, T)
    attention_mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in rows])  # (B, T)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if getattr(config, "type_vocab_size", 1) > 1:
        inputs["token_type_ids"] = (torch.arange(longest) >= 4).long().expand_as(input_ids) * attention_mask
    if type(model).__name__.endswith("ForMultipleChoice"):
        inputs = {key: value[None] for key, value in inputs.items()}  # (B, T) -> (1, B, T): the rows are the choices
    return inputs


def allowed_difference(scale: float, dtype: str = "f32") -> float:
    """The largest difference a check in `dtype` accepts between outputs whose largest magnitude is `scale`."""
    return tolerance(dtype) * max(1.0, scale)


def _largest(values: torch.Tensor, mask: torch.Tensor | None) -> float:
    """max of `values` (>= 0); where the output is per token (its leading dims are `mask`'s shape), only over the
    positions `mask` marks as real."""
    if mask is not None and tuple(values.shape[: mask.dim()]) == tuple(mask.shape):
        values = values[mask.bool()]  # (B, T, ...) -> (real tokens, ...)
    return values.max().item() if values.numel() else 0.0


def max_abs_difference(reference: torch.Tensor, found: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """max |reference - found| in fp32, over the real tokens of a per-token output."""
    return _largest((reference.float() - found.float()).abs(), mask)


def magnitude(reference: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """max |reference| in fp32, over the real tokens of a per-token output: the scale of one output."""
    return _largest(reference.float().abs(), mask)


def output_differences(
    reference: Mapping[str, object], found: Mapping[str, object], mask: torch.Tensor | None = None
) -> dict[str, float]:
    """`max_abs_difference` of every floating-point output both mappings hold (e.g. two ModelOutputs), by name."""
    differences = {}
    for key, value in reference.items():
        other = found.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and value.is_floating_point()):
            continue
        differences[key] = max_abs_difference(value, other, mask)
    return differences


def output_scale(
    reference: Mapping[str, object], found: Mapping[str, object], mask: torch.Tensor | None = None
) -> float:
    """The largest `magnitude` among the reference's floating outputs that `found` holds too (those compared)."""
    compared = [reference[key] for key in output_differences(reference, found, mask)]
    return max((magnitude(value, mask) for value in compared), default=0.0)


class Comparison(NamedTuple):
    """Two models' outputs compared: each shared output's largest difference, and the scale of those outputs."""

    differences: dict[str, float]
    scale: float

    @property
    def passed(self) -> bool:
        return within_tolerance(self.differences, scale=self.scale)


@torch.no_grad()
def compare_models(reference: torch.nn.Module, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Comparison:
    """Run both models in fp32 on `inputs` and compare every shared output over the real tokens."""
    expected = reference.float()(**inputs)
    found = model.float()(**inputs)
    mask = inputs.get("attention_mask")
    return Comparison(output_differences(expected, found, mask), output_scale(expected, found, mask))


@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, inputs: dict[str, torch.Tensor], new_tokens: int) -> torch.Tensor:
    """The sequence greedy decoding gives (prompt included): what a generative head's check compares exactly."""
    return model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=new_tokens)


def within_tolerance(differences: Mapping[str, float] | float, dtype: str = "f32", scale: float = 0.0) -> bool:
    """Whether every difference is at most `allowed_difference(scale, dtype)` (an empty mapping compares nothing:
    False)."""
    if isinstance(differences, Mapping):
        return bool(differences) and max(differences.values()) <= allowed_difference(scale, dtype)
    return differences <= allowed_difference(scale, dtype)


class ExportCheckError(RuntimeError):
    """`check=True` found a difference above tolerance (or other tokens); nothing was written to OUT."""


def check_summary(
    max_abs_difference: float, tolerance: float, tokens_equal: bool | None, tokenizer_equal: bool | None = None
) -> dict[str, object]:
    """The `check` entry every exporter's summary holds (what `coreformer export --check` prints): the largest output
    difference and the tolerance it met, whether greedy tokens (None: not a generative head) and tokenizer ids (None:
    not compared) are equal."""
    return {
        "max_abs_difference": max_abs_difference,
        "tolerance": tolerance,
        "tokens_equal": tokens_equal,
        "tokenizer_equal": tokenizer_equal,
    }
