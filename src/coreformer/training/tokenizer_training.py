"""Train a tokenizer for one coreformer family from raw text, saved so `AutoTokenizer.from_pretrained` loads it offline.

    family    model              special tokens (ids 0..)                     post-processor
    encoder   WordPiece          [PAD] [UNK] [CLS] [SEP] [MASK]               [CLS] A [SEP] / [CLS] A [SEP] B [SEP]
    decoder   byte-level BPE     <pad> <s> </s> <unk>                         none (packing inserts </s> itself)
    seq2seq   byte-level BPE     <s> <pad> </s> <unk> <mask>                  <s> A </s> / <s> A </s> </s> B </s>

The ids are fixed by the order above (special tokens are the first entries of every trained vocabulary), and they
match the family configs' defaults: encoder pad 0; decoder pad 0, bos 1, eos 2 (GPT-2 keeps no bos in practice, but
`generate` without a prompt starts from it); seq2seq bos 0, pad 1, eos 2 and `decoder_start_token_id` = eos, as BART
has it. BART keeps `<mask>` as its last id; here it is id 4 so that the ids never depend on the vocabulary size.

The decoder tokenizer adds no special tokens on encode: `pack_into_blocks` (objectives/causal_lm.py) separates documents
with `</s>` when it concatenates them, so a `<s>`/`</s>` added per document would only waste block space.

    train_tokenizer(family, texts, vocab_size, output_dir=None) -> PreTrainedTokenizerFast
    tokenizer_name(family) -> "WordPiece" | "byte-level BPE"
    token_config_kwargs(tokenizer, family) -> {"vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", ...}

The families' tokens, tokenizer kinds and templates come from `families.TRAINING_FACTS`. Nothing here imports the
modeling files: a tokenizer is built before any model exists.
"""

from collections.abc import Callable, Iterable, Iterator, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from coreformer_settings.registries import FAMILY_NAMES

from .families import TRAINING_FACTS, TrainingFacts

# Role -> token, in id order: the trainers put `special_tokens` first, so the position here is the id.
SPECIAL_TOKENS: dict[str, dict[str, str]] = {name: facts.special_tokens for name, facts in TRAINING_FACTS.items()}


def _facts(family: str) -> TrainingFacts:
    if family not in TRAINING_FACTS:
        raise ValueError(f"Unknown family {family!r}: expected one of {', '.join(FAMILY_NAMES)}.")
    return TRAINING_FACTS[family]


def _wordpiece(facts: TrainingFacts, texts: Callable[[], Iterator[str]], vocab_size: int) -> Tokenizer:
    """BERT-cased: keep case and accents (code is case-sensitive), split on whitespace and punctuation.

    Trained twice so that every process keeps the same pieces under the same ids. tokenizers' WordPieceTrainer (its BPE
    trainer with a `##` prefix) numbers the `##c` symbols in the order it meets words in a hash map seeded per process
    (bpe/trainer.rs, `tokenize_words`) and breaks ties between equally frequent merges by the lower ids, so the pieces
    kept differ too, not only their ids. A first pass with no merges lists the `##c` symbols; the second takes them,
    sorted, as extra special tokens, which the trainer numbers first in the order given. The result is rebuilt around
    the trained vocabulary so that only the family's special tokens stay special. The price: the texts are read twice.
    """
    continuations = sorted(token for token in _train_wordpiece(facts, texts, 0).get_vocab() if token.startswith("##"))
    trained = _train_wordpiece(facts, texts, vocab_size, continuations)
    tokenizer = _untrained_wordpiece(facts, trained.get_vocab(with_added_tokens=False))
    tokenizer.add_special_tokens(_specials(facts))
    return tokenizer


def _train_wordpiece(
    facts: TrainingFacts, texts: Callable[[], Iterator[str]], vocab_size: int, continuations: Sequence[str] = ()
) -> Tokenizer:
    """One WordPieceTrainer run; `vocab_size` 0 stops before the first merge (special tokens, alphabet, `##c`)."""
    tokenizer = _untrained_wordpiece(facts)
    extra = [AddedToken(token, normalized=False, special=True) for token in continuations]
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=_specials(facts) + extra,
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    return tokenizer


def _untrained_wordpiece(facts: TrainingFacts, vocab: dict[str, int] | None = None) -> Tokenizer:
    tokenizer = Tokenizer(
        models.WordPiece(vocab, unk_token=facts.special_tokens["unk_token"], max_input_chars_per_word=100)
    )
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def _byte_level_bpe(facts: TrainingFacts, texts: Callable[[], Iterator[str]], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 / BART): every byte is in the alphabet, so any text encodes without <unk> and decodes
    back exactly. No prefix space: a document's first word is encoded as it is written. Reproducible as it is: every
    symbol comes from the alphabet, which the trainer numbers in sorted order."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_specials(facts),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,  # a pair seen once is noise, not a merge
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    return tokenizer


# tokenizer kind -> ((facts, texts: a function returning a fresh pass over them, vocab_size) -> trained backend,
# symbols every vocabulary holds besides the special tokens, name)
_BACKENDS = {
    "wordpiece": (_wordpiece, 0, "WordPiece"),
    "byte-level-bpe": (_byte_level_bpe, len(pre_tokenizers.ByteLevel.alphabet()), "byte-level BPE"),
}


def tokenizer_name(family: str) -> str:
    """What the family's trained tokenizer is called ("WordPiece", "byte-level BPE")."""
    return _BACKENDS[_facts(family).tokenizer_kind][2]


def _min_vocab_size(facts: TrainingFacts) -> int:
    """Special tokens, plus the 256 byte symbols every byte-level vocabulary starts with."""
    return len(facts.special_tokens) + _BACKENDS[facts.tokenizer_kind][1]


def _post_processor(facts: TrainingFacts, tokenizer: Tokenizer) -> processors.PostProcessor | None:
    """Adds the family's special tokens on encode (and keeps byte-level offsets right for the BPE families)."""
    byte_level = [processors.ByteLevel(trim_offsets=False)] if facts.tokenizer_kind == "byte-level-bpe" else []
    if facts.template is None:
        return byte_level[0] if byte_level else None
    single, pair = facts.template
    used = {piece.split(":")[0] for piece in f"{single} {pair}".split() if not piece.startswith("$")}
    template = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(token, tokenizer.token_to_id(token)) for token in sorted(used)]
    )
    return processors.Sequence([*byte_level, template]) if byte_level else template


def train_tokenizer(
    family: str,
    texts: Iterable[str],
    vocab_size: int,
    output_dir: str | None = None,
    *,
    model_max_length: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train the tokenizer of `family` on `texts` and wrap it as a transformers fast tokenizer.

    Args:
        family: "encoder" (WordPiece) | "decoder" (byte-level BPE) | "seq2seq" (byte-level BPE, BART layout).
        texts: Training documents. WordPiece reads them twice: a collection or any re-iterable (`data.iter_texts`)
            is streamed each time; a one-shot iterator (a generator) is kept in a list first.
        vocab_size: Target vocabulary size, special tokens included. The result can be smaller when the text holds
            fewer distinct pieces; read the final size with `len(tokenizer)`.
        output_dir: Where to `save_pretrained` (tokenizer.json + tokenizer_config.json); `None` saves nothing.
        model_max_length: Written into tokenizer_config.json (the model's `max_position_embeddings`) so that
            `truncation=True` knows the limit.

    Returns:
        The tokenizer; its special-token ids follow `SPECIAL_TOKENS` (see `token_config_kwargs`).
    """
    facts = _facts(family)
    floor = _min_vocab_size(facts)
    if vocab_size <= floor:
        raise ValueError(
            f"`vocab_size` must exceed {floor} for the {family} tokenizer (its special tokens"
            f"{' and 256 byte symbols' if _BACKENDS[facts.tokenizer_kind][1] else ''}), got {vocab_size}."
        )
    if isinstance(texts, Iterator):  # one pass only, and WordPiece needs two
        texts = list(texts)
    backend = _BACKENDS[facts.tokenizer_kind][0](facts, lambda: _non_empty(texts), vocab_size)
    for position, token in enumerate(facts.special_tokens.values()):
        if backend.token_to_id(token) != position:  # guards the id table in the module docstring
            raise RuntimeError(f"{token} got id {backend.token_to_id(token)}, expected {position}.")
    post_processor = _post_processor(facts, backend)
    if post_processor is not None:
        backend.post_processor = post_processor

    special_tokens = {role: _added_token(facts, role) for role in facts.special_tokens}
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_input_names=list(facts.model_input_names),
        clean_up_tokenization_spaces=False,  # keep decode lossless for the byte-level families
        **special_tokens,
        **extra,
    )
    if output_dir is not None:
        tokenizer.save_pretrained(output_dir)
    return tokenizer


def _specials(facts: TrainingFacts) -> list[AddedToken]:
    return [_added_token(facts, role) for role in facts.special_tokens]


def _added_token(facts: TrainingFacts, role: str) -> AddedToken:
    # BART's <mask> swallows the space before it, so "a <mask> b" encodes like "a<mask> b" ("Ġb" stays one piece).
    lstrip = role == "mask_token" and facts.tokenizer_kind == "byte-level-bpe"
    return AddedToken(facts.special_tokens[role], lstrip=lstrip, rstrip=False, normalized=False, special=True)


def _non_empty(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if text:
            yield text


def token_config_kwargs(tokenizer: PreTrainedTokenizerFast, family: str) -> dict[str, int | None]:
    """The config fields a model of `family` needs to agree with `tokenizer`.

    Example:
        >>> config = CoreformerSeq2SeqConfig(**token_config_kwargs(tokenizer, "seq2seq"), hidden_size=256)

    Returns:
        `vocab_size`, `pad_token_id`, `bos_token_id`, `eos_token_id`, plus `decoder_start_token_id` (= eos, as BART)
        for seq2seq. The encoder has no bos/eos (BERT); its [CLS]/[SEP]/[MASK] ids live on the tokenizer.
    """
    facts = _facts(family)
    kwargs: dict[str, int | None] = {"vocab_size": len(tokenizer)}
    for role in ("pad_token", "bos_token", "eos_token"):
        kwargs[f"{role}_id"] = getattr(tokenizer, f"{role}_id") if role in facts.config_token_roles else None
    if facts.decoder_start_token is not None:
        kwargs["decoder_start_token_id"] = getattr(tokenizer, f"{facts.decoder_start_token}_id")
    return kwargs
