"""Tiny models and batches for the tests: a config of each family (hidden 32, 2 layers, 4 heads, dropout off, so
outputs are deterministic), seeded models, padded batches, incremental decoding through the cache, gradients with
and without activation checkpointing, a tiny ELECTRA, and whether flex_attention builds its kernel here."""

import functools

import torch
from conftest import FAMILIES

import coreformer as cf

VOCAB = 99
PAD, BOS, EOS = 0, 1, 2

FAMILY_CLASSES = {  # family -> (config class, base model class)
    "encoder": (cf.CoreformerEncoderConfig, cf.CoreformerEncoderModel),
    "decoder": (cf.CoreformerDecoderConfig, cf.CoreformerDecoderModel),
    "seq2seq": (cf.CoreformerSeq2SeqConfig, cf.CoreformerSeq2SeqModel),
}
assert tuple(FAMILY_CLASSES) == FAMILIES  # the families the `family` fixture runs


def tiny_config(family: str, **overrides):
    """A tiny config of `family` with dropout off, so outputs are deterministic."""
    config_class = FAMILY_CLASSES[family][0]
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    if family == "seq2seq":
        fields.update(encoder_layers=2, decoder_layers=2, decoder_start_token_id=EOS)
    else:
        fields.update(num_hidden_layers=2)
    fields.update(overrides)
    return config_class(**fields)


def tiny_model(model_class, family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return model_class(tiny_config(family, **overrides)).eval()


# The flex tests' batch length and head layout. flex_attention compiles a kernel per mask function and static shape
# (seconds each on CPU); tests of one length and layout reuse each other's kernels (the flex tests run on one worker).
FLEX_LENGTH = 12
FLEX_HEADS = dict(num_key_value_heads=2)  # grouped key-value heads: flex's enable_gqa path


@functools.cache
def flex_attention_compiles() -> bool:
    """Whether torch's flex_attention builds its kernel on this machine (on CPU it needs inductor's C++ compiler): a
    tiny encoder's forward at the flex tests' shapes (its kernel serves them), once per process, by the first test
    that asks for the `flex_attention` fixture."""
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", **FLEX_HEADS)
    model.set_attn_implementation("flex_attention")
    ids, mask = padded_batch(length=FLEX_LENGTH)
    try:
        with torch.no_grad():  # torch's flex_attention has no CPU backward: the tests compare inference
            model(ids, attention_mask=mask)
    except Exception:  # noqa: BLE001 - any failure to build the kernel means flex is unusable here
        return False
    return True


def padded_batch(batch: int = 3, length: int = 10, left: bool = False, seed: int = 0):
    """Random ids (no special tokens) with rows of decreasing length padded with PAD; returns (ids, mask)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        pad = min(2 * row, length - 1)
        if left:
            mask[row, :pad] = 0
        else:
            mask[row, length - pad :] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def decode_incrementally(model, ids: torch.Tensor, mask: torch.Tensor, prefix: int = 6, cache=None):
    """Full-forward logits and logits from a prefix then one token at a time through the cache (`cache`, e.g. a
    StaticCache, or the one the model builds); returns (incremental, full, cache)."""
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :prefix], attention_mask=mask[:, :prefix], past_key_values=cache, use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(prefix, ids.shape[1]):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    return torch.cat(steps, 1), full, cache


def gradients_with_and_without_checkpointing(build_model, selected) -> tuple[dict, dict]:
    """The gradients of the parameters whose names `selected` accepts, after one loss on a padded batch, from a model
    `build_model()` trained plainly and from one with activation checkpointing: (plain, checkpointed)."""
    from coreformer.compat import enable_activation_checkpointing

    ids, mask = padded_batch()
    runs = []
    for checkpointing in (False, True):
        model = build_model().train()
        if checkpointing:
            enable_activation_checkpointing(model)
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        runs.append({name: p.grad for name, p in model.named_parameters() if selected(name)})
    return runs[0], runs[1]


def tiny_electra(vocab: int = 40):
    """A seeded tiny ELECTRA module (generator + discriminator) and the run arguments it was built from."""
    from coreformer.training.objectives.electra import ELECTRA
    from coreformer.training.pretraining.run import PretrainingArguments

    config = cf.CoreformerEncoderConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64,
    )  # fmt: skip
    args = PretrainingArguments(family="encoder", objective="electra", output_dir="unused")
    torch.manual_seed(0)
    return ELECTRA.build_model(config, args), args
