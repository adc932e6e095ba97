"""docs/extending.md's worked examples, run as the page writes them: each example's Python blocks are written to a
temporary module (the package's relative imports made absolute, as the module lives outside it), its one registry
line is made with monkeypatch for the length of the test, and the member is used through the registry alone.

    objective          suffix-lm: a choice of `coreformer pretrain`, its setting a flag that is checked
    task               headline-classification: a --task of `coreformer finetune`, its setting a flag that is checked
    layer type         relu: a model builds it, its kernel computes ReLU attention over the real keys
    native architecture   OPT: converted from a tiny OPTForCausalLM and exported back through the registry
"""

import importlib
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from test_readme import DOCS, code_blocks
from tiny import padded_batch, tiny_config, tiny_model

import coreformer as cf
from coreformer.forward_plan import LayerPlan
from coreformer.layer_types import LAYER_TYPES, LayerType
from coreformer_cli import COMMANDS
from coreformer_settings.components import Registered


def section_module(
    page: str, heading: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> types.ModuleType:
    """The Python blocks under `heading` of docs/`page`, in order, as one importable module `name`."""
    blocks = [b.text for b in code_blocks((DOCS / page).read_text(), ("python",)) if b.heading == heading]
    assert blocks, f"{page} has no Python block under '{heading}'"
    source = "\n".join(blocks).replace("from ..", "from coreformer.").replace("from .", "from coreformer.native.")
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, module)  # removed again after the test
    return module


def help_section(command: str, title: str) -> str:
    help_text = COMMANDS[command].build_parser().format_help()
    assert title in help_text, help_text
    return help_text.split(title)[1]


def test_the_objective_example_is_a_choice_with_a_checked_flag(tmp_path, monkeypatch):
    from coreformer.training.objectives import OBJECTIVES
    from coreformer_settings.base import PretrainingError
    from coreformer_settings.objectives import OBJECTIVE_REGISTRY

    toy = section_module("extending.md", "Add a pretraining objective", "docs_suffix_lm", tmp_path, monkeypatch)
    monkeypatch.setitem(OBJECTIVE_REGISTRY, "suffix-lm", Registered("docs_suffix_lm:SUFFIX_LM", toy.SuffixSettings))
    assert OBJECTIVES["suffix-lm"] is toy.SUFFIX_LM
    assert "--labeled-share" in help_section("pretrain", "settings of the suffix-lm objective:")
    with pytest.raises(PretrainingError, match=r"`labeled_share` must be in \(0, 1\], got 0"):
        toy.SuffixSettings(labeled_share=0.0)
    args = SimpleNamespace(objective_settings=toy.SuffixSettings(labeled_share=0.25))
    collate = toy.SUFFIX_LM.collator(SimpleNamespace(eos_token_id=2), args)
    labels = collate([{"input_ids": list(range(3, 35))}])["labels"]  # one block of 32 tokens
    assert (labels != -100).sum() == 8 and (labels[0, -8:] != -100).all()


def test_the_task_example_is_a_task_with_a_checked_flag(tmp_path, monkeypatch):
    from coreformer.training.tasks import TASKS
    from coreformer_settings.base import FinetuningError
    from coreformer_settings.tasks import TASK_REGISTRY

    toy = section_module("extending.md", "Add a fine-tuning task", "docs_headline", tmp_path, monkeypatch)
    entry = Registered("docs_headline:HEADLINE_CLASSIFICATION", toy.HeadlineSettings)
    monkeypatch.setitem(TASK_REGISTRY, "headline-classification", entry)
    assert TASKS["headline-classification"] is toy.HEADLINE_CLASSIFICATION
    assert toy.HEADLINE_CLASSIFICATION.auto_class == "AutoModelForSequenceClassification"
    assert "--max-words" in help_section("finetune", "settings of the headline-classification task:")
    with pytest.raises(FinetuningError, match="`max_words` must be >= 1, got 0"):
        toy.HeadlineSettings(max_words=0)


def test_the_layer_type_example_runs_in_a_model(tmp_path, monkeypatch):
    toy = section_module("extending.md", "Add a layer type", "docs_relu_attention", tmp_path, monkeypatch)
    entry = LayerType(
        "full_attention",
        "full_attention",
        padding_mask_only=True,
        kernel=lambda config: toy.ReluKernel(),
        not_causal="the kernel applies the padding mask only, never causality",
        packed_rows=False,
    )
    monkeypatch.setitem(LAYER_TYPES, "relu", entry)
    # the kernel against the formula, on a padded batch: relu(q·k / sqrt(d)) / n over the n real keys
    query, key, value = torch.randn(3, 2, 4, 5, 8).unbind(0)  # each (B, H, T, D)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()  # (B, S)
    attention = SimpleNamespace(scaling=8**-0.5)
    output = toy.ReluKernel().attend(attention, query, key, value, mask, None, LayerPlan(mask=mask))
    for row, real in enumerate(mask.sum(1).tolist()):
        scores = query[row] @ key[row, :, :real].transpose(-1, -2) * 8**-0.5  # (H, T, n)
        weights = torch.relu(scores) / real
        torch.testing.assert_close(output[row].transpose(0, 1), weights @ value[row, :, :real])
    # in a model: built from the config, its weights returned as attentions, padded keys weighing nothing
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", layer_types=["relu", "full"])
    ids, mask = padded_batch(length=8)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
    first = out.attentions[0]  # (B, H, T, S)
    assert (first[mask[:, None, None, :].expand_as(first) == 0] == 0).all()
    assert not torch.allclose(first[0].sum(-1), torch.ones(()))  # not a softmax: rows need not sum to 1
    with pytest.raises(ValueError, match="never causality"):
        tiny_config("decoder", layer_types=["relu", "full"])


def test_the_native_architecture_example_converts_and_exports(tmp_path, monkeypatch):
    from coreformer.export import choose_target, to_native
    from coreformer.native import NATIVE_ARCHITECTURES
    from coreformer.native.conversion import convert_from_hf
    from coreformer.native.parity import compare_models, tolerance

    toy = section_module("extending.md", "Add a native architecture", "docs_opt", tmp_path, monkeypatch)
    monkeypatch.setitem(NATIVE_ARCHITECTURES, "opt", toy.OPT)
    config = transformers.OPTConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, init_std=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    source = transformers.OPTForCausalLM(config).eval()
    converted = convert_from_hf(source)
    assert isinstance(converted, cf.CoreformerDecoderForCausalLM)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0)).masked_fill(mask == 0, 0)
    inputs = {"input_ids": ids, "attention_mask": mask}
    assert max(compare_models(source, converted, inputs).differences.values()) <= tolerance("f32")
    assert choose_target(converted.config, type(converted).__name__) == (toy.OPT, "OPTForCausalLM")
    native = to_native(converted)
    assert type(native) is transformers.OPTForCausalLM
    assert max(compare_models(source, native, inputs).differences.values()) <= tolerance("f32")
