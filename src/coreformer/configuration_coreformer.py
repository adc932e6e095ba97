"""Configurations of the three coreformer families.

`CoreformerConfig` holds every field the shared attention core and blocks read; the three registered configs only set
family defaults on top of it:

    CoreformerEncoderConfig  "coreformer_encoder"  BERT-style: bidirectional, post-norm, token types, MLM transform
    CoreformerDecoderConfig  "coreformer_decoder"  GPT-style: causal, pre-norm with a final norm
    CoreformerSeq2SeqConfig  "coreformer_seq2seq"  BART-style: encoder stack + decoder stack with cross-attention

Field names follow transformers' standard names so that its utilities (masks, caches, generate, PEFT) read them
directly; `CoreformerConfig` lists them in groups (model size and embeddings, attention, positions, block, layer types
and their kernels' parameters, heads and tasks, special tokens and cache). Every value is checked in `__post_init__`;
a bad value raises one `ValueError` naming the field and the fix. Below the classes: the functions of a config that
its methods call, the tensor- and pipeline-parallel plans it derives and the checks `validate_fields` runs.
"""

import copy

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from .compat import CACHE_KEYWORDS, assigned_tp_plan_entries
from .families import MODEL_TYPES, register_with_peft
from .layer_types import LAYER_TYPES

# PEFT's default LoRA targets for our model types, now or when peft is imported (this file runs first under
# trust_remote_code, and before `import coreformer` registers anything).
register_with_peft()

POSITION_EMBEDDING_TYPES = ("learned", "sinusoidal", "rotary", "none")
LINEAR_FEATURE_MAPS = ("elu", "performer")
# config.json writes `layer_types` in names transformers' generic config accepts (AutoTokenizer reads config.json
# where coreformer is not installed, and validates that field strictly), and our own names under SAVED_LAYER_TYPES.
SAVED_LAYER_TYPES = "coreformer_layer_types"
# The fields `get_text_config` hands transformers in its own conventions. Every other attribute set on the copy it
# returns is set on the config too, as on the config itself (torchao unties the embeddings by
# `setattr(get_text_config(decoder=True), "tie_word_embeddings", False)`).
TRANSLATED_FIELDS = frozenset({"layer_types", "sliding_window"})
TRANSLATED_FROM = "_translated_from"
# Set (in the instance's __dict__, never saved) on the config of a model continuous batching serves: from then on
# `get_text_config()` answers in transformers' names, which its paged cache builds its layers from.
SERVED_BY_CONTINUOUS_BATCHING = "_continuous_batching"
# Our `layer_types` and `sliding_window`, kept in the instance's __dict__ while vLLM's names are written over them
# (`vllm_serving.publish`).
ENGINE_ORIGINALS = "_coreformer_originals"
GENERIC_LAYER_TYPES = {name: layer_type.saved_name for name, layer_type in LAYER_TYPES.items()}
NORM_TYPES = ("layernorm", "rmsnorm")
ATTENTION_GATES = (None, "elementwise", "headwise")
NORM_POSITIONS = ("pre", "post")
# How sequence classifiers (and multiple choice) summarise a sequence: modeling_heads.POOLINGS holds the functions.
CLASSIFIER_POOLINGS = ("cls", "last", "mean")


class CoreformerConfig(PreTrainedConfig):
    r"""
    Fields shared by every coreformer family. Not registered itself: use one of the three family configs.

    The fields come in groups, in the code as here: model size and embeddings, attention, positions, the block (MLP,
    norms, dropout), the layer types and the parameters of their efficient kernels, heads and tasks, and the special
    tokens, initialisation and cache.

    Args: Model size and embeddings
        vocab_size: Number of tokens in the vocabulary.
        hidden_size: Width of the residual stream.
        type_vocab_size: Number of token types (BERT segments); 0 disables token-type embeddings.
        scale_embedding: Multiply token embeddings by sqrt(hidden_size) (BART's scale_embedding).
        embedding_layernorm: Normalise the summed embeddings (BERT's embeddings LayerNorm, BART's
            layernorm_embedding).

    Args: Attention
        num_attention_heads: Query heads per attention layer.
        num_key_value_heads: Key/value heads (grouped-query attention); `None` means `num_attention_heads` (MHA),
            1 means multi-query attention.
        head_dim: Width of one head; `None` means `hidden_size // num_attention_heads`.
        attention_bias: Biases on the q/k/v/o projections.
        attention_dropout: Dropout on attention probabilities.
        qk_norm: Normalise each query and key head (RMSNorm over head_dim, `layer_norm_eps`, a weight per layer:
            `q_norm`, `k_norm`) before the rotary angles, as Qwen3 and Qwen3-Next do.
        attention_gate: Gated attention (Qiu et al. 2025): each head's output is multiplied by sigmoid(gate) before
            `o_proj`, the gate projected from the layer input by `q_proj` beside the query. "elementwise" (a gate per
            channel, as Qwen3-Next) or "headwise" (one per head); `None`: no gate. Per head, `q_proj`'s output rows are
            the head's head_dim query rows, then its gate rows (head_dim, or 1).
        attention_sinks: A learned logit per head (`sinks`) joins every softmax's denominator with no value, as
            GPT-OSS's attention sinks: a head can give its weight to nothing. Softmax layers ("full", "sliding",
            "strided", "block") only, under eager, sdpa or flex_attention: not under flash attention, continuous
            batching or vLLM, whose attention has no sink.

    Args: Positions
        max_position_embeddings: Longest sequence; enforced for learned and sinusoidal positions.
        position_embedding_type: "learned" | "sinusoidal" | "rotary" | "none".
        position_offset: Added to position ids before the learned table lookup (BART stores positions from 2).
        rope_theta: Base of the rotary frequencies (of every layer whose type reads no other field, see
            `local_rope_theta`).
        local_rope_theta: Base of the rotary frequencies of "sliding" layers (layer_types.py's table says which types
            read it); `None` means `rope_theta`. ModernBERT's local layers use 10,000 and its global ones 160,000.
        partial_rotary_factor: The share of each head's channels that rotary positions rotate, the first ones (an
            even number of them); the rest pass unrotated. Qwen3-Next and GPT-NeoX rotate a quarter.

    Args: Block (MLP, norms, dropout)
        intermediate_size: Width of the MLP.
        hidden_act: MLP activation, any name in `transformers.activations.ACT2FN` ("gelu", "gelu_new", "silu", ...).
        gated_mlp: `down(act(gate(x)) * up(x))` (SwiGLU with `hidden_act="silu"`) instead of `down(act(up(x)))`.
        mlp_bias: Biases on the MLP projections.
        norm_type: "layernorm" | "rmsnorm".
        norm_position: "pre" (norm inside the residual branch, GPT-2) or "post" (norm after the residual sum, BERT).
        layer_norm_eps: Epsilon of every norm.
        norm_bias: LayerNorms have a bias (ModernBERT's `norm_bias=False` drops it); RMSNorm never has one.
        final_norm: Norm after the last block; `None` means "only for pre-norm", which is what every family uses.
        first_layer_attention_norm: `False` gives the first block of each stack no self-attention norm (an
            `nn.Identity`), as ModernBERT's first layer: its attention reads the (normalised) embeddings directly.
            Pre-norm only.
        hidden_dropout: Dropout on embeddings and on every residual branch.

    Args: Layer types
        layer_types: Attention of each layer (one entry per layer; default all "full"); in the seq2seq config this is
            the encoder's list and `decoder_layer_types` the decoder's:
            "full"     softmax attention over every (unmasked) key;
            "sliding"  band: each query sees the `sliding_window` tokens before it (and after it, in an encoder);
                       cached decoding keeps only that window;
            "strided"  Sparse Transformer strided pattern (Child et al. 2019): the `stride` tokens before (around)
                       the query plus every `stride`-th token before (around) it;
            "lowrank"  Linformer (Wang et al. 2020): keys and values projected along the sequence to `lowrank_k`
                       rows; bidirectional only, for sequences up to `max_position_embeddings`;
            "linear"   kernel feature-map attention (Katharopoulos et al. 2020; Performer, Choromanski et al. 2021):
                       O(L) in time and memory, with a running state in the cache (O(1) per generated token);
            "lsh"      Reformer's LSH attention (Kitaev et al. 2020): queries and keys share one projection, tokens are
                       hashed into buckets and each query sees the `lsh_bucket_size` nearest tokens of its bucket
                       (earlier ones in a decoder), over `lsh_num_hashes` rounds; O(L log L);
            "block"    block-diagonal local attention: each query sees the keys of its own block of `block_size`
                       positions (counted from the start of the row; earlier ones in a decoder);
            "differential"  differential attention (Ye et al. 2024), as transformers' DiffLlama: two softmax maps
                       subtracted with a learned λ, each pair of query heads one head of twice the value width,
                       RMS-normalised; `num_key_value_heads` even;
            "sigmoid"  sigmoid attention (Ramapuram et al. 2024): each visible key weighted by
                       sigmoid(q·k / sqrt(d) - log `sigmoid_length`), no normalisation over keys; a dense kernel
                       under every backend;
            "mla"      multi-head latent attention (DeepSeek-V2/V3): keys and values expanded from a `kv_lora_rank`
                       latent and one shared rotary key of `head_dim` channels, which are what the cache holds;
                       queries optionally through a `q_lora_rank` latent;
            "gated_deltanet"  Gated DeltaNet (Yang et al. 2025), as Qwen3-Next's linear layers: a short convolution,
                       then a decaying (D_k, D_v) state per value head corrected towards each token's value (the delta
                       rule); O(L), a constant-size cache; decoders only, beside at least one attention layer.

    Args: Efficient kernels (the parameters of the layer types above)
        sliding_window: Tokens a "sliding" layer sees on each side of the query (the query itself comes on top).
        stride: Period of the "strided" pattern, also the width of its local band.
        block_size: Positions per block of "block" layers.
        lowrank_k: Projected sequence length of "lowrank" layers.
        linear_feature_map: "elu" (elu(x) + 1) or "performer" (positive random features, softmax-kernel estimate).
        linear_num_features: Random features per head for "performer" (default: head_dim).
        lsh_bucket_size: Keys of its own bucket an "lsh" query sees per hash round (the nearest), also the chunk
            length of its kernel (Reformer's `lsh_attn_chunk_length`).
        lsh_num_hashes: Hash rounds of "lsh" layers; a query sees the union of its rounds' keys (Reformer's
            `num_hashes`).
        lsh_num_buckets: Buckets per hash round of "lsh" layers, even (Reformer's `num_buckets`).
        lsh_hash_seed: Seed of the random rotations of "lsh" layers, drawn at initialisation (layer i: seed + i) and
            saved with the weights.
        lambda_std_dev: Standard deviation of the initial λ vectors of "differential" layers (`lambda_q1`,
            `lambda_k1`, `lambda_q2`, `lambda_k2`), DiffLlama's field.
        sigmoid_length: n of the bias -log n of "sigmoid" layers: the sequence length the model trains on (the
            paper sets the bias from it, a constant); `None` means `max_position_embeddings`.
        kv_lora_rank: Width of the key/value latent of "mla" layers (DeepSeek-V3's field): the cache holds it and
            one rotary key of `head_dim` channels per token, instead of every head's keys and values.
        q_lora_rank: Width of the query latent of "mla" layers (queries through a low-rank projection and an RMS
            norm); `None`: one query projection.
        qk_nope_head_dim: Channels of each "mla" query/key head without rotary angles (the rotary ones are
            `head_dim`, DeepSeek-V3's `qk_rope_head_dim`); `None` means `head_dim`.
        v_head_dim: Width of each "mla" value head; `None` means `qk_nope_head_dim`.
        linear_num_key_heads: Query/key heads of "gated_deltanet" layers (Qwen3-Next's field); `None` means
            `num_attention_heads`.
        linear_num_value_heads: Value heads of "gated_deltanet" layers, a multiple of the key heads (each query/key
            head serves that many); `None` means `linear_num_key_heads`.
        linear_key_head_dim: Width of each "gated_deltanet" query/key head; `None` means `head_dim`.
        linear_value_head_dim: Width of each "gated_deltanet" value head; `None` means `head_dim`.
        linear_conv_kernel_dim: Taps of the short causal convolution q, k and v pass through in "gated_deltanet"
            layers.

    Args: Heads and tasks
        tie_word_embeddings: The LM head shares its weight with the input embedding.
        lm_head_transform: Dense + activation + norm before the LM projection (BERT's MLM transform).
        lm_head_bias: A trained bias on the LM projection (BERT's decoder bias). BART's frozen one is the seq2seq
            config's `final_logits_bias`.
        head_transform_bias: A bias on the dense layer of the head transforms (`lm_head_transform`,
            `classifier_transform`); ModernBERT's prediction head has none (its `classifier_bias=False`).
        classifier_transform: Every classification head (sequence, token, question answering, multiple choice)
            first applies its own head transform (dense -> activation -> norm, the MLM transform's shape) and
            dropout, as ModernBERT's prediction head `head`; then its usual classifier.
        classifier_pooling: How sequence classifiers and multiple choice summarise the sequence: "cls" (the first
            token), "last" (the last real token) or "mean" (the mean over real tokens, ModernBERT's "mean"); `None`
            means the family's own: the encoder's "cls", the decoder's "last" (seq2seq classifiers always pool at
            the last eos).
        classifier_dense: Sequence classifiers project the pooled token with a tanh dense layer first (BERT's pooler,
            BART's classification head); without it the pooled token goes straight to the output (GPT-2's score).
        classifier_bias: A bias on the classifier output projection.
        classifier_dropout: Dropout before classification heads; `None` means `hidden_dropout`.
        classifier_dropout_before_dense: Dropout on the pooled token before the dense layer too (RoBERTa's and BART's
            classification heads drop out both before and after it; BERT's pooler only after).

    Args: Special tokens, initialisation and cache
        pad_token_id: The padding token (transformers' standard field, as `bos_token_id` and `eos_token_id`).
        bos_token_id: The beginning-of-sequence token, or None.
        eos_token_id: The end-of-sequence token (or a list of them), or None.
        initializer_range: Standard deviation of the normal weight init.
        use_cache: Return a KV cache from causal forwards (inference only; training never builds one).
    """

    # model size and embeddings
    vocab_size: int = 32000
    hidden_size: int = 768
    type_vocab_size: int = 0
    scale_embedding: bool = False
    embedding_layernorm: bool = True
    # attention
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    attention_bias: bool = True
    attention_dropout: float = 0.0
    qk_norm: bool = False
    attention_gate: str | None = None
    attention_sinks: bool = False
    # positions
    max_position_embeddings: int = 512
    position_embedding_type: str = "learned"
    position_offset: int = 0
    rope_theta: float = 10000.0
    local_rope_theta: float | None = None
    partial_rotary_factor: float = 1.0
    # block: MLP, norms, dropout
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    gated_mlp: bool = False
    mlp_bias: bool = True
    norm_type: str = "layernorm"
    norm_position: str = "post"
    layer_norm_eps: float = 1e-12
    norm_bias: bool = True
    final_norm: bool | None = None
    first_layer_attention_norm: bool = True
    hidden_dropout: float = 0.1
    # layer types, and the parameters of their efficient kernels
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    stride: int | None = None
    block_size: int | None = None
    lowrank_k: int | None = None
    linear_feature_map: str = "elu"
    linear_num_features: int | None = None
    lsh_bucket_size: int | None = None
    lsh_num_hashes: int = 1
    lsh_num_buckets: int = 32
    lsh_hash_seed: int = 0
    lambda_std_dev: float = 0.1
    sigmoid_length: int | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int = 4
    # heads and tasks
    tie_word_embeddings: bool = True
    lm_head_transform: bool = False
    lm_head_bias: bool = False
    head_transform_bias: bool = True
    classifier_transform: bool = False
    classifier_pooling: str | None = None
    classifier_dense: bool = True
    classifier_bias: bool = True
    classifier_dropout: float | None = None
    classifier_dropout_before_dense: bool = False
    # special tokens, initialisation and cache
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: float = 0.02
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        if SAVED_LAYER_TYPES in kwargs:
            # `Config(**config.to_dict())`: the dict holds transformers' names under `layer_types` and ours here.
            self.layer_types = kwargs.pop(SAVED_LAYER_TYPES)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads and self.hidden_size % self.num_attention_heads == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.final_norm is None:
            self.final_norm = self.norm_position == "pre"
        for name, (count, _) in self.stack_layer_types().items():
            if getattr(self, name) is None and isinstance(count, int):
                setattr(self, name, ["full"] * count)
        if self.linear_num_features is None:
            self.linear_num_features = self.head_dim
        used = {kind for name in self.stack_layer_types() for kind in getattr(self, name) or ()}
        for layer_type, entry in LAYER_TYPES.items():
            if entry.parameter_announces_type and layer_type not in used:
                setattr(self, entry.parameter, None)  # a model without such layers must not read as one (vLLM)
        self.validate_fields()
        super().__post_init__(**kwargs)
        if self.model_type in MODEL_TYPES:
            # Every Auto class of the family (families.py), not just the saved one, so trust_remote_code finds all.
            self.auto_map = MODEL_TYPES[self.model_type].auto_map

    def to_dict(self) -> dict:
        output = super().to_dict()
        output.pop(TRANSLATED_FROM, None)
        output.pop(SERVED_BY_CONTINUOUS_BATCHING, None)
        output.update(output.pop(ENGINE_ORIGINALS, None) or {})  # ours, where vLLM's names were written over them
        # transformers' generic config (AutoTokenizer on a machine without coreformer) validates `layer_types`
        # against its own names. An all-"full" list is the default and is rebuilt on load, so it is left out; any
        # other is written in transformers' names, with ours under SAVED_LAYER_TYPES (from_dict reads them back).
        for name in self.stack_layer_types():
            if set(output.get(name) or ()) <= {"full"}:
                output.pop(name, None)
            elif name == "layer_types" and set(output[name]) <= set(LAYER_TYPES):  # not get_text_config's copy
                output[SAVED_LAYER_TYPES] = output[name]
                output[name] = [LAYER_TYPES[layer_type].saved_name for layer_type in output[name]]
        return output

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "CoreformerConfig":
        # transformers only warns when a config.json of another model type is loaded into this class, and the model
        # then comes up with freshly initialised weights: refuse instead, saying what the folder holds.
        found = config_dict.get("model_type")
        if found and cls.model_type and found != cls.model_type:
            if found in MODEL_TYPES:
                fix = f"load it with the Auto classes or the {MODEL_TYPES[found].name} family's classes"
            else:
                fix = "convert it first with `coreformer convert SRC DST` (BERT, RoBERTa, GPT-2, BART)"
            raise ValueError(f"This checkpoint is a '{found}' model, not '{cls.model_type}': {fix}.")
        if SAVED_LAYER_TYPES in config_dict:
            config_dict = dict(config_dict)
            config_dict["layer_types"] = config_dict.pop(SAVED_LAYER_TYPES)
        return super().from_dict(config_dict, **kwargs)

    @property
    def base_model_tp_plan(self) -> dict[str, str] | None:
        """Tensor parallelism (`from_pretrained(..., tp_plan="auto")`), derived from the fields
        (`tensor_parallel_plan`)."""
        return tensor_parallel_plan(self)

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, assigned: dict[str, str] | None) -> None:
        # The plan is derived from the fields above, so there is nothing to store: an assignment that only restates
        # it (as transformers before 5.21 makes at init, `compat.assigned_tp_plan_entries`) is accepted, any other
        # refused by name rather than ignored.
        extra = assigned_tp_plan_entries(assigned, self.base_model_tp_plan)
        if extra:
            raise ValueError(
                f"base_model_tp_plan is derived from the config (the stacks, gated_mlp); it cannot take {extra}. "
                f"Pass a plan to from_pretrained(..., tp_plan={{...}}) instead."
            )

    @property
    def base_model_pp_plan(self) -> dict[str, tuple[list[str], list[str]]] | None:
        """Pipeline stages (read by pipeline-parallel trainers), derived from the fields: `pipeline_parallel_plan`."""
        return pipeline_parallel_plan(self)

    def layer_counts(self) -> dict[str, int]:
        """The layer-count fields of this family, by name (validated to be positive)."""
        return {"num_hidden_layers": self.num_hidden_layers}

    def stack_layer_types(self) -> dict[str, tuple[int, bool]]:
        """Each layer-types field of this family -> (number of layers it must list, whether that stack is causal)."""
        return {"layer_types": (self.num_hidden_layers, self.is_causal_stack)}

    is_causal_stack = False

    @property
    def cached_layer_types(self) -> list[str] | None:
        """The layer types of the stack that keeps a cache: the decoder's (`decoder_layer_types` in seq2seq)."""
        return self.layer_types

    def get_text_config(self, decoder=None, encoder=None) -> PreTrainedConfig:
        """The config as transformers' engines read it: `layer_types` in its vocabulary ("full_attention",
        "sliding_attention", ...) and `sliding_window` in its convention (the query counted in), in a copy whose other
        attributes write through to this config (`TRANSLATED_FIELDS`); users keep our names.

        Translated where an engine builds layers from them: `decoder=True` (generate()'s caches; the seq2seq
        decoder's stack) and, once continuous batching serves the model (`serve_continuous_batching`), with no
        argument (its paged cache). Otherwise, as transformers answers for a text model: the config itself (vLLM tells
        a text model from a multimodal one by `get_text_config() is config`; it reads the names `vllm_serving` writes
        onto the config instead)."""
        text_config = super().get_text_config(decoder=decoder, encoder=encoder)
        if not decoder and not (encoder is None and self.__dict__.get(SERVED_BY_CONTINUOUS_BATCHING)):
            return text_config
        layer_types = self.cached_layer_types if decoder else self.layer_types
        if not layer_types or layer_types[0] not in LAYER_TYPES:  # already translated
            return text_config
        translated = copy.copy(text_config)
        translated.layer_types = [LAYER_TYPES[layer_type].cache_layer for layer_type in layer_types]
        if text_config.sliding_window is not None:
            # transformers' window counts the query itself and keeps `sliding_window - 1` past tokens in the cache.
            translated.sliding_window = LAYER_TYPES["sliding"].transformers_window(text_config.sliding_window)
        if text_config is self:  # not a copy transformers made for one stack of a seq2seq config
            translated.__dict__[TRANSLATED_FROM] = self
        return translated

    def serve_continuous_batching(self) -> None:
        """Answer `get_text_config()` in transformers' names from now on: continuous batching builds its paged cache
        from it, and its manager may outlive the call that started it."""
        self.__dict__[SERVED_BY_CONTINUOUS_BATCHING] = True

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        source = self.__dict__.get(TRANSLATED_FROM)
        if source is not None and name not in TRANSLATED_FIELDS:
            setattr(source, name, value)

    def validate_fields(self) -> None:
        """Raise one `ValueError` naming the first bad field and how to fix it."""
        check_sizes(self)
        check_choices(self)
        check_ranges(self)
        self.validate_layer_types()
        check_attention_options(self)
        check_token_ids(self)

    def rope_theta_of(self, layer_type: str) -> float:
        """The rotary base of a layer of `layer_type`: the config field its layer-type entry names, else
        `rope_theta`."""
        theta = getattr(self, LAYER_TYPES[layer_type].rope_theta_field)
        return self.rope_theta if theta is None else theta

    def gated_deltanet_sizes(self) -> dict[str, int | None]:
        """The heads and head widths of "gated_deltanet" layers, each `linear_*` field left None taking the attention's:
        key heads `num_attention_heads`, value heads the key heads, both widths `head_dim`."""
        key_heads = self.linear_num_key_heads or self.num_attention_heads
        return {
            "key_heads": key_heads,
            "value_heads": self.linear_num_value_heads or key_heads,
            "key_dim": self.linear_key_head_dim or self.head_dim,
            "value_dim": self.linear_value_head_dim or self.head_dim,
        }

    def require_head_dim(self) -> int:
        """The width of one head; one clear error when `hidden_size` does not split into `num_attention_heads`."""
        if self.head_dim is None:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads}): change one of them, or set `head_dim` explicitly."
            )
        return self.head_dim

    def validate(self) -> None:
        """transformers' strict-dataclass validation (run at init and save), with its layer-type check swapped for
        ours: it only knows its own vocabulary, which `get_text_config` translates to where transformers reads it."""
        for validator in type(self).__class_validators__:
            if validator.__name__ != "validate_layer_type":
                validator(self)
        self.validate_layer_types()

    @staticmethod
    def causal_layer_types() -> list[str]:
        """The layer types that may sit in a causal stack."""
        return [name for name, layer_type in LAYER_TYPES.items() if layer_type.not_causal is None]

    def validate_layer_types(self) -> None:
        """Each layer-types list has one known entry per layer, and every type used has its parameters."""
        used = set()
        for name, (count, causal) in self.stack_layer_types().items():
            types = getattr(self, name)
            if not isinstance(types, list) or len(types) != count:
                raise ValueError(f"`{name}` needs one entry per layer ({count}), got {types!r}.")
            unknown = sorted(set(types) - set(LAYER_TYPES))
            if unknown:
                known = tuple(LAYER_TYPES)
                raise ValueError(f"`{name}` has unknown attention types {unknown}; choose from {known}.")
            for layer_type in sorted(set(types)):
                entry = LAYER_TYPES[layer_type]
                if causal and entry.not_causal is not None:
                    raise ValueError(
                        f"`{name}` puts '{layer_type}' in a causal stack: {entry.not_causal}. It is bidirectional "
                        f"only (encoder layers); use one of {self.causal_layer_types()} for decoders."
                    )
                if not causal and entry.not_bidirectional is not None:
                    bidirectional = [name for name, other in LAYER_TYPES.items() if other.not_bidirectional is None]
                    raise ValueError(
                        f"`{name}` puts '{layer_type}' in a bidirectional stack: {entry.not_bidirectional}. It is "
                        f"causal only (decoder layers); use one of {bidirectional} for encoders."
                    )
            used.update(types)
        for layer_type in sorted(used):
            entry = LAYER_TYPES[layer_type]
            value = getattr(self, entry.parameter) if entry.parameter else None
            if entry.parameter and (not isinstance(value, int) or value < 1):
                raise ValueError(f"'{layer_type}' layers need `{entry.parameter}`, a positive integer; got {value!r}.")
            if entry.validate is not None:
                entry.validate(self)
        if self.linear_feature_map not in LINEAR_FEATURE_MAPS:
            raise ValueError(
                f"`linear_feature_map` must be one of {LINEAR_FEATURE_MAPS}, got {self.linear_feature_map!r}."
            )
        linear_num_features = self.linear_num_features
        if linear_num_features is None and self.head_dim is None:
            return  # derived from head_dim, which `require_head_dim` refuses when a model is built
        if not isinstance(linear_num_features, int) or linear_num_features < 1:
            raise ValueError(f"`linear_num_features` must be a positive integer, got {self.linear_num_features!r}.")


class CoreformerEncoderConfig(CoreformerConfig):
    r"""BERT-style encoder: bidirectional self-attention, post-norm blocks, token types, MLM transform head.

    Example:
        >>> from coreformer import CoreformerEncoderConfig, CoreformerEncoderForMaskedLM
        >>> model = CoreformerEncoderForMaskedLM(CoreformerEncoderConfig(hidden_size=256, num_hidden_layers=4))
    """

    model_type = "coreformer_encoder"

    num_hidden_layers: int = 12
    type_vocab_size: int = 2
    lm_head_transform: bool = True
    lm_head_bias: bool = True


class CoreformerDecoderConfig(CoreformerConfig):
    r"""GPT-style decoder: causal self-attention, pre-norm blocks with a final norm.

    Example:
        >>> from coreformer import CoreformerDecoderConfig, CoreformerDecoderForCausalLM
        >>> config = CoreformerDecoderConfig(position_embedding_type="rotary", norm_type="rmsnorm",
        ...                                  hidden_act="silu", gated_mlp=True)  # a Llama-style block
        >>> model = CoreformerDecoderForCausalLM(config)
    """

    model_type = "coreformer_decoder"
    keys_to_ignore_at_inference = CACHE_KEYWORDS

    num_hidden_layers: int = 12
    is_causal_stack = True
    max_position_embeddings: int = 1024
    hidden_act: str = "gelu_new"
    norm_position: str = "pre"
    layer_norm_eps: float = 1e-5
    embedding_layernorm: bool = False
    classifier_dense: bool = False
    classifier_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2


class CoreformerSeq2SeqConfig(CoreformerConfig):
    r"""BART-style encoder-decoder: an encoder stack and a decoder stack with cross-attention, one shared embedding.

    `num_hidden_layers` reads and writes `encoder_layers`; transformers' `get_text_config(decoder=True)` maps
    `decoder_layers` onto it, which is how its caches size themselves for the decoder.

    Args:
        encoder_layers: Blocks in the encoder stack.
        decoder_layers: Blocks in the decoder stack.
        decoder_start_token_id: First decoder input, also used to shift labels right.
        final_logits_bias: Add BART's `final_logits_bias` to the LM logits: a (1, vocab_size) buffer, saved with the
            weights but never trained (converted BART checkpoints set it).
    """

    model_type = "coreformer_seq2seq"
    keys_to_ignore_at_inference = CACHE_KEYWORDS
    attribute_map = {"num_hidden_layers": "encoder_layers"}

    encoder_layers: int = 6
    decoder_layers: int = 6
    decoder_start_token_id: int | None = 2
    final_logits_bias: bool = False
    is_encoder_decoder: bool = True
    layer_norm_eps: float = 1e-5
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = 1

    decoder_layer_types: list[str] | None = None

    def layer_counts(self) -> dict[str, int]:
        return {"encoder_layers": self.encoder_layers, "decoder_layers": self.decoder_layers}

    def stack_layer_types(self) -> dict[str, tuple[int, bool]]:
        return {"layer_types": (self.encoder_layers, False), "decoder_layer_types": (self.decoder_layers, True)}

    @property
    def cached_layer_types(self) -> list[str] | None:
        # Read directly: transformers' get_text_config(decoder=True) renames only the decoder_* fields that
        # to_dict() writes, and an all-"full" decoder_layer_types is left out of it, so the copy it returns would
        # keep the encoder's layer_types and size the cache for the encoder's depth.
        return self.decoder_layer_types

    def validate_fields(self) -> None:
        super().validate_fields()
        if self.classifier_pooling is not None:
            raise ValueError(
                f"`classifier_pooling` ({self.classifier_pooling!r}) is for encoders and decoders: the seq2seq "
                f"classifier always pools the decoder state at the last eos token (as BART's). Leave it None."
            )
        if self.decoder_start_token_id is None:
            raise ValueError(
                "`decoder_start_token_id` is required: it is the first decoder input in generation and when labels "
                "are shifted right. Set it (BART uses the eos id)."
            )


# What `CoreformerConfig` derives from its fields and how it checks them, as functions of a config: the parallelism
# plans its `base_model_tp_plan` / `base_model_pp_plan` return, and the checks its `validate_fields` runs in turn.


def tensor_parallel_plan(config: CoreformerConfig) -> dict[str, str] | None:
    """Tensor parallelism (`from_pretrained(..., tp_plan="auto")`), as Llama's plan: every attention's heads and
    every MLP's width split across ranks (q/k/v, up and gate by columns; o and down by rows, then summed), in
    every stack of the base model (families.py names them), and each stack's token embedding split on the
    vocabulary (`embedding_rowwise`, what transformers gives Llama's `embed_tokens`): the ranks' partial lookups
    are summed, so each holds `vocab / ranks` rows, and a tied LM head (its own `colwise_gather_output` entry on
    the head class) reads the same vocabulary slice. Position and token-type tables are indexed by position and
    segment, not by token, and stay whole on every rank, as does the MLM transform. Layer types need nothing
    more: each head attends on its own in every type, and the sequence-side pieces (Linformer's E/F,
    Performer's features) are shared by all heads, so they stay whole on every rank. As for Llama, the number of
    ranks must divide `num_key_value_heads`. "differential" layers refuse it when they run: they pair head i with
    head i + H/2, which a split by columns puts on different ranks."""
    family = MODEL_TYPES.get(config.model_type)
    if family is None:
        return None
    block = {f"{projection}_proj": "colwise" for projection in "qkv"} | {"o_proj": "rowwise"}
    mlp = {"up_proj": "colwise", "down_proj": "rowwise"} | ({"gate_proj": "colwise"} if config.gated_mlp else {})
    plan = {}
    for stack in family.stacks:
        plan[f"{stack}.embed_tokens"] = "embedding_rowwise"
        attentions = ("self_attn", "cross_attn") if stack == family.cross_attention_stack else ("self_attn",)
        for attention in attentions:
            plan |= {f"{stack}.layers.*.{attention}.{name}": style for name, style in block.items()}
            if config.attention_sinks:  # one per query head, split with them (as transformers' GraniteSwa plans it)
                plan[f"{stack}.layers.*.{attention}.sinks"] = "colwise"
        plan |= {f"{stack}.layers.*.mlp.{name}": style for name, style in mlp.items()}
    return plan


def pipeline_parallel_plan(config: CoreformerConfig) -> dict[str, tuple[list[str], list[str]]] | None:
    """Pipeline stages (read by pipeline-parallel trainers): each stack's embedding, its blocks and its final
    norm, with the tensors that flow between them, as Llama's plan names them."""
    family = MODEL_TYPES.get(config.model_type)
    if family is None:
        return None
    plan = {}
    for stack in family.stacks:
        plan[f"{stack}.embed_tokens"] = (["input_ids"], ["inputs_embeds"])
        plan[f"{stack}.layers"] = (["hidden_states", "attention_mask"], ["hidden_states"])
        if config.final_norm:
            plan[f"{stack}.norm"] = (["hidden_states"], ["hidden_states"])
    return plan


def check_sizes(config: CoreformerConfig) -> None:
    """Counts and widths: positive integers, heads that group evenly."""
    positive = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        **config.layer_counts(),
    }
    for name, value in positive.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    # A head width that cannot be derived is refused when a model is built (`require_head_dim`), not here: as
    # BertConfig, a config with, say, hidden_size=37 and the default 12 heads must still construct, be edited and
    # be saved (transformers' ConfigTester does exactly that).
    if config.head_dim is not None and (not isinstance(config.head_dim, int) or config.head_dim < 1):
        raise ValueError(f"`head_dim` must be a positive integer, got {config.head_dim!r}.")
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ValueError(
            f"`num_attention_heads` ({config.num_attention_heads}) must be a multiple of `num_key_value_heads` "
            f"({config.num_key_value_heads}): each key/value head serves a whole group of query heads."
        )


def check_choices(config: CoreformerConfig) -> None:
    """Fields that name one of a set of options, and the combinations of options that cannot work."""
    if config.hidden_act not in ACT2FN:
        raise ValueError(
            f"`hidden_act` {config.hidden_act!r} is not a known activation; use one of transformers' ACT2FN names "
            f"such as 'gelu', 'gelu_new', 'relu' or 'silu'."
        )
    choices = {
        "position_embedding_type": (config.position_embedding_type, POSITION_EMBEDDING_TYPES),
        "norm_type": (config.norm_type, NORM_TYPES),
        "norm_position": (config.norm_position, NORM_POSITIONS),
    }
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}.")
    if config.position_embedding_type == "rotary" and config.head_dim is not None and config.head_dim % 2:
        raise ValueError(f"rotary positions rotate pairs of channels: `head_dim` ({config.head_dim}) must be even.")
    if not config.first_layer_attention_norm and config.norm_position != "pre":
        raise ValueError(
            "`first_layer_attention_norm=False` (ModernBERT's first layer) reads the embeddings without a norm "
            "inside the attention branch, which exists only in pre-norm blocks: set `norm_position='pre'`."
        )
    if config.classifier_pooling is not None and config.classifier_pooling not in CLASSIFIER_POOLINGS:
        raise ValueError(
            f"`classifier_pooling` must be one of {CLASSIFIER_POOLINGS} (or None for the family's own), got "
            f"{config.classifier_pooling!r}."
        )


def check_ranges(config: CoreformerConfig) -> None:
    """Numbers with a valid range: epsilons, offsets, the rotary bases, probabilities."""
    if config.position_offset < 0:
        raise ValueError(f"`position_offset` must be >= 0, got {config.position_offset}.")
    if config.type_vocab_size < 0:
        raise ValueError(f"`type_vocab_size` must be >= 0 (0 disables token types), got {config.type_vocab_size}.")
    for name in ("rope_theta", "local_rope_theta"):
        theta = getattr(config, name)
        if theta is not None and theta <= 0:
            raise ValueError(f"`{name}` must be > 0, got {theta}.")
    factor = config.partial_rotary_factor
    rotated = int(config.head_dim * factor) if config.head_dim is not None else 2
    if not 0 < factor <= 1 or (factor < 1 and (rotated < 2 or rotated % 2)):
        raise ValueError(
            f"`partial_rotary_factor` must be in (0, 1] and rotate an even number (>= 2) of each head's "
            f"{config.head_dim} channels, got {factor} ({rotated} channels)."
        )
    if config.layer_norm_eps <= 0:
        raise ValueError(f"`layer_norm_eps` must be > 0, got {config.layer_norm_eps}.")
    if config.initializer_range < 0:
        raise ValueError(f"`initializer_range` must be >= 0, got {config.initializer_range}.")
    dropouts = {
        "attention_dropout": config.attention_dropout,
        "hidden_dropout": config.hidden_dropout,
        "classifier_dropout": config.classifier_dropout,
    }
    for name, value in dropouts.items():
        if value is not None and not 0.0 <= value < 1.0:
            raise ValueError(f"`{name}` is a probability in [0, 1), got {value}.")


def check_attention_options(config: CoreformerConfig) -> None:
    """The options of every attention layer (QK-norm, gate, sinks) and the layer types they need."""
    if config.attention_gate not in ATTENTION_GATES:
        raise ValueError(
            f"`attention_gate` must be one of {ATTENTION_GATES} (None: no gate; 'elementwise': one gate per channel, "
            f"as Qwen3-Next; 'headwise': one per head), got {config.attention_gate!r}."
        )
    if not config.attention_sinks:
        return
    # A sink joins the softmax the backend computes over the keys; a type whose kernel computes its own scores on
    # every call (`LayerType.dense_fallback` unset) has no such softmax to join.
    used = {name for field in config.stack_layer_types() for name in getattr(config, field)}
    own_scores = sorted(name for name in used if LAYER_TYPES[name].kernel and not LAYER_TYPES[name].dense_fallback)
    if own_scores:
        softmax_types = [name for name, entry in LAYER_TYPES.items() if not entry.kernel or entry.dense_fallback]
        raise ValueError(
            f"`attention_sinks` adds a learned logit to the softmax over the keys, but {own_scores} layers compute "
            f"their own scores in a kernel or combine several maps: use {softmax_types} layers, or set "
            f"attention_sinks=False."
        )


def check_token_ids(config: CoreformerConfig) -> None:
    """Special token ids inside the vocabulary."""
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        ids = getattr(config, name, None)
        for token_id in ids if isinstance(ids, list) else [ids]:
            if token_id is not None and not 0 <= token_id < config.vocab_size:
                raise ValueError(
                    f"`{name}` ({token_id}) must be a token id in [0, vocab_size={config.vocab_size}): "
                    f"set it to an id of your tokenizer or grow `vocab_size`."
                )
