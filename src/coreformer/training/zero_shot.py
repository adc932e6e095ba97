"""Zero-shot evaluation of a pretrained folder (`coreformer evaluate FOLDER`): what it learned, without fine-tuning.

    evaluate_folder(folder, ...) -> dict      the report: held-out loss and perplexity, minimal-pair accuracy
    held_out_loss(model, tokenizer, family, texts, ...)    the family's own objective at fixed settings
    build_pairs(texts, tokenizer, count, seed) -> [Pair]   held-out lines against corrupted copies
    line_scores(model, tokenizer, family, lines) -> (N,)   log-likelihood (decoder, seq2seq) or pseudo-log-likelihood
                                                           (encoder) of each line
    masked_token_log_probs(model, tokenizer, texts, contexts)   an encoder's pseudo-log-likelihood per token, each
                                                           text alone or after its context
    pair_accuracy(pairs, original, corrupted) -> dict      ties count as wrong
    load_language_model(folder) / held_out_texts(folder, data)   what is scored, on which text
    render_report(report) / zero_shot_line(report)         the command's table; one sentence for a run and its card
    run_zero_shot(folder, args, held_out, device)          what a pretraining run's final report adds

`coreformer evaluate` parses its settings in coreformer_settings.evaluation and runs `evaluate_folder` through
coreformer.commands.runs.evaluate.

Held-out loss is the family's pretraining objective with its settings fixed, so runs trained with other settings
compare: masked LM at 15% masking (80/10/10), causal LM on packed blocks, BART denoising at 30% infilling; every
random choice follows `seed`. Encoders also get a pseudo-perplexity (Salazar et al. 2020): each token of each
original line masked in turn, the honest likelihood of an encoder (its MLM loss depends on the masking rate).

A minimal pair (as in BLiMP, Warstadt et al. 2020) is a held-out line and the same line with one corruption:

    swap        two adjacent tokens exchanged               return a.b   ->  return .ab
    keyword     a Python keyword replaced by another        if x:        ->  while x:
    identifier  a name replaced by another from the text    open(path)   ->  open(handle)

Only corruptions that keep the line's token count are kept, so that a model scoring every token alike (an untrained
one) sits at chance rather than preferring the shorter line. The model is right when it scores the original higher;
a tie is wrong.
"""

import collections
import dataclasses
import json
import keyword
import math
import random
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from coreformer_settings.data_sources import local_builder
from coreformer_settings.evaluation import DEFAULT_BATCH_SIZE, DEFAULT_BATCHES, DEFAULT_PAIRS
from coreformer_settings.evaluation import HELD_OUT_DOCUMENTS as MAX_DOCUMENTS
from coreformer_settings.objectives import OBJECTIVE_REGISTRY, objective_settings
from coreformer_settings.tokenizing import ShardsError

from .arguments import RUN_CONFIG
from .checkpoints import CHECKPOINTS_DIR, find_latest_checkpoint, read_trainer_state
from .data import load_embedded_corpus, load_text_dataset, pad_sequences
from .families import TRAINING_FACTS as FAMILY_FACTS
from .families import family_of, head_class, longest_input
from .shards import ShardedTokens
from .streaming import StreamedText

EVAL_MLM_PROBABILITY = 0.15  # BERT's rate, whatever the run trained with
EVAL_MASK_RATIO, EVAL_POISSON_LAMBDA = 0.3, 3.0  # BART's text infilling
LINE_TOKENS = (4, 40)  # lines of this many tokens (without special tokens) make pairs
REPLACEMENTS_TRIED = 24  # replacement words tried per line for one with the original's token count
ENCODER_ROWS = 128  # masked copies per forward of the pseudo-log-likelihood
HELD_OUT_OBJECTIVES = {  # each family's default objective -> what the report calls its held-out loss
    "masked-lm": f"masked LM at {EVAL_MLM_PROBABILITY:.0%} masking",
    "causal-lm": "causal LM",
    "denoising": f"denoising at {EVAL_MASK_RATIO:.0%} infilling",
}
LEXEME = re.compile(r"[A-Za-z_]\w*|\d+|[^\w\s]")  # what a corruption moves or replaces: names, numbers, marks
_KEYWORDS = tuple(keyword.kwlist)


class EvaluationError(ValueError):
    """A folder or text the evaluation cannot score; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------------------------------
# Minimal pairs
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    original: str
    corrupted: str
    kind: str


def _swaps(line: str, lexemes: list[re.Match], rng: random.Random, names: list[str]) -> list[str]:
    spots = [i for i in range(len(lexemes) - 1) if lexemes[i].group() != lexemes[i + 1].group()]
    swapped = []
    for i in rng.sample(spots, len(spots)):
        a, b = lexemes[i], lexemes[i + 1]
        swapped.append(line[: a.start()] + b.group() + line[a.end() : b.start()] + a.group() + line[b.end() :])
    return swapped


def _replacements(line: str, lexemes: list[re.Match], rng: random.Random, choices: list[str], keywords: bool):
    spots = [m for m in lexemes if (m.group() in _KEYWORDS) == keywords and (keywords or m.group()[0].isalpha())]
    if not spots:
        return []
    spot = rng.choice(spots)
    others = [choice for choice in rng.sample(choices, min(len(choices), REPLACEMENTS_TRIED)) if choice != spot.group()]
    return [line[: spot.start()] + other + line[spot.end() :] for other in others]


# kind -> corruptions(line, its lexemes, rng, the names of the held-out lines) -> candidate lines, in the order tried
CORRUPTIONS: dict[str, Callable[..., list[str]]] = {
    "swap": _swaps,
    "keyword": lambda line, lexemes, rng, names: _replacements(line, lexemes, rng, list(_KEYWORDS), keywords=True),
    "identifier": lambda line, lexemes, rng, names: _replacements(line, lexemes, rng, names, keywords=False),
}


def candidate_lines(texts: list[str]) -> list[str]:
    """The distinct stripped lines of `texts` with at least three lexemes, in text order."""
    seen, lines = set(), []
    for text in texts:
        for raw in text.splitlines():
            line = raw.strip()
            if line not in seen and len(LEXEME.findall(line)) >= 3:
                seen.add(line)
                lines.append(line)
    return lines


def _token_count(tokenizer: PreTrainedTokenizerBase, line: str) -> int:
    return len(tokenizer(line, add_special_tokens=False, verbose=False)["input_ids"])


def _corrupt(line: str, turn: int, rng: random.Random, names: list[str], tokenizer) -> Pair | None:
    """The first corruption of `line` that keeps its token count, kinds tried from the one whose turn it is."""
    kinds, lexemes, length = list(CORRUPTIONS), list(LEXEME.finditer(line)), _token_count(tokenizer, line)
    for offset in range(len(kinds)):
        kind = kinds[(turn + offset) % len(kinds)]
        for corrupted in CORRUPTIONS[kind](line, lexemes, rng, names):
            if corrupted != line and _token_count(tokenizer, corrupted) == length:
                return Pair(line, corrupted, kind)
    return None


def build_pairs(texts: list[str], tokenizer: PreTrainedTokenizerBase, count: int, seed: int) -> list[Pair]:
    """Up to `count` pairs from a seeded sample of the held-out lines of LINE_TOKENS tokens; the kinds take turns
    (the next kind when one does not apply or changes the token count)."""
    lines = candidate_lines(texts)
    names = sorted({m for line in lines for m in LEXEME.findall(line) if m[0].isalpha() and m not in _KEYWORDS})
    rng = random.Random(seed)
    rng.shuffle(lines)
    pairs: list[Pair] = []
    for start in range(0, len(lines), 256):  # tokenized a chunk at a time: the sample is usually met early
        chunk = lines[start : start + 256]
        lengths = [len(ids) for ids in tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]]
        for line, length in zip(chunk, lengths):
            if len(pairs) == count:
                return pairs
            if LINE_TOKENS[0] <= length <= LINE_TOKENS[1] and (
                pair := _corrupt(line, len(pairs), rng, names, tokenizer)
            ):
                pairs.append(pair)
    return pairs


def pair_accuracy(pairs: list[Pair], original: torch.Tensor, corrupted: torch.Tensor) -> dict[str, Any]:
    """Share of pairs whose original scores strictly higher (a tie is wrong), overall and per kind."""
    right = (original > corrupted).tolist()
    by_kind = {}
    for kind in CORRUPTIONS:
        marks = [mark for mark, pair in zip(right, pairs) if pair.kind == kind]
        if marks:
            by_kind[kind] = {"accuracy": sum(marks) / len(marks), "pairs": len(marks)}
    return {
        "accuracy": sum(right) / len(right) if right else None,
        "pairs": len(pairs),
        "ties": int((original == corrupted).sum()),
        "by_kind": by_kind,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Scores of lines
# ---------------------------------------------------------------------------------------------------------------------


def _token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(..., V) logits and (...) target ids -> (...) log-probabilities of the targets (fp32)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def _causal_scores(model, tokenizer, lines: list[str], batch_size: int) -> torch.Tensor:
    """Sum over each line's tokens of log p(token | the tokens before it), after the document separator </s>."""
    scores = []
    for start in range(0, len(lines), batch_size):
        ids = [
            torch.tensor(
                [tokenizer.eos_token_id] + tokenizer(line, add_special_tokens=False, verbose=False)["input_ids"]
            )
            for line in lines[start : start + batch_size]
        ]
        input_ids = pad_sequences(ids, tokenizer.pad_token_id).to(model.device)  # (B, T)
        mask = pad_sequences([torch.ones_like(row) for row in ids], 0).to(model.device)  # (B, T)
        logits = model(input_ids=input_ids, attention_mask=mask).logits  # (B, T, V)
        log_probs = _token_log_probs(logits[:, :-1], input_ids[:, 1:])  # (B, T-1): token t+1 given tokens <= t
        scores.append((log_probs * mask[:, 1:]).sum(-1).cpu())
    return torch.cat(scores)


@torch.no_grad()
def _seq2seq_scores(model, tokenizer, lines: list[str], batch_size: int) -> torch.Tensor:
    """log p(line | <s><mask></s>): the decoder writing the whole line from one infilled span (BART's noise with
    everything hidden), so the score is the model's, not a copy of its input."""
    source = tokenizer(tokenizer.mask_token, return_tensors="pt")["input_ids"].to(model.device)  # (1, 3)
    scores = []
    for start in range(0, len(lines), batch_size):
        ids = [torch.tensor(tokenizer(line, verbose=False)["input_ids"]) for line in lines[start : start + batch_size]]
        labels = pad_sequences(ids, -100).to(model.device)  # (B, T)
        inputs = source.expand(len(ids), -1)
        logits = model(input_ids=inputs, attention_mask=torch.ones_like(inputs), labels=labels).logits  # (B, T, V)
        scores.append((_token_log_probs(logits, labels) * (labels != -100)).sum(-1).cpu())
    return torch.cat(scores)


@dataclass(frozen=True)
class MaskedCopy:
    """One token of a text masked: the input a masked-LM head predicts that token from."""

    owner: int  # the text's index
    input_ids: torch.Tensor  # (T,): the text's tokens (after its context, if any), one of them the mask token
    position: int  # where the mask is
    target: int  # the token it hides


def masked_copies(
    tokenizer, texts: list[str], contexts: list[str] | None = None, max_length: int | None = None
) -> list[list[MaskedCopy]]:
    """For each text, one MaskedCopy per token of the text, in the text's order. With `contexts`, each text is the
    second segment after its context ([CLS] context [SEP] text [SEP], as pairs are fine-tuned) and only the text's
    tokens are masked. `max_length` truncates each input (the longer segment first; the tokenizer's sequence ids say
    which tokens are the text's)."""
    copies = []
    for index, text in enumerate(texts):
        pair = (contexts[index], text) if contexts is not None else (text,)
        encoded = tokenizer(*pair, truncation=max_length is not None, max_length=max_length)
        ids = torch.tensor(encoded["input_ids"])
        scored = 1 if contexts is not None else 0  # the sequence id of the text's tokens
        copies.append([])
        for position, sequence in enumerate(encoded.sequence_ids()):
            if sequence == scored:
                masked = ids.clone()
                masked[position] = tokenizer.mask_token_id
                copies[-1].append(MaskedCopy(index, masked, position, int(ids[position])))
    return copies


@torch.no_grad()
def masked_token_log_probs(
    model, tokenizer, texts: list[str], contexts: list[str] | None = None, max_length: int | None = None
) -> list[torch.Tensor]:
    """Pseudo-log-likelihood's terms (Salazar et al. 2020): for each text, a (tokens,) float64 tensor of log p(token |
    everything else, that token masked), one token masked at a time (masked_copies: with `contexts`, only the text's
    tokens after its context are masked; against the text's terms alone, they say how much the context helps predict
    it; `max_length` truncates). Only input ids and the attention mask are passed: masked-LM pretraining never set a
    segment type. The masked copies of all texts are scored in `batched_copies`' chunks."""
    copies = [copy for per_text in masked_copies(tokenizer, texts, contexts, max_length) for copy in per_text]
    terms: list[list[float]] = [[] for _ in texts]
    for indices, input_ids, mask in batched_copies(copies, tokenizer.pad_token_id):
        chunk = [copies[index] for index in indices]
        logits = model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device)).logits  # (R, T, V)
        at_mask = logits[torch.arange(len(chunk)), torch.tensor([c.position for c in chunk])]  # (R, V)
        log_probs = _token_log_probs(at_mask, torch.tensor([c.target for c in chunk], device=model.device))  # (R,)
        for copy, value in zip(chunk, log_probs.tolist(), strict=True):
            terms[copy.owner].append(value)
    return [torch.tensor(values, dtype=torch.float64) for values in terms]


def batched_copies(
    copies: list[MaskedCopy], pad_token_id: int
) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """`copies` ENCODER_ROWS at a time, like lengths together (little padding): each chunk's indices into `copies`,
    its (R, T) input ids and its (R, T) attention mask. Every copy of one text has the text's length, so a text's
    copies keep their order."""
    order = sorted(range(len(copies)), key=lambda index: len(copies[index].input_ids))
    for start in range(0, len(order), ENCODER_ROWS):
        chunk = order[start : start + ENCODER_ROWS]
        input_ids = pad_sequences([copies[index].input_ids for index in chunk], pad_token_id)  # (R, T)
        yield chunk, input_ids, pad_sequences([torch.ones_like(copies[index].input_ids) for index in chunk], 0)


def _pseudo_scores(model, tokenizer, lines: list[str], batch_size: int) -> torch.Tensor:
    """Pseudo-log-likelihood: the sum of each line's masked_token_log_probs."""
    return torch.stack([terms.sum() for terms in masked_token_log_probs(model, tokenizer, lines)])


# family -> (how a line is scored, the name the report gives it)
LINE_SCORES: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    "encoder": (_pseudo_scores, "pseudo-log-likelihood"),
    "decoder": (_causal_scores, "log-likelihood"),
    "seq2seq": (_seq2seq_scores, "log-likelihood of the line decoded from <mask>"),
}


def line_scores(model, tokenizer, family: str, lines: list[str], batch_size: int = DEFAULT_BATCH_SIZE) -> torch.Tensor:
    """(N,) float64 scores of `lines` (higher: likelier), the family's way (LINE_SCORES). Each distinct line is
    scored once, so equal lines get equal scores whatever batch they would have fallen in (a tie stays a tie)."""
    distinct = list(dict.fromkeys(lines))
    scores = LINE_SCORES[family][0](model, tokenizer, distinct, batch_size).double()
    index = {line: position for position, line in enumerate(distinct)}
    return scores[torch.tensor([index[line] for line in lines], dtype=torch.long)]


# ---------------------------------------------------------------------------------------------------------------------
# Held-out loss
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def held_out_loss(
    model, tokenizer, family: str, texts: list[str], *, block_size: int, batches: int, batch_size: int, seed: int
) -> dict[str, Any]:
    """The family's pretraining objective (the default one) at its fixed evaluation settings over at most `batches`
    batches of the held-out text: {"objective", "loss", "perplexity", "tokens"}, token-weighted as in training."""
    from .objectives import OBJECTIVES

    objective = OBJECTIVES[FAMILY_FACTS[family].default_objective]
    fixed = {
        "mlm_probability": EVAL_MLM_PROBABILITY,
        "mask_ratio": EVAL_MASK_RATIO,
        "poisson_lambda": EVAL_POISSON_LAMBDA,
    }
    owned_names = {field.name for field in dataclasses.fields(OBJECTIVE_REGISTRY[objective.name].settings)}
    owned = {name: value for name, value in fixed.items() if name in owned_names}
    settings = SimpleNamespace(
        family=family, block_size=block_size, seed=seed, objective_settings=objective_settings(objective.name, owned)
    )
    examples = objective.examples(datasets.Dataset.from_dict({"text": texts}), tokenizer, settings)
    if len(examples) == 0:
        raise EvaluationError(f"The held-out text gives no example of {block_size} tokens; pass more text (--data).")
    examples = examples.shuffle(seed=seed).select(range(min(len(examples), batches * batch_size)))
    collator = objective.collator(tokenizer, settings)
    batch_list = [
        collator([examples[i] for i in range(s, min(s + batch_size, len(examples)))])
        for s in range(0, len(examples), batch_size)
    ]
    labels = sum(objective.label_count(batch) for batch in batch_list)
    inputs = sum(
        int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        for batch in batch_list
    )
    on_device = ({key: value.to(model.device) for key, value in batch.items()} for batch in batch_list)
    loss = sum(float(objective.loss(model, batch, labels, inputs)) for batch in on_device)
    described = HELD_OUT_OBJECTIVES[objective.name]
    return {"objective": described, "loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": labels}


def unigram_entropy(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> float:
    """Entropy (nats per token) of the texts' own token frequencies: the best held-out loss a model that knows only
    which tokens are common can reach (a masked LM's positions are drawn uniformly, so its loss compares directly).
    A loss well below it means the model uses context."""
    counts = collections.Counter()
    for start in range(0, len(texts), 64):
        for ids in tokenizer(texts[start : start + 64], add_special_tokens=False, verbose=False)["input_ids"]:
            counts.update(ids)
    frequencies = torch.tensor(list(counts.values()), dtype=torch.float64)
    probabilities = frequencies / frequencies.sum()
    return float(-(probabilities * probabilities.log()).sum())


# ---------------------------------------------------------------------------------------------------------------------
# The folder, its held-out text, the report
# ---------------------------------------------------------------------------------------------------------------------


def unfinished_run_message(folder: Path) -> str | None:
    """What to do with a pretraining run folder (or one of its checkpoints) that holds no final model yet; None for
    any other folder."""
    run = folder.parent.parent if folder.parent.name == CHECKPOINTS_DIR else folder
    if not (run / RUN_CONFIG).is_file():
        return None
    checkpoint = find_latest_checkpoint(run)
    if checkpoint is None:
        return (
            f"{run} is a pretraining run that stopped before its first checkpoint, so it holds no model: run it "
            f"again (its pretrain command with --overwrite) and let it finish."
        )
    step = read_trainer_state(checkpoint, error=EvaluationError)["step"]
    return (
        f"{folder} is {'a checkpoint of ' if run != folder else ''}a pretraining run that has not finished, so it "
        f"holds no final model yet: finish it with its pretrain command and --resume-from-checkpoint latest, or add "
        f"--max-steps {step} to write its model as it is at its latest checkpoint (step {step}) without training; "
        f"then evaluate {run}."
    )


def load_language_model(folder: str | Path) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, str]:
    """(the folder's language model in eval mode, its tokenizer, its family). A folder without a language-model
    head (an ELECTRA discriminator's encoder, a fine-tuned classifier) is refused: a head made up at load time would
    score noise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EvaluationError(f"no such folder: {folder}; pass a pretrained folder (a run's --output-dir).")
    if not (folder / "config.json").is_file():
        elsewhere = f"{folder} holds no config.json; pass a pretrained folder (a run's --output-dir)."
        raise EvaluationError(unfinished_run_message(folder) or elsewhere)
    config = AutoConfig.from_pretrained(folder)
    family = family_of(config)
    if family is None:
        raise EvaluationError(f"{folder} holds a {config.model_type!r} model, not a coreformer one.")
    head = head_class(family, FAMILY_FACTS[family].family.language_model_auto_class)
    saved = list(getattr(config, "architectures", None) or [])
    if head.__name__ not in saved:
        raise EvaluationError(
            f"{folder} holds {', '.join(saved) or 'no recorded architecture'}, not the {family} language model "
            f"({head.__name__}) that zero-shot scores need; evaluate a masked-LM, causal-LM or denoising run's folder."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise EvaluationError(f"{folder} holds no tokenizer ({error}); save the tokenizer beside the model.") from None
    return head.from_pretrained(folder).eval(), tokenizer, family


def held_out_texts(folder: str | Path, data: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """(the texts to score, what they are): `data` files whole; else the held-out split of the run's training text
    (the folder's run_config.json); else the embedded corpus' held-out split."""
    if data:
        texts = []
        for source in data:
            try:
                whole_files = {"sample_by": "document"} if local_builder(source)[0] == "text" else {}  # not by line
                texts += load_text_dataset(source, validation_fraction=0.0, **whole_files)["train"]["text"]
            except (ValueError, FileNotFoundError) as error:
                raise EvaluationError(f"Cannot read --data {source!r}: {error}") from None
        return texts[:MAX_DOCUMENTS], f"{', '.join(data)} ({len(texts)} documents)"
    run_config = Path(folder) / RUN_CONFIG
    settings = json.loads(run_config.read_text()) if run_config.is_file() else None
    if settings is None:
        texts = load_embedded_corpus()["validation"]["text"]
        return texts[:MAX_DOCUMENTS], "the embedded corpus' held-out split (the folder records no training text)"
    if settings.get("data_dir"):
        return _held_out_shards(folder, settings["data_dir"])
    if settings.get("streaming"):  # read as the run read it: streamed, up to the documents it held out
        texts = StreamedText(SimpleNamespace(**settings), rank=0, world=1).held_out()
        return texts[:MAX_DOCUMENTS], f"the held-out split of the run's training text ({settings['dataset']}, streamed)"
    try:
        split = load_text_dataset(
            settings.get("dataset"),
            settings.get("text_column", "text"),
            seed=settings.get("seed", 0),
            validation_fraction=settings.get("validation_fraction", 0.05),
            max_documents=settings.get("max_documents"),
            config_name=settings.get("dataset_config"),
        )["validation"]
    except Exception as error:  # a moved file, a Hub dataset offline, ...: the run's text is gone, not the folder
        raise EvaluationError(
            f"Cannot load the run's training text {settings.get('dataset')!r} ({type(error).__name__}: {error}); "
            f"pass --data FILES."
        ) from None
    name = settings.get("dataset") or "the embedded corpus"
    return split["text"][:MAX_DOCUMENTS], f"the held-out split of the run's training text ({name})"


def _held_out_shards(folder: str | Path, data_dir: str) -> tuple[list[str], str]:
    """The held-out documents of the shards a run trained on (--data-dir), decoded by the folder's tokenizer."""
    try:
        validation = ShardedTokens(data_dir, "validation")
    except ShardsError as error:  # moved, deleted or rewritten since the run
        raise EvaluationError(f"Cannot read the run's shards {data_dir!r} ({error}); pass --data FILES.") from None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [tokenizer.decode(validation[index]) for index in range(min(MAX_DOCUMENTS, len(validation)))]
    return texts, f"the held-out split of the run's shards ({data_dir}), decoded"


def evaluate_folder(
    folder: str | Path,
    *,
    data: tuple[str, ...] = (),
    held_out: tuple[list[str], str] | None = None,
    block_size: int | None = None,
    pairs: int = DEFAULT_PAIRS,
    batches: int = DEFAULT_BATCHES,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """The zero-shot report of `folder` (module docstring); `held_out` (texts, what they are) and `block_size` are
    the run's own, when the run is still going and has them in memory."""
    model, tokenizer, family = load_language_model(folder)
    model.to(device)
    texts, described = held_out if held_out is not None else held_out_texts(folder, data)
    run_block = block_size or _recorded_block_size(folder)
    block_size = min(run_block or 128, longest_input(model.config) or sys.maxsize)
    loss = held_out_loss(
        model, tokenizer, family, texts, block_size=block_size, batches=batches, batch_size=batch_size, seed=seed
    )
    loss["unigram_entropy"] = unigram_entropy(tokenizer, texts)
    chosen = build_pairs(texts, tokenizer, pairs, seed)
    if not chosen:
        raise EvaluationError("The held-out text holds no line that makes a minimal pair; pass more text (--data).")
    scores = line_scores(model, tokenizer, family, [p.original for p in chosen] + [p.corrupted for p in chosen])
    original, corrupted = scores[: len(chosen)], scores[len(chosen) :]
    report = {
        "folder": str(folder),
        "family": family,
        "parameters": sum(p.numel() for p in model.parameters()),
        "data": described,
        "held_out": loss,
        "minimal_pairs": {"score": LINE_SCORES[family][1], **pair_accuracy(chosen, original, corrupted)},
        "seed": seed,
    }
    if family == "encoder":  # the originals' pseudo-log-likelihood, per token
        tokens = sum(len(tokenizer(p.original, add_special_tokens=False, verbose=False)["input_ids"]) for p in chosen)
        report["pseudo_perplexity"] = math.exp(min(-float(original.sum()) / tokens, 700.0))
    return report


def _recorded_block_size(folder: str | Path) -> int | None:
    run_config = Path(folder) / RUN_CONFIG
    return json.loads(run_config.read_text()).get("block_size") if run_config.is_file() else None


def render_report(report: dict[str, Any]) -> str:
    """The report as the command prints it."""
    loss, pairs = report["held_out"], report["minimal_pairs"]
    kinds = ", ".join(f"{kind} {v['accuracy']:.3f} ({v['pairs']})" for kind, v in pairs["by_kind"].items())
    lines = [
        f"coreformer evaluate {report['folder']} ({report['family']}, {report['parameters']:,} parameters)",
        f"  held-out text      {report['data']}",
        f"  held-out loss      {loss['loss']:.4f} (perplexity {loss['perplexity']:.2f}), {loss['objective']}, "
        f"{loss['tokens']:,} tokens",
        f"  unigram entropy    {loss['unigram_entropy']:.4f} (token frequencies alone; lower loss means context used)",
    ]
    if "pseudo_perplexity" in report:
        lines.append(f"  pseudo-perplexity  {report['pseudo_perplexity']:.2f} (the pairs' original lines)")
    lines += [
        f"  minimal pairs      {pairs['accuracy']:.3f} of {pairs['pairs']} ({pairs['score']}; "
        f"{pairs['ties']} ties, counted wrong; chance 0.5)",
        f"    by kind          {kinds}",
    ]
    return "\n".join(lines)


def run_zero_shot(
    folder: str | Path, args: Any, held_out: list[str], device: str | torch.device = "cpu"
) -> dict[str, Any] | None:
    """What a pretraining run's final report and card add (`args.zero_shot_pairs` pairs, 0: nothing): the report of
    its saved folder on its held-out text (`held_out`, the split the run already loaded), or {"skipped": why} where
    the folder has no language model to score (ELECTRA keeps the discriminator's encoder)."""
    if not args.zero_shot_pairs:
        return None
    name = f"the shards in {args.data_dir}" if args.data_dir else args.dataset or "the embedded corpus"
    try:
        report = evaluate_folder(
            folder,
            held_out=(held_out[:MAX_DOCUMENTS], f"the held-out split of the run's training text ({name})"),
            block_size=args.block_size,
            pairs=args.zero_shot_pairs,
            batches=args.eval_batches,
            batch_size=args.batch_size,
            seed=args.seed,
            device=device,
        )
    except Exception as error:  # the trained model is saved whatever happens here: the report says what failed
        return {"skipped": str(error) if isinstance(error, EvaluationError) else f"{type(error).__name__}: {error}"}
    report.pop("folder")  # the run's staging folder, renamed by now
    return report


def zero_shot_line(report: dict[str, Any]) -> str:
    """One sentence for the card and the run's last lines."""
    if "skipped" in report:
        return f"zero-shot evaluation skipped: {report['skipped']}"
    loss, pairs = report["held_out"], report["minimal_pairs"]
    extra = f", pseudo-perplexity {report['pseudo_perplexity']:.2f}" if "pseudo_perplexity" in report else ""
    return (
        f"zero-shot (coreformer evaluate, fixed settings comparable across runs): held-out {loss['objective']} loss "
        f"{loss['loss']:.4f} (perplexity "
        f"{loss['perplexity']:.2f}){extra}; minimal-pair accuracy {pairs['accuracy']:.3f} over {pairs['pairs']} pairs "
        f"({pairs['score']}, chance 0.5)"
    )
