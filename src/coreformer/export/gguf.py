"""GGUF export of a native transformers decoder folder (Llama, GPT-2 or GPT-NeoX), for llama.cpp and everything
built on it.

    export_gguf(native_folder, out, dtype="f32", check=False) -> report     one .gguf file at `out`

The input is a folder `coreformer export --to native` writes (or any transformers folder of these classes):
config.json + safetensors + a byte-level BPE tokenizer. The file is written with the `gguf` package's GGUFWriter as
llama.cpp's own converter (convert_hf_to_gguf.py) lays it out, because that is what llama.cpp and transformers'
GGUF loader (modeling_gguf_pytorch_utils.py, integrations/ggml.py) read back:

    native class        gguf arch   tensors (gguf.TensorNameMap names)            changed on the way
    LlamaForCausalLM    llama       token_embd, blk.N.attn_{norm,q,k,v,output},     q, k rows permuted (rotary halves
                                    blk.N.ffn_{norm,gate,up,down}, output_norm,    -> interleaved pairs, llama.cpp's
                                    output (absent when tied)                      `permute`; the loader reverses it)
    GPT2LMHeadModel     gpt2        token_embd, position_embd, blk.N.attn_{norm,   Conv1D weights transposed to
                                    qkv,output}, blk.N.ffn_{norm,up,down},          (out, in); output = the tied
                                    output_norm, output                            embedding, as llama.cpp writes it
    GPTNeoXForCausalLM  gptneox     token_embd, blk.N.attn_{norm,qkv,output},       qkv rows per head -> q, k, v
                                    blk.N.ffn_{norm,up,down}, output_norm, output  blocks; output = the embedding
                                                                                   when tied; absent attention
                                                                                   biases written as zeros

Metadata: architecture, context / embedding / feed-forward lengths, block count, head counts, rope dimension and
base (llama, gptneox: rope.dimension_count is the partial rotary width), parallel residual (gptneox), norm epsilon,
file type; the tokenizer as llama.cpp's "gpt2" (byte-level BPE) model: every token by id (ids the tokenizer lacks up
to the model's vocabulary size become "[PAD<id>]", type UNUSED), token types (special tokens CONTROL), merges, bos /
eos / unk / pad ids, add_bos_token = False.

dtypes (`DTYPES`): f32, f16, bf16, q8_0 (gguf.quants; 2D weights whose rows are not a whole number of 32-value
blocks stay f16, as llama.cpp's converter does). Norm weights and biases (1D) are always f32.

`check=True` reads the file back and compares logits (tolerance per dtype, `DTYPES`, times the logits' scale above 1)
and greedy tokens with the native model, and the token ids both tokenizers give for a few texts. llama and gpt2 files
are read back by transformers (`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`, `AutoTokenizer` likewise),
a reader written independently of this one; transformers 5.23's loader does not read every field back
(gpt2.context_length lands in an `n_ctx` GPT2Config ignores): such fields are passed to it explicitly and named in the
report (`passed_to_transformers_loader`); llama.cpp reads them from the file. transformers has no gptneox GGUF loader,
so gptneox files are read back by `gptneox_read_back` here: the model rebuilt from the file's metadata and tensors alone
as llama.cpp reads them (its key names, q/k/v blocks, the tanh GELU it computes), the tokenizer from its token list and
merges. The report says which reader ran (`read_back_with`).
"""

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..native.parity import (
    ExportCheckError,
    allowed_difference,
    check_summary,
    magnitude,
    max_abs_difference,
    tolerance,
)

GREEDY_STEPS = 8
TOKENIZER_SAMPLES = ("Hello world, this is a test.", "  two spaces\tand a tab\nnew line", "ünïcödé ✓ 123 4567")


@dataclass(frozen=True)
class Dtype:
    """One GGUF weight type: the tensor type of 2D weights, the file type it declares, the logit tolerance of the
    check against the fp32 native model, and whether greedy tokens must match exactly."""

    tensor_type: str  # gguf.GGMLQuantizationType member
    file_type: str  # gguf.LlamaFileType member
    parity_dtype: str  # its key in coreformer_settings.exports.CHECK_TOLERANCES
    exact_greedy: bool

    @property
    def tolerance(self) -> float:
        return tolerance(self.parity_dtype)

    def allowed(self, scale: float) -> float:
        """The largest logit difference the check accepts where the logits reach `scale`."""
        return allowed_difference(scale, self.parity_dtype)


# Keyed by coreformer_settings.exports.GGUF_DTYPES; each tolerance is the parity check's for that dtype.
DTYPES = {
    "f32": Dtype("F32", "ALL_F32", "f32", True),
    "f16": Dtype("F16", "MOSTLY_F16", "f16", False),
    "bf16": Dtype("BF16", "MOSTLY_BF16", "bf16", False),
    "q8_0": Dtype("Q8_0", "MOSTLY_Q8_0", "q8_0", False),
}


@dataclass(frozen=True)
class Architecture:
    """How one native class becomes a GGUF file."""

    gguf_arch: str  # llama.cpp's architecture name (gguf.MODEL_ARCH_NAMES)
    refusals: Callable[[dict], list[str]]  # config.json -> what this exporter cannot carry, each naming the field
    metadata: Callable[[object, dict], None]  # (GGUFWriter, config.json) -> writes the architecture's keys
    tensor: Callable[[str, torch.Tensor, dict], torch.Tensor]  # (native name, tensor, config) -> as llama.cpp has it
    write_output: Callable[[dict], bool]  # whether `output.weight` is written
    # config fields transformers' GGUF loader does not read back from the file (passed to it by the check, reported)
    unread_by_transformers: Callable[[dict], dict] = lambda config: {}
    # (native weights, config) -> the weights with those llama.cpp requires and the folder lacks (zeros: add nothing)
    completed: Callable[[dict, dict], dict] = lambda weights, config: weights
    # (file, config) -> (model, tokenizer) rebuilt from the file by this module's reader, for the check of an arch
    # transformers' GGUF loader does not read; None: the check loads the file with transformers
    read_back: Callable[[Path, dict], tuple] | None = None


# --- Llama ---


def llama_refusals(config: dict) -> list[str]:
    reasons = []
    if config.get("attention_bias"):
        reasons.append("attention_bias=True (transformers' GGUF loader builds Llama without q/k/v/o biases)")
    if config.get("mlp_bias"):
        reasons.append("mlp_bias=True (llama.cpp's and transformers' GGUF Llama have no MLP biases)")
    if config.get("hidden_act", "silu") != "silu":
        reasons.append(f"hidden_act={config['hidden_act']!r} (GGUF llama's gated MLP is SiLU)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        reasons.append(f"rope type {rope['rope_type']!r} (only plain rotary is written; no rope scaling metadata)")
    return reasons


def rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def llama_metadata(writer, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_rope_dimension_count(head_dim(config))
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if head_dim(config) != config["hidden_size"] // config["num_attention_heads"]:
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))


def rotary_pairs(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's `permute`: within each head, rows (first half, second half) -> interleaved pairs.

        (heads * 2 * half, in) -> (heads, 2, half, in) -> (heads, half, 2, in) -> (heads * half * 2, in)

    transformers' Llama rotates dimension i with i + half; llama.cpp's rope rotates 2i with 2i + 1.
    """
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama_tensor(name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
    if name.endswith("self_attn.q_proj.weight"):
        return rotary_pairs(tensor, config["num_attention_heads"])
    if name.endswith("self_attn.k_proj.weight"):
        return rotary_pairs(tensor, config.get("num_key_value_heads") or config["num_attention_heads"])
    return tensor


# --- GPT-2 ---


def gpt2_refusals(config: dict) -> list[str]:
    reasons = []
    inner = config.get("n_inner")
    if inner is not None and inner != 4 * config["n_embd"]:
        reasons.append(
            f"n_inner={inner} (transformers' GGUF loader reads gpt2.feed_forward_length into no GPT2Config field, so "
            f"the model it builds has 4 * n_embd = {4 * config['n_embd']})"
        )
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        reasons.append(f"activation_function={config['activation_function']!r} (llama.cpp's gpt2 uses tanh GELU)")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(flag):
            reasons.append(f"{flag}=True (not expressible in GGUF gpt2 metadata)")
    if config.get("scale_attn_weights") is False:
        reasons.append("scale_attn_weights=False (GGUF gpt2 always scales by 1/sqrt(head_dim))")
    return reasons


def gpt2_metadata(writer, config: dict) -> None:
    writer.add_context_length(config["n_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_block_count(config["n_layer"])
    writer.add_feed_forward_length(config.get("n_inner") or 4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_vocab_size(config["vocab_size"])


def gpt2_unread_by_transformers(config: dict) -> dict:
    """transformers 5.23 maps gpt2.context_length to `n_ctx`, which GPT2Config does not have: the model it builds
    keeps the default n_positions=1024, so a file of another context length only loads with it passed in."""
    return {"n_positions": config["n_positions"]} if config["n_positions"] != 1024 else {}


GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt2_tensor(name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
    # GPT-2's Conv1D stores (in, out); GGUF, like nn.Linear, (out, in).
    return tensor.T if name.endswith(GPT2_CONV1D) else tensor


# --- GPT-NeoX ---

# llama.cpp's gptneox graph computes GELU as ggml_gelu, the tanh approximation: these names compute the same.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def gptneox_refusals(config: dict) -> list[str]:
    reasons = []
    if config.get("hidden_act", "gelu") not in TANH_GELUS:
        reasons.append(
            f"hidden_act={config.get('hidden_act', 'gelu')!r} (llama.cpp's gptneox computes the tanh GELU, gelu_new)"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        reasons.append(f"rope type {rope['rope_type']!r} (only plain rotary is written; no rope scaling metadata)")
    return reasons


def rotary_dimensions(config: dict) -> int:
    """How many dimensions of each head rotate (GPT-NeoX's partial rotary; llama.cpp's rope.dimension_count)."""
    rope = config.get("rope_parameters") or {}
    return int(rope.get("partial_rotary_factor", config.get("rotary_pct", 1.0)) * head_dim(config))


def gptneox_metadata(writer, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_rope_dimension_count(rotary_dimensions(config))
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_parallel_residual(bool(config.get("use_parallel_residual", True)))
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def qkv_blocks(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """query_key_value rows from transformers' per-head layout to llama.cpp's q, k, v blocks:

        (heads * 3 * head_dim, ...) -> (heads, 3, head_dim, ...) -> (3, heads, head_dim, ...) -> (3 * hidden, ...)

    GPTNeoXAttention views its fused output per head; llama.cpp's gptneox graph reads q, k and v as three views of
    `hidden` rows each (convert_hf_to_gguf.py reorders them the same way)."""
    return tensor.reshape(heads, 3, -1, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


def per_head_qkv(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `qkv_blocks`: (3, heads, head_dim, ...) -> (heads, 3, head_dim, ...), flattened back."""
    return tensor.reshape(3, heads, -1, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


def gptneox_tensor(name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
    if name.endswith(("attention.query_key_value.weight", "attention.query_key_value.bias")):
        return qkv_blocks(tensor, config["num_attention_heads"])
    return tensor


def gptneox_completed(weights: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """llama.cpp's gptneox requires the attention biases (bqkv, bo); a model without them gets zeros, which add
    nothing."""
    hidden = config["hidden_size"]
    completed = dict(weights)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"gpt_neox.layers.{layer}.attention"
        completed.setdefault(f"{prefix}.query_key_value.bias", torch.zeros(3 * hidden))
        completed.setdefault(f"{prefix}.dense.bias", torch.zeros(hidden))
    return completed


# llama.cpp's gptneox tensor names (per block: blk.N.<name>) -> transformers' GPTNeoXForCausalLM names.
GPTNEOX_NAMES = {
    "token_embd": "gpt_neox.embed_in",
    "output_norm": "gpt_neox.final_layer_norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_qkv": "attention.query_key_value",
    "attn_output": "attention.dense",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}


def gptneox_read_back(path: Path, config: dict) -> tuple:
    """A GPTNeoXForCausalLM and a tokenizer built from the file alone, reading it as llama.cpp does (its metadata
    keys, q/k/v blocks, the tanh GELU of ggml_gelu): transformers 5.23's GGUF loader has no gptneox."""
    import gguf
    from gguf.quants import dequantize
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def field(key: str):
        return reader.fields[f"{arch}.{key}"].contents()

    heads, hidden = field("attention.head_count"), field("embedding_length")
    native = GPTNeoXConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].contents()),
        hidden_size=hidden,
        num_hidden_layers=field("block_count"),
        num_attention_heads=heads,
        intermediate_size=field("feed_forward_length"),
        max_position_embeddings=field("context_length"),
        layer_norm_eps=field("attention.layer_norm_epsilon"),
        use_parallel_residual=bool(field("use_parallel_residual")),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": field("rope.freq_base"),
            "partial_rotary_factor": field("rope.dimension_count") / (hidden // heads),
        },
        hidden_act="gelu_pytorch_tanh",  # what ggml_gelu computes
        attention_bias=True,
        tie_word_embeddings=False,
    )
    state = {}
    for tensor in reader.tensors:
        stem, suffix = tensor.name.rsplit(".", 1)
        if stem.startswith("blk."):
            _, block, part = stem.split(".", 2)  # blk.N.attn_qkv
            name = f"gpt_neox.layers.{block}.{GPTNEOX_NAMES[part]}"
        else:
            part, name = stem, GPTNEOX_NAMES[stem]
        value = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        state[f"{name}.{suffix}"] = per_head_qkv(value, heads) if part == "attn_qkv" else value
    model = GPTNeoXForCausalLM(native)
    model.load_state_dict(state, strict=True)
    return model.eval(), tokenizer_from_file(reader)


def tokenizer_from_file(reader) -> object:
    """The byte-level BPE tokenizer the file's tokenizer.ggml.* fields describe (llama.cpp's "gpt2" model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(merge.split(" ", 1)) for merge in reader.fields["tokenizer.ggml.merges"].contents()]
    tokenizer = Tokenizer(models.BPE({token: index for index, token in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        "llama", llama_refusals, llama_metadata, llama_tensor, lambda config: not config.get("tie_word_embeddings")
    ),
    "GPT2LMHeadModel": Architecture(
        "gpt2", gpt2_refusals, gpt2_metadata, gpt2_tensor, lambda config: True, gpt2_unread_by_transformers
    ),
    # llama.cpp requires `output` (written from the embedding when tied) and the attention biases
    "GPTNeoXForCausalLM": Architecture(
        "gptneox",
        gptneox_refusals,
        gptneox_metadata,
        gptneox_tensor,
        lambda config: True,
        completed=gptneox_completed,
        read_back=gptneox_read_back,
    ),
}


# --- reading the folder ---


def read_native_config(folder: Path, label: str) -> tuple[dict, Architecture]:
    """config.json of `folder` and its architecture; errors name the folder as `label` (what the user gave)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{label} has no config.json: pass the folder `coreformer export --to native` wrote.")
    config = json.loads(config_path.read_text())
    architecture = (config.get("architectures") or ["(none)"])[0]
    if architecture not in ARCHITECTURES:
        hint = ""
        if str(config.get("model_type", "")).startswith("coreformer"):
            hint = " Export it with `coreformer export FOLDER OUT.gguf --to gguf`, which writes the native model first."
        raise ValueError(
            f"{label} holds a {architecture} ({config.get('model_type')!r}); GGUF export takes "
            f"{', '.join(ARCHITECTURES)} folders, the decoders llama.cpp runs.{hint}"
        )
    reasons = ARCHITECTURES[architecture].refusals(config)
    if reasons:
        raise ValueError(
            f"{label} ({architecture}) cannot be written as GGUF {ARCHITECTURES[architecture].gguf_arch}: "
            f"{'; '.join(reasons)}."
        )
    return config, ARCHITECTURES[architecture]


def read_weights(folder: Path, label: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{label} has no *.safetensors weights; save the model with save_pretrained.")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(path))
    return {name: tensor.float() for name, tensor in weights.items()}


@dataclass
class Vocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]  # "bos" / "eos" / "unk" / "pad" -> id


def read_vocabulary(folder: Path, vocab_size: int, label: str) -> Vocabulary:
    """The byte-level BPE tokenizer of `folder` (tokenizer.json) as llama.cpp's "gpt2" tokenizer model lists it."""
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"{label} has no tokenizer.json: a GGUF file carries its tokenizer, so save the model's (fast) tokenizer "
            f"next to it (tokenizer.save_pretrained)."
        )
    tokenizer = json.loads(path.read_text())
    model, pre = tokenizer.get("model") or {}, tokenizer.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ValueError(
            f"{label}'s tokenizer is {model.get('type')} with a {pre.get('type')} pre-tokenizer; GGUF export writes "
            f"byte-level BPE tokenizers (BPE model, ByteLevel pre-tokenizer with GPT-2's split, as coreformer's "
            f"decoder tokenizers are), which llama.cpp and transformers read as the 'gpt2' tokenizer model."
        )
    ids = dict(model["vocab"])
    special = {}
    for added in tokenizer.get("added_tokens", []):
        ids[added["content"]] = added["id"]
        if added.get("special"):
            special[added["id"]] = added["content"]
    if max(ids.values()) >= vocab_size:
        raise ValueError(
            f"{label}'s tokenizer has ids up to {max(ids.values())}, beyond the model's vocab_size {vocab_size}."
        )
    tokens = [f"[PAD{index}]" for index in range(vocab_size)]
    token_types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for token, index in ids.items():
        tokens[index] = token
        token_types[index] = int(gguf.TokenType.CONTROL if index in special else gguf.TokenType.NORMAL)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]
    config = (
        json.loads((folder / "tokenizer_config.json").read_text())
        if (folder / "tokenizer_config.json").is_file()
        else {}
    )
    special_ids = {}
    for role in ("bos", "eos", "unk", "pad"):
        token = config.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token in ids:
            special_ids[role] = ids[token]
    return Vocabulary(tokens, token_types, merges, special_ids)


# --- writing ---


def encode(tensor: torch.Tensor, dtype: Dtype) -> tuple[np.ndarray, object]:
    """(data, GGML type) of one tensor: 1D stays f32; 2D in `dtype` (q8_0 falls back to f16 for ragged rows)."""
    import gguf
    from gguf.quants import quantize

    array = tensor.detach().contiguous().numpy().astype(np.float32)
    if array.ndim == 1 or dtype.tensor_type == "F32":
        return array, gguf.GGMLQuantizationType.F32
    if dtype.tensor_type == "F16":
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    tensor_type = gguf.GGMLQuantizationType[dtype.tensor_type]
    block, _ = gguf.GGML_QUANT_SIZES[tensor_type]
    if array.shape[-1] % block:
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    return quantize(array, tensor_type), tensor_type


def gguf_tensors(weights: dict[str, torch.Tensor], config: dict, architecture: Architecture) -> dict[str, torch.Tensor]:
    """The native tensors under llama.cpp's names (gguf.TensorNameMap), transformed as llama.cpp stores them."""
    import gguf

    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture.gguf_arch)
    layers = config.get("num_hidden_layers") or config["n_layer"]
    names = gguf.get_tensor_name_map(arch, layers)
    tensors = {}
    for name, tensor in architecture.completed(weights, config).items():
        if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue  # GPT-2's causal-mask buffers and rotary caches are not weights
        stem, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(stem)
        if gguf_name is None:
            raise ValueError(f"No GGUF {architecture.gguf_arch} tensor corresponds to {name}.")
        if gguf_name == "output" and not architecture.write_output(config):
            continue
        tensors[f"{gguf_name}.{suffix}"] = architecture.tensor(name, tensor, config)
    if architecture.write_output(config) and "output.weight" not in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]  # tied: written twice, as llama.cpp does for GPT-2
    return tensors


def write_gguf(
    path: Path, name: str, config: dict, architecture: Architecture, vocabulary: Vocabulary, tensors, dtype: Dtype
):
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture.gguf_arch)
    writer.add_name(name)
    writer.add_file_type(int(gguf.LlamaFileType[dtype.file_type]))
    architecture.metadata(writer, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.token_types)
    writer.add_token_merges(vocabulary.merges)
    adders = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id,
        "pad": writer.add_pad_token_id,
    }
    for role, token_id in vocabulary.special_ids.items():
        adders[role](token_id)
    writer.add_add_bos_token(False)
    types = {}
    for name, tensor in tensors.items():
        data, tensor_type = encode(tensor, dtype)
        writer.add_tensor(name, data, raw_dtype=tensor_type)
        types[name] = tensor_type.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def export_gguf(
    native_folder: Path, out: Path, *, dtype: str = "f32", check: bool = False, label: str | None = None
) -> dict:
    """Write the native Llama / GPT-2 / GPT-NeoX folder `native_folder` as one GGUF file `out` (replaced atomically).
    `label`: how errors and the file's general.name call the model (default: the folder), e.g. the coreformer folder
    a temporary native export was written from.

    Returns {"file", "architecture", "dtype", "tensor_types": {type: count}, and with `check` "max_abs_diff" (the
    file read back against the native model's logits), "tolerance", "greedy_tokens", "tokenizer", "read_back_with"}.
    ValueError naming the reason for a folder it cannot write (not Llama / GPT-2 / GPT-NeoX, a config field GGUF
    cannot carry, a tokenizer that is not byte-level BPE, an unknown dtype); ExportCheckError (a RuntimeError) when
    the check fails (nothing written).
    """
    native_folder, out = Path(native_folder), Path(out)
    label = str(native_folder) if label is None else str(label)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one GGUF export writes: choose {', '.join(DTYPES)}.")
    config, architecture = read_native_config(native_folder, label)
    vocabulary = read_vocabulary(native_folder, config["vocab_size"], label)
    tensors = gguf_tensors(read_weights(native_folder, label), config, architecture)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        types = write_gguf(partial, Path(label).name, config, architecture, vocabulary, tensors, DTYPES[dtype])
        report = {
            "file": str(out),
            "architecture": architecture.gguf_arch,
            "dtype": dtype,
            "tensor_types": {name: list(types.values()).count(name) for name in sorted(set(types.values()))},
        }
        if check:
            report.update(check_gguf(native_folder, partial, DTYPES[dtype], architecture, config))
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return report


# --- checking ---


def transformers_read_back(path: Path, config: dict, architecture: Architecture) -> tuple:
    """(model, tokenizer, fields passed to the loader) from transformers' own GGUF loader. `unread_by_transformers`
    fields are passed to it explicitly (llama.cpp reads them from the file)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    unread = architecture.unread_by_transformers(config)
    loaded_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, **unread)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=loaded_config, dtype=torch.float32
    )
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), unread


def check_gguf(native_folder: Path, path: Path, dtype: Dtype, architecture: Architecture, config: dict) -> dict:
    """Read `path` back (transformers' GGUF loader, or this module's reader for an arch transformers does not read)
    and compare it with the native folder: logits, greedy tokens, tokenizer ids (ExportCheckError if apart)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    native = AutoModelForCausalLM.from_pretrained(native_folder, dtype=torch.float32).eval()
    if architecture.read_back is None:
        loaded, gguf_tokenizer, unread = transformers_read_back(path, config, architecture)
        read_back_with = "transformers' GGUF loader"
    else:
        (loaded, gguf_tokenizer), unread = architecture.read_back(path, config), {}
        read_back_with = f"coreformer's reader of GGUF {architecture.gguf_arch} (transformers' loader has none)"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, native.config.vocab_size, (2, 12), generator=generator)
    with torch.no_grad():
        native_logits = native(ids).logits
        difference = max_abs_difference(native_logits, loaded(ids).logits)
        allowed = dtype.allowed(magnitude(native_logits))
        options = dict(max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS, do_sample=False)
        expected = native.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), **options)[:, 4:]
        got = loaded.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), **options)[:, 4:]
    native_tokenizer = AutoTokenizer.from_pretrained(native_folder)
    mismatched = [
        text
        for text in TOKENIZER_SAMPLES
        if native_tokenizer(text, add_special_tokens=False).input_ids
        != gguf_tokenizer(text, add_special_tokens=False).input_ids
    ]
    tokens_equal = got.tolist() == expected.tolist()
    report = {
        "max_abs_diff": difference,
        "tolerance": allowed,
        "greedy_tokens": {"gguf": got.tolist(), "native": expected.tolist()},
        "tokenizer": {"samples": len(TOKENIZER_SAMPLES), "mismatched": mismatched},
        "read_back_with": read_back_with,
        "check": check_summary(difference, allowed, tokens_equal, not mismatched),
    }
    if unread:
        report["passed_to_transformers_loader"] = unread
    problems = []
    if difference > allowed:
        problems.append(f"logits differ by {difference:.3g} (> {allowed:.3g})")
    if dtype.exact_greedy and not tokens_equal:
        problems.append(f"greedy tokens {got.tolist()} != {expected.tolist()}")
    if mismatched:
        problems.append(f"the GGUF tokenizer encodes {mismatched} differently")
    if problems:
        raise ExportCheckError(
            f"check failed: the GGUF file does not read back as the native model: "
            f"{'; '.join(problems)}; nothing was written."
        )
    return report
