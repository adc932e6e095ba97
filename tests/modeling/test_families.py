"""The family registry (families.py): every fact other modules read from it matches the classes and what is saved."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from tiny import tiny_model
from transformers import PreTrainedModel

import coreformer as cf
from coreformer import configuration_coreformer
from coreformer.families import FAMILIES, MODEL_TYPES, family_of_model_type, head_of_class
from coreformer.training import tokenizer_training

FAMILIES_FILE = Path(cf.__file__).with_name("families.py")


def test_registry_module_imports_neither_torch_nor_the_modeling_files():
    # It is copied next to checkpoints (configuration_coreformer.py imports it): it must load on its own, cheaply.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('families', {str(FAMILIES_FILE)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'coreformer'))\n"
        "print(len(module.FAMILIES), heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["3", "[]"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_head_is_registered_with_its_auto_class(name):
    family = FAMILIES[name]
    config_class = getattr(configuration_coreformer, family.config_class)
    assert config_class.model_type == family.model_type
    assert transformers.AutoConfig.for_model(family.model_type).__class__ is config_class
    module = sys.modules[f"coreformer.{family.module}"]
    assert family.base_model.auto_class == "AutoModel"
    for head in family.heads:
        model_class = getattr(module, head.class_name)
        assert getattr(transformers, head.auto_class)._model_mapping[config_class] is model_class
        assert model_class._auto_class == head.auto_class
        assert model_class.config_class is config_class
    assert family.language_model.auto_class == family.language_model_auto_class


def test_every_public_model_class_is_in_the_registry():
    public = {
        name
        for name in cf.__all__
        if isinstance(getattr(cf, name), type) and issubclass(getattr(cf, name), PreTrainedModel)
    }
    registered = {head.class_name for family in FAMILIES.values() for head in family.heads}
    assert public == registered


@pytest.mark.parametrize("name", list(FAMILIES))
def test_saved_folder_carries_the_registry_and_its_auto_map(name, tmp_path):
    family = FAMILIES[name]
    tiny_model(getattr(cf, family.language_model.class_name), name).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == family.auto_map
    assert (tmp_path / "families.py").read_text() == FAMILIES_FILE.read_text()
    for reference in family.auto_map.values():
        assert (tmp_path / f"{reference.split('.')[0]}.py").is_file()


def test_lookups_name_what_exists_when_they_fail():
    assert family_of_model_type("coreformer_decoder") is FAMILIES["decoder"] is MODEL_TYPES["coreformer_decoder"]
    assert head_of_class("CoreformerSeq2SeqForConditionalGeneration") == (
        FAMILIES["seq2seq"],
        FAMILIES["seq2seq"].head("AutoModelForSeq2SeqLM"),
    )
    with pytest.raises(ValueError, match="not a coreformer family.*coreformer_encoder.*coreformer convert"):
        family_of_model_type("bert")
    with pytest.raises(ValueError, match="no AutoModelForCausalLM head; it has AutoModel, AutoModelForMaskedLM"):
        FAMILIES["encoder"].head("AutoModelForCausalLM")
    with pytest.raises(ValueError, match="BertModel is not a registered coreformer model class"):
        head_of_class("BertModel")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tokenizers_trained_for_a_family_have_its_special_tokens_in_order(name):
    texts = ["def close(self):", "    return self.stream.read()", "import os"] * 20
    tokenizer = tokenizer_training.train_tokenizer(name, texts, vocab_size=300)
    special = FAMILIES[name].special_tokens  # (role, token) in id order
    found = {role: (getattr(tokenizer, role), getattr(tokenizer, f"{role}_id")) for role, _ in special}
    assert found == {role: (token, i) for i, (role, token) in enumerate(special)}
    assert tuple(tokenizer.model_input_names) == FAMILIES[name].model_input_names
