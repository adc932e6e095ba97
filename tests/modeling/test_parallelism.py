"""Parallelism metadata the ecosystem reads, checked against built models: `_no_split_modules` (device_map="auto",
FSDP auto-wrap), and the configs' `base_model_tp_plan` / `base_model_pp_plan` (transformers' tp_plan="auto",
pipeline-parallel trainers), for every head of every family and every layer type; accelerate's device maps (blocks kept
whole, a disk-offloaded load computing the same logits); then a real 2-process tensor-parallel load on CPU (gloo)
against the single-process model, logits and a backward pass (loss, sharded gradients)."""

import os
import re
import textwrap
from pathlib import Path

import pytest
import torch
from accelerate import infer_auto_device_map
from accelerate.utils import compute_module_sizes
from conftest import free_port
from ranks import launch_ranks
from tiny import padded_batch, tiny_model
from torch import nn

import coreformer as cf
from coreformer.families import FAMILIES
from coreformer.layers import Block

HEADS = [(name, getattr(cf, head.class_name)) for name, family in FAMILIES.items() for head in family.heads]
HEAD_IDS = [head.__name__ for _, head in HEADS]
LAYER_OPTIONS = {
    "full": {},
    "gated_sliding_linear": dict(gated_mlp=True, layer_types=["sliding", "linear"], sliding_window=3),
    "untied_head": dict(tie_word_embeddings=False),
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


def _module_name(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is target)


def _expected_tp_styles(model: nn.Module) -> dict[str, str]:
    """What a tensor-parallel plan must shard, read off the built model rather than the plan: every block's
    projections (q/k/v, up, gate by columns; o, down by rows), every embedding module holding the token vocabulary
    (the seq2seq `shared` and both stacks' `embed_tokens` hold one tied weight) on the vocabulary, and the LM head
    by columns with its output gathered (the refsuite's `test_tied_head_has_a_tp_plan_entry`: tied, its weight IS
    the sharded embedding). Nothing else: position and token-type tables, the MLM transform, classifiers."""
    expected = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and ".layers." in name and leaf in COLUMNWISE | ROWWISE:
            expected[name] = "colwise" if leaf in COLUMNWISE else "rowwise"
    vocabulary = model.get_input_embeddings().weight
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.weight is vocabulary:
            expected[name] = "embedding_rowwise"
    if (head := model.get_output_embeddings()) is not None:
        expected[_module_name(model, head)] = "colwise_gather_output"
    return expected


@pytest.mark.parametrize("options", list(LAYER_OPTIONS.values()), ids=list(LAYER_OPTIONS))
@pytest.mark.parametrize(("family", "head"), HEADS, ids=HEAD_IDS)
def test_tp_plan_shards_projections_token_embeddings_and_lm_head_and_nothing_else(family, head, options):
    model = _build(family, head, options)
    plan = model.tp_plan  # the config's base_model_tp_plan, prefixed inside heads, plus the classes' `_tp_plan`
    assert plan, "no tensor-parallel plan"
    covered = {}
    for pattern, style in plan.items():
        names = _modules_matching(model, pattern)
        assert names, f"{pattern} names no module of {head.__name__}"
        covered |= dict.fromkeys(names, style)
    expected = _expected_tp_styles(model)
    assert covered == expected
    # the input embeddings (transformers' test_tp_plan_shards_input_embeddings) and nothing indexed by position
    assert covered[_module_name(model, model.get_input_embeddings())] == "embedding_rowwise"
    assert not any("embed_positions" in name or "token_type" in name for name in covered)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp_plan_leaves_position_and_token_type_tables_and_the_mlm_transform_whole(family):
    # the encoder's defaults: learned positions, token types, BERT's MLM transform and decoder bias
    options = dict(type_vocab_size=2, lm_head_transform=True, lm_head_bias=True, position_embedding_type="learned")
    model = tiny_model(LANGUAGE_MODELS[family], family, **options)
    covered = {name for pattern in model.tp_plan for name in _modules_matching(model, pattern)}
    whole = {name for name, module in model.named_modules() if isinstance(module, nn.Embedding)}
    whole -= {name for name, style in _expected_tp_styles(model).items() if style == "embedding_rowwise"}
    whole |= {name for name, _ in model.named_modules() if name.startswith("lm_head_transform")}
    assert any("embed_positions" in name for name in whole) and any("token_type" in name for name in whole)
    assert "lm_head_transform.dense" in whole and "lm_head" in covered
    assert not whole & covered


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
        # a head predicting tokens closes the pipeline with its vocabulary projection, as Llama's does
        assert (model.pp_plan.get("lm_head") == (["hidden_states"], ["logits"])) == (
            model.get_output_embeddings() is not None
        )


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


# Loads every case of a torch.save'd {"forward": [...], "backward": [...]} with tp_plan="auto" on each rank; rank 0
# prints one line per case: "forward CLASS LAYER_TYPES DIFFERENCE" or "backward CLASS DIFFERENCE".
TP_CHILD = textwrap.dedent(
    """
    import os, sys, torch
    import coreformer as cf
    cases = torch.load(sys.argv[1])
    report = os.environ["RANK"] == "0"
    for case in cases["forward"]:
        model = getattr(cf, case["class"]).from_pretrained(case["folder"], tp_plan="auto").eval()
        for name in case["sharded"]:
            weight = model.get_submodule(name).weight
            assert type(weight).__name__ == "DTensor", (case["class"], name, type(weight))
            assert weight.to_local().numel() < weight.numel(), (case["class"], name, "not split")
        for name in case["whole"]:
            assert type(model.get_submodule(name).weight).__name__ != "DTensor", (case["class"], name)
        if case["tied"]:
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, case["class"]
        with torch.no_grad():
            logits = model(input_ids=case["ids"], attention_mask=case["mask"]).logits
        error = (logits - case["logits"]).abs()  # (B, T, vocab) over real tokens, or (B, labels)
        difference = (error[case["mask"].bool()] if error.dim() == 3 else error).max().item()
        if report:
            print("forward", case["class"], case["layer_types"], f"{difference:.2e}")
    for case in cases["backward"]:
        model = getattr(cf, case["class"]).from_pretrained(case["folder"], tp_plan="auto").train()
        loss = model(input_ids=case["ids"], attention_mask=case["mask"], labels=case["ids"]).loss
        loss.backward()
        differences = [abs(loss.item() - case["loss"])]
        for name, expected in case["grads"].items():
            grad = model.get_parameter(name).grad
            assert type(grad).__name__ == "DTensor", (case["class"], name, type(grad))
            differences.append((grad.full_tensor() - expected).abs().max().item())
        if report:
            print("backward", case["class"], f"{max(differences):.2e}")
    """
)

TP_CASES = [
    # BERT's layout: learned positions, token types, MLM transform and decoder bias; sparse layer types
    ("encoder", cf.CoreformerEncoderForMaskedLM, dict(layer_types=["strided", "lowrank"], stride=3, lowrank_k=4)),
    ("encoder", cf.CoreformerEncoderForSequenceClassification, {}),  # sharded embeddings under a classifier
    ("decoder", cf.CoreformerDecoderForCausalLM, dict(layer_types=["sliding", "linear"], sliding_window=3)),
    ("decoder", cf.CoreformerDecoderForCausalLM, dict(tie_word_embeddings=False)),
    ("seq2seq", cf.CoreformerSeq2SeqForConditionalGeneration, dict(final_logits_bias=True)),
]


def forward_cases(tmp_path: Path) -> list[dict]:
    """Each TP_CASES model saved, with its logits and the modules tp_plan="auto" must split or keep whole."""
    cases = []
    for index, (family, head, options) in enumerate(TP_CASES):
        model = _build(family, head, dict(gated_mlp=True, hidden_act="silu", **options))
        folder = tmp_path / str(index)
        model.save_pretrained(folder)
        ids, mask = padded_batch()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        styles = _expected_tp_styles(model)
        probe = f"{model.base_model_prefix}.{FAMILIES[family].stacks[-1]}.layers.0.self_attn.q_proj"
        sharded = [probe, *(name for name, style in styles.items() if style.startswith("embedding"))]
        if (lm_head := model.get_output_embeddings()) is not None:
            sharded.append(_module_name(model, lm_head))
        whole = [
            name
            for name, module in model.named_modules()
            if (isinstance(module, nn.Embedding) and name not in styles) or name == "lm_head_transform.dense"
        ]
        tied = lm_head is not None and lm_head.weight is model.get_input_embeddings().weight
        layer_types = model.config.layer_types
        cases.append(dict(folder=str(folder), ids=ids, mask=mask, logits=logits, layer_types=layer_types))
        cases[-1] |= dict(sharded=sharded, whole=whole, tied=tied, **{"class": head.__name__})
    return cases


def backward_cases(tmp_path: Path) -> list[dict]:
    """Each family's language model saved, with its loss and the gradients of its embedding, a query and an MLP."""
    cases = []
    for family, head in LANGUAGE_MODELS.items():
        model = tiny_model(head, family, gated_mlp=True, hidden_act="silu").train()
        folder = tmp_path / family
        model.save_pretrained(folder)
        ids, mask = padded_batch()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        stack = FAMILIES[family].stacks[-1]
        names = [
            _module_name(model, model.get_input_embeddings()) + ".weight",
            f"{model.base_model_prefix}.{stack}.layers.0.self_attn.q_proj.weight",
            f"{model.base_model_prefix}.{stack}.layers.0.mlp.down_proj.weight",
        ]
        grads = {name: model.get_parameter(name).grad.clone() for name in names}
        cases.append(
            dict(folder=str(folder), ids=ids, mask=mask, loss=loss.item(), grads=grads, **{"class": head.__name__})
        )
    return cases


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory) -> dict[str, tuple[list[dict], list[str]]]:
    """Both kinds of cases run by 2 processes at once (a launch's imports cost more than the tiny models), forked
    with the environment torchrun gives its ranks (ranks.py): {"forward" | "backward": (the cases, rank 0's lines
    for them)}."""
    tmp_path = tmp_path_factory.mktemp("tensor-parallel")
    cases = {"forward": forward_cases(tmp_path / "forward"), "backward": backward_cases(tmp_path / "backward")}
    torch.save(cases, tmp_path / "cases.pt")
    script, log = tmp_path / "child.py", tmp_path / "ranks.log"
    script.write_text(TP_CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launcher = ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    ranks = launch_ranks(launcher, [str(script), str(tmp_path / "cases.pt")], env, tmp_path, log)
    assert ranks.wait(timeout=600) == 0, log.read_text()[-3000:]
    lines = log.read_text().splitlines()
    return {kind: (cases[kind], [line for line in lines if line.startswith(f"{kind} ")]) for kind in cases}


@pytest.mark.slow
def test_tensor_parallel_load_on_two_processes_matches_the_single_process_model(tensor_parallel):
    # the vocabulary (99) is odd: the embeddings' and LM heads' shards are uneven (50 + 49 rows)
    cases, lines = tensor_parallel["forward"]
    assert any(case["whole"] for case in cases) and any(case["tied"] for case in cases)
    print("\n".join(lines))  # class, layer types, largest difference (shown with -s)
    assert len(lines) == len(cases)
    assert all(float(line.rsplit(" ", 1)[1]) <= 1e-5 for line in lines), lines


@pytest.mark.slow
def test_tensor_parallel_backward_gives_the_single_process_loss_and_gradients(tensor_parallel):
    # the gradient of the vocabulary-sharded embedding sums the lookups' and, tied, the LM head's on every slice
    cases, lines = tensor_parallel["backward"]
    print("\n".join(lines))  # class, largest difference of loss and gradients (shown with -s)
    assert len(lines) == len(cases)
    assert all(float(line.rsplit(" ", 1)[1]) <= 1e-5 for line in lines), lines
