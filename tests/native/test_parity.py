"""The one parity check (coreformer.native.parity): its comparison and its one tolerance per dtype, used by
`coreformer convert --check`, `export --check`, the ONNX check and the GGUF check alike."""

import pytest
import torch

import coreformer_cli
from coreformer.commands import convert
from coreformer.export import exporters, gguf, onnx
from coreformer.export.gguf import DTYPES
from coreformer.native.parity import (
    allowed_difference,
    compare_models,
    magnitude,
    max_abs_difference,
    output_differences,
    output_scale,
    tolerance,
    within_tolerance,
)
from coreformer_settings.exports import CHECK_TOLERANCE, CHECK_TOLERANCES, GGUF_DTYPES


def test_every_check_reads_the_one_tolerance_of_its_dtype():
    assert CHECK_TOLERANCE == tolerance("f32") == allowed_difference(0.0)
    for module in (exporters, onnx, convert, gguf):  # each check asks the one rule, none keeps a number of its own
        assert "allowed_difference" in vars(module), module.__name__
        assert not any(name.endswith("TOLERANCE") for name in vars(module)), module.__name__
    assert str(CHECK_TOLERANCE) in coreformer_cli.COMMANDS["export"].build_parser().format_help()
    assert {name: dtype.tolerance for name, dtype in DTYPES.items()} == {name: tolerance(name) for name in GGUF_DTYPES}
    assert tolerance("f32") < tolerance("f16") <= tolerance("bf16")


def test_an_unknown_dtype_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="known: " + ", ".join(CHECK_TOLERANCES)):
        tolerance("f8")


def test_per_token_outputs_are_compared_over_real_tokens_only():
    reference = torch.zeros(2, 3, 5)  # (B, T, vocab)
    found = reference.clone()
    found[1, 2] = 7.0  # a padding position
    found[0, 1, 4] = 0.5  # a real one
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert max_abs_difference(reference, found, mask) == 0.5
    assert max_abs_difference(reference, found) == 7.0  # no mask: every position
    pooled = torch.zeros(2, 4)  # (B, labels): not per token, compared whole
    assert max_abs_difference(pooled, pooled + 1, mask) == 1.0


def test_output_differences_compare_the_floating_outputs_both_sides_have():
    reference = {"logits": torch.ones(1, 2), "ids": torch.ones(1, 2, dtype=torch.long), "extra": torch.ones(1)}
    found = {"logits": torch.ones(1, 2) * 1.25, "ids": torch.zeros(1, 2, dtype=torch.long)}
    assert output_differences(reference, found) == {"logits": 0.25}


def test_within_tolerance_needs_something_compared():
    assert within_tolerance({"logits": tolerance("f32")}) and not within_tolerance({"logits": 2 * tolerance("f32")})
    assert not within_tolerance({})  # no shared output: nothing was checked
    assert within_tolerance(1e-3, "f16") and not within_tolerance(1e-3)


def test_the_tolerance_grows_with_the_outputs_scale_above_one():
    # A trained model's logits reach 12.5; fp32 reordering alone (onnxruntime against PyTorch) moved them 1.24e-05.
    assert within_tolerance({"logits": 1.24e-5}, scale=12.5) and allowed_difference(12.5) == pytest.approx(1.25e-4)
    assert not within_tolerance({"logits": 1.24e-5}, scale=0.5)  # outputs near 0 are held to the tolerance itself
    assert allowed_difference(0.5) == allowed_difference(1.0) == tolerance("f32")
    # A wrong output is off by a share of the scale, far above any rounding at that scale.
    assert not within_tolerance({"logits": 12.5 * 1e-3}, scale=12.5)
    assert allowed_difference(40.0, "f16") == pytest.approx(40 * tolerance("f16"))


def test_the_scale_is_the_largest_real_output_both_sides_have():
    reference = {"logits": torch.tensor([[[1.0, -12.5], [30.0, 0.0]]]), "extra": torch.full((1,), 99.0)}
    found = {"logits": reference["logits"] + 1e-4}
    mask = torch.tensor([[1, 0]])  # the second position is padding: its 30.0 does not count
    assert output_scale(reference, found, mask) == 12.5 and magnitude(reference["logits"]) == 30.0


def test_compared_models_run_in_fp32():
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 3).to(torch.bfloat16).float()  # weights a bf16 model holds exactly
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())

    class Wrapped(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, input_ids, attention_mask):
            return {"logits": self.linear(input_ids)}

    inputs = {"input_ids": torch.randn(2, 5, 4), "attention_mask": torch.ones(2, 5)}
    comparison = compare_models(Wrapped(reference), Wrapped(model), inputs)
    # the same weights, both computed in fp32 (bf16 outputs would be rounded)
    assert comparison.differences["logits"] == 0.0 and comparison.passed
