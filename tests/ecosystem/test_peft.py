"""PEFT LoRA on the attention core's q_proj / v_proj, for one head of each family: train a few steps (only adapter
weights move), save the adapter, reload it onto a freshly loaded base, merge it into the weights, and save / reload the
merged model through the Auto classes. Every step must reproduce the adapter model's outputs."""

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from tiny import EOS, tiny_config
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

import coreformer as cf
from coreformer import families
from coreformer.attention import Attention
from coreformer.families import FAMILIES

CASES = {
    "encoder": (cf.CoreformerEncoderForSequenceClassification, AutoModelForSequenceClassification, TaskType.SEQ_CLS),
    "decoder": (cf.CoreformerDecoderForCausalLM, AutoModelForCausalLM, TaskType.CAUSAL_LM),
    "seq2seq": (cf.CoreformerSeq2SeqForConditionalGeneration, AutoModelForSeq2SeqLM, TaskType.SEQ_2_SEQ_LM),
}
MERGE_ATOL = 1e-5
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _batch(family: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (4, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    if family == "encoder":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1, 0])}
    labels = ids.masked_fill(mask == 0, -100)
    if family == "decoder":
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ids[:, -1] = EOS
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels[:, :6]}


def _outputs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**{key: value for key, value in batch.items() if key != "labels"}).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """family -> (base folder, adapter folder, trained PEFT model, batch, losses, base weights before training)."""
    out = {}
    for family, (head, _, task_type) in CASES.items():
        torch.manual_seed(0)
        base = head(tiny_config(family, num_labels=2) if family == "encoder" else tiny_config(family))
        base_folder = tmp_path_factory.mktemp(f"{family}-base")
        base.save_pretrained(base_folder)
        frozen = {name: tensor.clone() for name, tensor in base.state_dict().items()}
        config = LoraConfig(
            task_type=task_type, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]
        )
        model = get_peft_model(base, config)
        batch = _batch(family)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
        losses = []
        model.train()
        for _ in range(15):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        adapter_folder = tmp_path_factory.mktemp(f"{family}-adapter")
        model.save_pretrained(adapter_folder)
        out[family] = base_folder, adapter_folder, model.eval(), batch, losses, frozen
    return out


@pytest.mark.compat
@pytest.mark.parametrize("family", list(CASES))
def test_lora_targets_q_and_v_of_every_attention_and_trains_only_adapters(trained, family):
    _, _, model, _, losses, frozen = trained[family]
    # A tiny random LM starts near ln(99) = 4.6 and q/v adapters move it slowly; 0.1 nats in 15 steps is learning.
    assert losses[-1] < losses[0] - 0.1, losses
    lora_modules = {name.split(".lora_A.")[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    attentions = sum(isinstance(module, Attention) for module in model.modules())  # self- and cross-attention
    assert len(lora_modules) == 2 * attentions
    assert all(name.endswith(("q_proj", "v_proj")) for name in lora_modules)
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert all("lora_" in name or "modules_to_save" in name for name in trainable), sorted(trainable)
    # Every base weight is where it started (a sequence classifier trains a copy of its head: modules_to_save).
    for name, parameter in model.named_parameters():
        if "lora_" not in name and "modules_to_save" not in name:
            base_name = (
                name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".original_module", "")
            )
            assert torch.equal(parameter, frozen[base_name]), name


@pytest.mark.compat
@pytest.mark.parametrize("family", list(CASES))
def test_saved_adapter_reloads_onto_a_fresh_base_with_identical_outputs(trained, family):
    base_folder, adapter_folder, model, batch, _, _ = trained[family]
    _, auto_class, _ = CASES[family]
    expected = _outputs(model, batch)
    fresh = auto_class.from_pretrained(base_folder)
    assert not torch.allclose(_outputs(fresh, batch), expected)  # the adapter changed the outputs
    reloaded = PeftModel.from_pretrained(fresh, adapter_folder)
    torch.testing.assert_close(_outputs(reloaded, batch), expected, atol=0, rtol=0)


@pytest.mark.compat
@pytest.mark.parametrize("family", list(CASES))
def test_merged_model_matches_the_adapter_and_reloads_with_the_auto_class(trained, family, tmp_path):
    base_folder, adapter_folder, _, batch, _, _ = trained[family]
    _, auto_class, _ = CASES[family]
    adapter_model = PeftModel.from_pretrained(auto_class.from_pretrained(base_folder), adapter_folder).eval()
    expected = _outputs(adapter_model, batch)
    merged = adapter_model.merge_and_unload()
    assert type(merged) is CASES[family][0]
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(_outputs(merged, batch), expected, atol=MERGE_ATOL, rtol=0)
    merged.save_pretrained(tmp_path)
    reloaded = auto_class.from_pretrained(tmp_path)
    assert type(reloaded) is CASES[family][0]
    torch.testing.assert_close(_outputs(reloaded, batch), _outputs(merged, batch), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["decoder", "seq2seq"])
def test_adapter_model_generates_what_the_merged_model_generates(trained, family):
    base_folder, adapter_folder, _, batch, _, _ = trained[family]
    _, auto_class, _ = CASES[family]
    adapter_model = PeftModel.from_pretrained(auto_class.from_pretrained(base_folder), adapter_folder).eval()
    prompt = {"input_ids": batch["input_ids"][:2, :6], "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    with torch.no_grad():
        from_adapter = adapter_model.generate(**prompt, **options)
        from_merged = adapter_model.merge_and_unload().generate(**prompt, **options)
    assert torch.equal(from_adapter, from_merged)


# --- PEFT's defaults: LoraConfig() without target_modules (PEFT picks q_proj, v_proj for Llama; c_attn for GPT-2) ---

ATTENTION_QUERY_VALUE = ("q_proj", "v_proj")


def _attention_query_value_names(model) -> set[str]:
    """Every attention's q_proj and v_proj (self- and cross-attention), by full module name."""
    return {
        f"{name}.{projection}"
        for name, module in model.named_modules()
        if isinstance(module, Attention)
        for projection in ATTENTION_QUERY_VALUE
    }


HEAD_CLASSES = [(name, getattr(cf, head.class_name)) for name, family in FAMILIES.items() for head in family.heads]


@pytest.mark.parametrize(("family", "head"), HEAD_CLASSES, ids=[head.__name__ for _, head in HEAD_CLASSES])
def test_default_lora_config_targets_every_attention_query_and_value(family, head):
    base = head(tiny_config(family, num_labels=2))
    expected = _attention_query_value_names(base)
    model = get_peft_model(base, LoraConfig())  # no target_modules: PEFT's default for the model type
    assert set(model.peft_config["default"].target_modules) == set(ATTENTION_QUERY_VALUE)
    assert set(model.base_model.targeted_module_names) == expected
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)


REMOTE_PEFT_CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["coreformer"] = None  # a machine without coreformer: transformers, peft and the saved folders
    import peft, transformers
    from peft import LoraConfig, get_peft_model
    for auto_class, folder in zip(sys.argv[1::2], sys.argv[2::2]):
        model = getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        targets = get_peft_model(model, LoraConfig()).base_model.targeted_module_names
        print(auto_class, len(targets), sorted({name.rsplit(".", 1)[1] for name in targets}))
    """
)


def save_every_family(folder: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Each family's CASES head saved in `folder`: (the children's arguments, AUTO_CLASS FOLDER for each, and for each
    its Auto class's name with the number of modules LoRA's default config adapts)."""
    arguments, adapted = [], []
    for family, (head, auto_class, _) in CASES.items():
        torch.manual_seed(0)
        model = head(tiny_config(family, num_labels=2))
        model.save_pretrained(folder / family)
        arguments += [auto_class.__name__, str(folder / family)]
        adapted.append((auto_class.__name__, len(_attention_query_value_names(model))))
    return arguments, adapted


@pytest.mark.slow
def test_default_lora_config_works_with_trust_remote_code_when_peft_is_imported_first(tmp_path):
    arguments, adapted = save_every_family(tmp_path)
    expected = [f"{auto_class} {count} ['q_proj', 'v_proj']" for auto_class, count in adapted]
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_PEFT_CHILD, *arguments], capture_output=True, text=True, env=OFFLINE
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == expected


# Loads each folder with trust_remote_code where coreformer is not importable, then imports the installed coreformer,
# neither importing peft; then imports peft and prints the modules LoRA's default config targets in each model.
PEFT_AFTER_CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["coreformer"] = None
    import transformers
    pairs = list(zip(sys.argv[1::2], sys.argv[2::2]))
    models = [getattr(transformers, auto_class).from_pretrained(f, trust_remote_code=True) for auto_class, f in pairs]
    assert "peft" not in sys.modules, "a remote-code load imported peft"
    del sys.modules["coreformer"]
    import coreformer
    assert "peft" not in sys.modules, "import coreformer imported peft"
    models.append(transformers.AutoModelForCausalLM.from_pretrained(pairs[1][1]))  # the installed class
    from peft import LoraConfig, get_peft_model
    for model in models:
        targets = get_peft_model(model, LoraConfig()).base_model.targeted_module_names
        print(type(model).__module__.split(".")[0], len(targets), sorted({name.rsplit(".", 1)[1] for name in targets}))
    """
)


@pytest.mark.slow
def test_peft_imported_after_coreformer_or_a_remote_code_load_still_gives_the_default_targets(tmp_path):
    # `import coreformer` leaves peft unimported (PEFT's tables are filled when peft is imported)
    arguments, adapted = save_every_family(tmp_path)
    expected = [f"transformers_modules {count} ['q_proj', 'v_proj']" for _, count in adapted]
    expected.append(expected[1].replace("transformers_modules", "coreformer"))  # the decoder, loaded as installed
    result = subprocess.run(
        [sys.executable, "-c", PEFT_AFTER_CHILD, *arguments], capture_output=True, text=True, env=OFFLINE
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == expected


def test_the_tables_of_a_peft_imported_later_are_filled_as_it_is_imported(tmp_path, monkeypatch):
    # A stand-in for peft.utils.constants, not yet imported: registering installs the one-shot import hook, which
    # fills the module's tables as it is imported and then leaves sys.meta_path.
    (tmp_path / "stand_in_peft").mkdir()
    (tmp_path / "stand_in_peft" / "__init__.py").write_text("")
    tables = 'TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING = {"llama": ["q_proj", "v_proj"], "bert": ["query"]}\n'
    (tmp_path / "stand_in_peft" / "constants.py").write_text(tables)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(families, "PEFT_TABLES", "stand_in_peft.constants")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    families.register_with_peft()
    families.register_with_peft()  # twice: still one hook
    hooks = [finder for finder in sys.meta_path if isinstance(finder, families._FillPeftTablesOnImport)]
    assert len(hooks) == 1

    constants = importlib.import_module("stand_in_peft.constants")
    mapping = constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    assert {family.model_type: mapping[family.model_type] for family in FAMILIES.values()} == {
        family.model_type: ["q_proj", "v_proj"] for family in FAMILIES.values()
    }
    assert not any(isinstance(finder, families._FillPeftTablesOnImport) for finder in sys.meta_path)


def _add_adapter_refusal() -> str | None:
    """Why transformers' own PEFT integration cannot run beside the installed peft, or None when it can (5.24
    requires peft>=0.22)."""
    from importlib.metadata import version

    from packaging.version import Version
    from transformers.integrations.peft import MIN_PEFT_VERSION

    installed = version("peft")
    if Version(installed) >= Version(MIN_PEFT_VERSION):
        return None
    release = transformers.__version__
    return f"transformers {release}'s add_adapter requires peft>={MIN_PEFT_VERSION} (installed: {installed})"


@pytest.mark.parametrize("family", list(CASES))
def test_transformers_add_adapter_takes_the_same_default_targets(family):
    if (refusal := _add_adapter_refusal()) is not None:
        pytest.skip(refusal)
    # transformers' own PEFT integration (PeftAdapterMixin.add_adapter) asks PEFT for the defaults the same way.
    model = CASES[family][0](tiny_config(family, num_labels=2))
    model.add_adapter(LoraConfig())
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    assert adapted == _attention_query_value_names(model)
