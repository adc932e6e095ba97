"""vLLM serves coreformer folders as users serve them: its CPU build, the Transformers backend, the folder's own code
(remote code; coreformer is not importable in the serving process). Full and sliding decoders (one of each, and
mixed) give generate()'s greedy tokens; an encoder gives its own first-token state, normalised, as vLLM's pooling
embedding; every layer type vLLM's attention does not compute is refused while vLLM loads the folder, naming it.

The serving tier (`make test-serving`) builds the venv these run in: vLLM's CPU build with the transformers and torch
it pins, coreformer installed from this checkout. Each folder is served by `vllm_serve.py` in a process of its own
(vLLM's engine holds its process), a few seconds each. Elsewhere vLLM is not installed, and the tests skip saying so.
"""

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import coreformer as cf
from coreformer.layer_types import LAYER_TYPES
from coreformer.training.tokenizer_training import token_config_kwargs, train_tokenizer

pytestmark = [
    pytest.mark.serving,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is installed by the serving tier (make test-serving)"
    ),
]

SERVE = Path(__file__).with_name("vllm_serve.py")
PROMPTS = [[5, 9, 14, 23, 42], [7, 11, 13, 17, 19, 29, 31, 37, 41], [50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150]]
NEW_TOKENS = 8  # vllm_serve.NEW_TOKENS
WINDOW = 3  # shorter than every prompt: the window is exercised from the first step
# A tiny Llama-like model whose heads vLLM's CPU attention takes (head size 32: it runs 32, 64, 80 and up).
LLAMA = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=192,
    num_hidden_layers=2,
    max_position_embeddings=64,
    position_embedding_type="rotary",
    norm_type="rmsnorm",
    hidden_act="silu",
    gated_mlp=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LAYER_SETTINGS = dict(sliding_window=WINDOW, stride=2, block_size=4, lsh_bucket_size=4, lowrank_k=8, kv_lora_rank=8)


@functools.cache
def tokenizer(family: str):
    """A small byte-level tokenizer of the family, trained here: folders go to vLLM with their tokenizer."""
    return train_tokenizer(family, SERVE.read_text().splitlines() * 4, vocab_size=300)


def save(folder: Path, family: str, layer_types: list[str]) -> torch.nn.Module:
    """A tiny model of `family` (its causal LM, or the encoder's base model) with spread-out weights, so that greedy
    tokens vary, saved with its tokenizer as users save them."""
    torch.manual_seed(0)
    model_class, config_class = {
        "decoder": (cf.CoreformerDecoderForCausalLM, cf.CoreformerDecoderConfig),
        "encoder": (cf.CoreformerEncoderModel, cf.CoreformerEncoderConfig),
    }[family]
    fields = {**LLAMA, **LAYER_SETTINGS, **token_config_kwargs(tokenizer(family), family), "layer_types": layer_types}
    if "lsh" in layer_types:  # queries are their own keys: one key head per query head
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    config = config_class(**fields)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    tokenizer(family).save_pretrained(folder)
    return model


def served(folder: Path, task: str, tmp_path: Path) -> dict:
    """What vLLM gave for PROMPTS, from a process of its own (`vllm_serve.py`)."""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(SERVE), str(folder), task, json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"vllm_serve.py gave no result (exit {result.returncode}):\n{result.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize(
    "layer_types", [["full", "full"], ["sliding", "sliding"], ["sliding", "full"]], ids=["full", "sliding", "mixed"]
)
def test_vllm_serves_full_and_sliding_decoders_with_generates_greedy_tokens(tmp_path, layer_types):
    model = save(tmp_path / "model", "decoder", layer_types)
    expected = []
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        expected.append(out[0, len(prompt) :].tolist())
    assert len({token for tokens in expected for token in tokens}) > NEW_TOKENS  # not one token repeated
    result = served(tmp_path / "model", "generate", tmp_path)
    assert result.get("tokens") == expected, result


def test_vllm_embeds_with_the_encoders_own_first_token_state(tmp_path):
    model = save(tmp_path / "model", "encoder", ["sliding", "full"])
    result = served(tmp_path / "model", "embed", tmp_path)
    assert "embeddings" in result, result
    for prompt, embedding in zip(PROMPTS, result["embeddings"], strict=True):
        with torch.no_grad():
            first = model(torch.tensor([prompt])).last_hidden_state[0, 0]
        expected = torch.nn.functional.normalize(first, dim=-1)  # vLLM's pooling normalises
        assert (torch.tensor(embedding) - expected).abs().max() < 1e-5


# Every layer type without a transformers layer type that computes it exactly (`LayerType.served_as`), in the family
# that may hold it.
UNSERVED = [name for name, kind in LAYER_TYPES.items() if kind.served_as is None]


@pytest.mark.parametrize("refused", UNSERVED)
def test_vllm_refuses_every_other_layer_type_when_it_loads_the_folder(tmp_path, refused):
    family, task = ("decoder", "generate") if LAYER_TYPES[refused].not_causal is None else ("encoder", "embed")
    save(tmp_path / "model", family, ["full", refused])
    error = served(tmp_path / "model", task, tmp_path).get("error", "")
    assert "vLLM's Transformers backend runs only 'full' and 'sliding' layers exactly" in error, error
    assert f"'{refused}' (layer 1)" in error and "serve it with transformers" in error, error
