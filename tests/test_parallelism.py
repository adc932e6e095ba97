"""Parallelism metadata the ecosystem reads, checked against built models: `_no_split_modules` (device_map="auto",
FSDP auto-wrap), and the configs' `base_model_tp_plan` / `base_model_pp_plan` (transformers' tp_plan="auto",
pipeline-parallel trainers), for every head of every family and every layer type; accelerate's device maps (blocks kept
whole, a disk-offloaded load computing the same logits); then a real 2-process tensor-parallel load on CPU (gloo)
against the single-process model."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from accelerate import infer_auto_device_map
from accelerate.utils import compute_module_sizes
from conftest import padded_batch, tiny_model
from torch import nn

import coreformer as cf
from coreformer.families import FAMILIES
from coreformer.layers import Block

HEADS = [(name, getattr(cf, head.class_name)) for name, family in FAMILIES.items() for head in family.heads]
HEAD_IDS = [head.__name__ for _, head in HEADS]
LAYER_OPTIONS = {
    "full": {},
    "gated_sliding_linear": dict(gated_mlp=True, layer_types=["sliding", "linear"], sliding_window=3),
}
COLUMNWISE = {"q_proj", "k_proj", "v_proj", "up_proj", "gate_proj"}  # output features split across ranks
ROWWISE = {"o_proj", "down_proj"}  # input features split, partial results summed


def _build(family: str, head, options: dict):
    options = dict(options)
    if family == "seq2seq" and "layer_types" in options:
        options["decoder_layer_types"] = options["layer_types"]
    return tiny_model(head, family, num_labels=2, **options)


def _modules_matching(model: nn.Module, pattern: str) -> list[str]:
    regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
    return [name for name, _ in model.named_modules() if regex.fullmatch(name)]


@pytest.mark.parametrize(("family", "head"), HEADS, ids=HEAD_IDS)
def test_no_split_modules_name_the_block_class(family, head):
    model = tiny_model(head, family, num_labels=2)
    classes = {type(module).__name__ for module in model.modules()}
    assert set(model._no_split_modules) == {Block.__name__} and Block.__name__ in classes
    # every block is one unit for device_map="auto" and FSDP: nothing outside a Block holds a Block
    blocks = [name for name, module in model.named_modules() if isinstance(module, Block)]
    assert blocks and all(re.fullmatch(r"(model\.)?(encoder|decoder)\.layers\.\d+", name) for name in blocks)


@pytest.mark.parametrize("options", list(LAYER_OPTIONS.values()), ids=list(LAYER_OPTIONS))
@pytest.mark.parametrize(("family", "head"), HEADS, ids=HEAD_IDS)
def test_tp_plan_names_every_projection_of_every_block_and_nothing_else(family, head, options):
    model = _build(family, head, options)
    plan = model.tp_plan  # the config's base_model_tp_plan, prefixed with the base model's name inside heads
    assert plan, "no tensor-parallel plan"
    covered = {}
    for pattern, style in plan.items():
        names = _modules_matching(model, pattern)
        assert names, f"{pattern} names no module of {head.__name__}"
        leaf = pattern.rsplit(".", 1)[1]
        assert style == ("colwise" if leaf in COLUMNWISE else "rowwise") and leaf in COLUMNWISE | ROWWISE
        for name in names:
            assert isinstance(model.get_submodule(name), nn.Linear), name
            covered[name] = style
    projections = {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in COLUMNWISE | ROWWISE and ".layers." in name
    }
    assert set(covered) == projections


@pytest.mark.parametrize(("family", "head"), HEADS, ids=HEAD_IDS)
def test_pp_plan_names_each_stack_embedding_blocks_and_norm(family, head):
    for options in ({}, dict(norm_position="pre", final_norm=True)):
        model = tiny_model(head, family, num_labels=2, **options)
        plan = model.config.base_model_pp_plan
        stacks = FAMILIES[family].stacks
        assert {name.split(".")[0] for name in plan} == set(stacks)
        for name, (inputs, outputs) in plan.items():
            module = model.base_model.get_submodule(name)
            assert module is not None and inputs and outputs
            if name.endswith(".layers"):
                assert isinstance(module, nn.ModuleList) and all(isinstance(block, Block) for block in module)
        assert all((f"{stack}.norm" in plan) == bool(model.config.final_norm) for stack in stacks)


LANGUAGE_MODELS = {name: getattr(cf, family.language_model.class_name) for name, family in FAMILIES.items()}
BLOCK_OR_ABOVE = re.compile(r"(model\.)?(encoder|decoder)\.layers(\.\d+)?")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_device_map_never_cuts_through_a_block(family):
    depth = {"encoder_layers": 4, "decoder_layers": 4} if family == "seq2seq" else {"num_hidden_layers": 4}
    model = tiny_model(LANGUAGE_MODELS[family], family, **depth)
    total = compute_module_sizes(model)[""]
    maps = [
        infer_auto_device_map(
            model, max_memory={"cpu": int(total * share), "disk": 10 * total}, no_split_module_classes=no_split
        )
        for share in (0.6, 0.75, 0.9)
        for no_split in (model._no_split_modules, None)
    ]
    kept, free = maps[0::2], maps[1::2]
    for device_map in kept:
        assert all(BLOCK_OR_ABOVE.fullmatch(name) for name in device_map if ".layers" in name), device_map
    # without the declaration accelerate does cut blocks apart: the check above can fail
    assert any(not BLOCK_OR_ABOVE.fullmatch(name) for device_map in free for name in device_map if ".layers" in name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_device_map_auto_with_disk_offload_gives_the_same_logits(family, tmp_path):
    model = tiny_model(LANGUAGE_MODELS[family], family)
    model.save_pretrained(tmp_path)
    total = compute_module_sizes(model)[""]
    offloaded = type(model).from_pretrained(
        tmp_path,
        device_map="auto",
        max_memory={"cpu": int(total * 0.6), "disk": 10 * total},
        offload_folder=tmp_path / "offload",
    )
    assert set(offloaded.hf_device_map.values()) == {"cpu", "disk"}
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        found = offloaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(found, expected, rtol=0, atol=0)


TP_CHILD = textwrap.dedent(
    """
    import os, sys, torch
    import coreformer as cf
    cases = torch.load(sys.argv[1])
    for case in cases:
        model = getattr(cf, case["class"]).from_pretrained(case["folder"], tp_plan="auto").eval()
        sharded = model.base_model.get_submodule(case["probe"]).weight
        assert type(sharded).__name__ == "DTensor", type(sharded)
        with torch.no_grad():
            logits = model(input_ids=case["ids"], attention_mask=case["mask"]).logits
        difference = (logits - case["logits"])[case["mask"].bool()].abs().max().item()
        if os.environ["RANK"] == "0":
            print(case["class"], case["layer_types"], f"{difference:.2e}")
    """
)


@pytest.mark.slow
def test_tensor_parallel_load_on_two_processes_matches_the_single_process_model(tmp_path):
    cases = []
    for family, head, options in [
        ("encoder", cf.CoreformerEncoderForMaskedLM, dict(layer_types=["strided", "lowrank"], stride=3, lowrank_k=4)),
        ("decoder", cf.CoreformerDecoderForCausalLM, dict(layer_types=["sliding", "linear"], sliding_window=3)),
        ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, {}),
    ]:
        model = _build(family, head, dict(gated_mlp=True, hidden_act="silu", **options))
        folder = tmp_path / family
        model.save_pretrained(folder)
        ids, mask = padded_batch()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        probe = f"{FAMILIES[family].stacks[-1]}.layers.0.self_attn.q_proj"
        layer_types = model.config.layer_types
        cases.append(dict(folder=str(folder), ids=ids, mask=mask, logits=logits, probe=probe, layer_types=layer_types))
        cases[-1]["class"] = head.__name__
    torch.save(cases, tmp_path / "cases.pt")
    script = tmp_path / "child.py"
    script.write_text(TP_CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)]
    result = subprocess.run([*command, str(tmp_path / "cases.pt")], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == len(cases)
    assert all(float(line.rsplit(" ", 1)[1]) <= 1e-5 for line in lines), lines
