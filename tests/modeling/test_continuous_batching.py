"""Continuous batching (`model.generate_batch`, paged attention; what `transformers serve --continuous-batching`
runs): the greedy tokens of each prompt equal per-prompt generate()'s for the layer types transformers computes
exactly ("full", "sliding", mixed), under every implementation the running release batches with; every other layer
type, and encoder-decoder models, refused before any work by one line naming what serves them. Also: the config
answers `get_text_config()` in transformers' conventions however it is asked, and writes through to the config."""

import pytest
import torch
from tiny import tiny_model
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import coreformer as cf
from coreformer.compat import CONTINUOUS_BATCHING, RELEASE
from coreformer.layer_types import LAYER_TYPES

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
NEW_TOKENS = 8
WINDOW = 3  # shorter than every prompt but one, and than every generated sequence: the window is exercised
# The types a decoder may hold that no transformers layer type computes exactly (`LayerType.served_as`), and the
# parameters each needs.
UNSERVED = [name for name, kind in LAYER_TYPES.items() if kind.served_as is None and kind.not_causal is None]
LAYER_SETTINGS = dict(stride=2, block_size=4, lsh_bucket_size=4, kv_lora_rank=8)

# The model's implementation when generate_batch is called: it batches "eager" as "paged|eager" (every release) and
# "sdpa" as "paged|sdpa" before 5.19, as itself from 5.19 (which still takes "paged|sdpa" set by the user).
IMPLEMENTATIONS = ["sdpa", "eager", "paged|sdpa"]

needs_release = pytest.mark.skipif(
    not CONTINUOUS_BATCHING,
    reason=f"transformers {RELEASE[0]}.{RELEASE[1]} reads layer types as stored (see the refusal test)",
)


def batching_decoder(layer_types: list[str], positions: str, **overrides) -> cf.CoreformerDecoderForCausalLM:
    # Large untied initial weights: a tiny random decoder then predicts varied tokens (not its last input again), so
    # equal greedy tokens say something.
    return tiny_model(
        cf.CoreformerDecoderForCausalLM,
        "decoder",
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=WINDOW,
        position_embedding_type=positions,
        initializer_range=0.4,
        tie_word_embeddings=False,
        **overrides,
    )


def per_prompt_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    generated = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        generated.append(out[0, len(prompt) :].tolist())
    return generated


def batched_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    # A small paged cache: sized from free memory by default, it takes ~10 s per call to allocate on CPU.
    cache = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64)
    results = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cache)
    # A failing forward is reported by the manager as failed requests, not raised: every request must be back.
    assert len(results) == len(prompts)
    by_request = {result.request_id: result.generated_tokens for result in results.values()}
    return [by_request[f"req_{index}"] for index in range(len(prompts))]


@pytest.mark.compat
@needs_release
@pytest.mark.filterwarnings("ignore:The `paged|` prefix is no longer needed:FutureWarning")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "layer_types", [["full", "full"], ["sliding", "sliding"], ["full", "sliding"]], ids=["full", "sliding", "mixed"]
)
def test_generate_batch_equals_per_prompt_generate(layer_types: list[str], implementation: str):
    model = batching_decoder(layer_types, "rotary", attn_implementation=implementation.removeprefix("paged|"))
    expected = per_prompt_greedy(model, PROMPTS)
    assert len({token for tokens in expected for token in tokens}) > NEW_TOKENS  # not one token repeated
    model.set_attn_implementation(implementation)  # 5.24 drops the deprecated prefix of "paged|sdpa"
    before = model.config._attn_implementation
    assert batched_greedy(model, PROMPTS) == expected
    assert model.config._attn_implementation == before  # put back by the manager


@pytest.mark.compat
@needs_release
def test_generate_batch_with_learned_positions_and_grouped_heads():
    model = batching_decoder(["sliding", "full"], "learned", num_key_value_heads=2)
    assert batched_greedy(model, PROMPTS) == per_prompt_greedy(model, PROMPTS)


@pytest.mark.compat
@needs_release
@pytest.mark.parametrize("refused", UNSERVED)
def test_generate_batch_refuses_every_other_causal_layer_type_by_name(refused: str):
    model = batching_decoder(["full", refused], "rotary", **LAYER_SETTINGS)
    with pytest.raises(ValueError, match=r"continuous batching .* runs only 'full' and 'sliding' layers") as error:
        model.generate_batch(PROMPTS, max_new_tokens=2)
    assert f"'{refused}' (layer 1)" in str(error.value)
    assert "model.generate()" in str(error.value)
    assert not hasattr(model, "_cached_continuous_batching_manager")  # refused before a manager was built


@pytest.mark.compat
@needs_release
def test_generate_batch_refuses_encoder_decoder_models():
    model = tiny_model(cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq")
    with pytest.raises(ValueError, match="serves decoder-only models.*model.generate()"):
        model.generate_batch(PROMPTS, max_new_tokens=2)


@pytest.mark.compat
@pytest.mark.skipif(CONTINUOUS_BATCHING, reason="the refusal is for transformers 5.16, which reads stored names")
def test_generate_batch_names_the_release_it_needs():
    model = batching_decoder(["full", "full"], "rotary")
    with pytest.raises(ValueError, match=r"needs transformers>=5.17.*model.generate\(\)"):
        model.generate_batch(PROMPTS, max_new_tokens=2)


@pytest.mark.compat
def test_paged_implementation_outside_continuous_batching_is_refused():
    # The paged functions read continuous batching's masks and cache; a plain forward under one would attend wrongly.
    model = batching_decoder(["full", "sliding"], "rotary", attn_implementation="paged|eager")
    with pytest.raises(ValueError, match=r"'paged\|eager' attends over continuous batching's paged cache.*'eager'"):
        model(torch.tensor([PROMPTS[0]]))


@pytest.mark.compat
@pytest.mark.parametrize("family", ["encoder", "decoder", "seq2seq"])
def test_text_config_speaks_transformers_conventions_where_an_engine_builds_layers(family: str):
    stacks = {"seq2seq": dict(decoder_layer_types=["sliding", "full"])}
    base_models = {
        "encoder": cf.CoreformerEncoderModel,
        "decoder": cf.CoreformerDecoderModel,
        "seq2seq": cf.CoreformerSeq2SeqModel,
    }
    config = tiny_model(
        base_models[family], family, layer_types=["full", "sliding"], sliding_window=WINDOW, **stacks.get(family, {})
    ).config
    # generate()'s caches: the decoder's stack, in transformers' names and window (the query counted in)
    cached = config.get_text_config(decoder=True)
    expected = (
        ["sliding_attention", "full_attention"] if family == "seq2seq" else ["full_attention", "sliding_attention"]
    )
    assert cached.layer_types == expected and cached.sliding_window == WINDOW + 1
    # Asked for no stack: the config itself, as transformers answers for a text model (vLLM tells a text model from a
    # multimodal one by identity) -- until continuous batching serves it and builds its paged cache from it.
    assert config.get_text_config() is config
    config.serve_continuous_batching()
    served = config.get_text_config()
    assert served is not config and served.layer_types[1] == "sliding_attention" and served.sliding_window == WINDOW + 1
    # Our names stay ours, and so does what config.json holds.
    assert config.layer_types == ["full", "sliding"] and config.sliding_window == WINDOW
    saved = config.to_dict()
    assert saved["coreformer_layer_types"] == ["full", "sliding"] and "_continuous_batching" not in saved


@pytest.mark.compat
def test_a_translated_text_config_writes_through_to_the_config():
    # torchao unties the embeddings by `setattr(config.get_text_config(decoder=True), "tie_word_embeddings", False)`
    model = batching_decoder(["full", "sliding"], "rotary")
    text_config = model.config.get_text_config(decoder=True)
    text_config.tie_word_embeddings = True
    text_config.pad_token_id = 3
    text_config.layer_types = ["full_attention", "full_attention"]  # a translated field stays the copy's
    assert model.config.tie_word_embeddings and model.config.pad_token_id == 3
    assert model.config.layer_types == ["full", "sliding"]
    assert "_translated_from" not in text_config.to_dict()
    # transformers resizes the vocabulary by `config.get_text_config().vocab_size = n`, continuous batching or not
    model.config.serve_continuous_batching()
    model.resize_token_embeddings(128)
    assert model.config.vocab_size == 128 and model.get_output_embeddings().weight.shape[0] == 128
