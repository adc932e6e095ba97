"""coreformer/compat.py: each entry answers what the running transformers release declares, the modeling files ask it
rather than a version, and the module itself loads without torch."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils.output_capturing import OutputRecorder

import coreformer as cf
from coreformer import compat

PACKAGE = Path(cf.__file__).parent


def test_the_cache_keyword_is_the_field_the_output_classes_declare():
    fields = {field.name for field in dataclasses.fields(BaseModelOutputWithPast)}
    assert compat.CACHE_KEYWORD in fields
    assert not (set(compat.CACHE_KEYWORDS) - {compat.CACHE_KEYWORD}) & fields  # the other name is not a field


def test_hidden_state_selection_is_declared_where_the_recorder_has_its_depth_key():
    fields = {field.name for field in dataclasses.fields(OutputRecorder)}
    assert compat.SELECTS_HIDDEN_STATES == ("num_hidden_layers_key" in fields)


@pytest.mark.parametrize(
    ("keep", "kept"), [(0, [0, 1, 2, 3, 4]), (1, [4]), (3, [2, 3, 4]), (torch.tensor([0, 2]), [0, 2])]
)
def test_slice_logits_to_keep_slices_as_transformers_does_where_it_has_one(keep, kept):
    hidden = torch.randn(2, 5, 4)
    ours = compat.slice_logits_to_keep(hidden, keep)
    assert torch.equal(ours, hidden[:, kept])
    theirs = getattr(transformers.modeling_utils, "slice_logits_to_keep", None)
    if theirs is not None:  # 5.21 and later
        assert torch.equal(ours, theirs(hidden, keep))


def test_the_cache_is_passed_once():
    assert compat.cache_from(None, None) is None
    marker = object()
    assert compat.cache_from(marker, None) is marker and compat.cache_from(None, marker) is marker
    with pytest.raises(ValueError, match="as `cache` or as `past_key_values`"):
        compat.cache_from(marker, object())


def test_a_tp_plan_assignment_that_restates_the_plan_is_taken_and_any_other_refused():
    config = cf.CoreformerDecoderConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
    plan = config.base_model_tp_plan
    config.base_model_tp_plan = {**plan, "embed_tokens": "embedding_rowwise"}  # what releases before 5.21 assign
    assert config.base_model_tp_plan == plan
    with pytest.raises(ValueError, match="derived from the config"):
        config.base_model_tp_plan = {**plan, "decoder.layers.*.mlp.up_proj": "rowwise"}


class _Pipeline:
    generation_config = "the pipeline's"


class _MergingPipeline(_Pipeline):
    def _prepare_generate_kwargs(self, generate_kwargs: dict) -> dict:
        return {**generate_kwargs, "merged": True}


def test_pipelines_get_their_generation_settings_the_way_the_release_merges_them():
    assert compat.pipeline_generate_kwargs(_MergingPipeline(), {"num_beams": 2}) == {"num_beams": 2, "merged": True}
    assert compat.pipeline_generate_kwargs(_Pipeline(), {"num_beams": 2}) == {
        "num_beams": 2,
        "generation_config": "the pipeline's",
    }
    assert compat.pipeline_generate_kwargs(_Pipeline(), {"generation_config": "mine"}) == {"generation_config": "mine"}


def test_no_modeling_file_asks_which_release_is_running():
    # The one place that knows releases is compat.py; every other file shipped beside checkpoints asks it.
    asks = re.compile(r"transformers\.__version__|importlib\.metadata|\bRELEASE\b|packaging\.version")
    offenders = [
        path.name for path in sorted(PACKAGE.glob("*.py")) if path.name != "compat.py" and asks.search(path.read_text())
    ]
    assert offenders == []


def test_the_module_loads_without_torch():
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('compat', {str(PACKAGE / 'compat.py')!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(module.CACHE_KEYWORD)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == compat.CACHE_KEYWORD
