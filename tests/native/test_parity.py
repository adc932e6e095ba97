"""The one parity check (coreformer.native.parity): its comparison and its one tolerance per dtype, used by
`coreformer convert --check`, `export --check`, the ONNX check and the GGUF check alike."""

import pytest
import torch

import coreformer_cli
from coreformer.export import exporters, onnx
from coreformer.export.gguf import DTYPES
from coreformer.native.parity import (
    max_abs_difference,
    model_differences,
    output_differences,
    tolerance,
    within_tolerance,
)
from coreformer_settings.exports import CHECK_TOLERANCE, CHECK_TOLERANCES, GGUF_DTYPES


def test_every_check_reads_the_one_tolerance_of_its_dtype():
    assert exporters.CHECK_TOLERANCE is onnx.CHECK_TOLERANCE is CHECK_TOLERANCE == tolerance("f32")
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


def test_model_differences_run_both_models_in_fp32():
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
    differences = model_differences(Wrapped(reference), Wrapped(model), inputs)
    assert differences["logits"] == 0.0  # the same weights, both computed in fp32 (bf16 outputs would be rounded)
