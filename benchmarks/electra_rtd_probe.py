"""Why ELECTRA's discriminator answers "original" at this scale: a probe of its first few hundred steps.

Trains the ELECTRA module exactly as `training/pretrain.py --family encoder --objective electra` does (the run's own
`prepare` and `build`: the encoder-tiny preset, its data, masking, optimizer, schedule; gradient clipping at
--max-grad-norm) in a loop of its own, one process, and prints a JSON line every --every steps:

    training step   mlm, rtd                 the generator's MLM loss, the discriminator's RTD loss (token means)
                    generator_accuracy       masks whose original is the generator's likeliest token
                    replaced_share           masks whose sample differs from the original
                    grad_discriminator, grad_generator, grad_shared_tables, grad_projection
                                             gradient norms before clipping: the discriminator's own weights, the
                                             generator's own, the embedding tables both read, the projection P
                    grad_total               their total (clipping at --max-grad-norm scales all by 1/max(1, it))
    held out        heldout_rtd, constant_rtd   the RTD loss on 4 held-out batches, and the best constant answer's
                                             (the binary entropy of the base rate)
                    recall_replaced, accuracy_original   per class, at the logit threshold 0
                    auc                      ROC AUC of the logit, replaced against original (0.5: no signal)
                    logit_mean, logit_std, logit_gap     the logits' mean, spread, and mean(replaced) - mean(original)

--sampler sets what replaces a masked token: `generator` (ELECTRA), or two controls that keep everything else:
`unigram` (drawn from the token frequencies of the training text: what a generator at unigram level samples; token
identity then says nothing about being replaced, only context does) and `uniform` (any token the text uses: rare
tokens give the replacements away by identity alone). --temperature divides the generator's logits.

    python benchmarks/electra_rtd_probe.py --steps 200 --sampler unigram      # 2-8 min under load from other jobs
"""

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from coreformer.training.objectives.electra import electra_loss_terms, embedding_tables
from coreformer.training.pretraining import build, prepare, run_pretraining
from coreformer.training.pretraining.inputs import input_token_count
from coreformer.training.pretraining.run import resolve_arguments

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT_BATCHES = 4
EVAL_SEED = 123


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="steps between printed lines")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, help="default: the preset's (60)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    parser.add_argument("--rtd-weight", type=float, default=50.0)
    parser.add_argument("--max-documents", type=int, default=400, help="training documents of the embedded corpus")
    parser.add_argument("--sampler", choices=("generator", "unigram", "uniform"), default="generator")
    parser.add_argument("--temperature", type=float, default=1.0, help="generator sampling temperature")
    parser.add_argument("--tokenizer", help="a tokenizer folder; default: trained on the documents first")
    parser.add_argument("--output", type=Path, help="also write every line as one JSON list here")
    return parser.parse_args(argv)


def settings(args: argparse.Namespace, work: Path, objective: str, steps: int, tokenizer: str | None):
    overrides = dict(objective=objective, output_dir=str(work / objective), overwrite=True, max_steps=steps)
    overrides.update(save_every=0, eval_every=0, report_to="none", max_documents=args.max_documents, lr=args.lr)
    overrides.update(max_grad_norm=args.max_grad_norm, rtd_weight=args.rtd_weight)
    if tokenizer is not None:
        overrides["tokenizer"] = tokenizer
    if args.warmup_steps is not None:
        overrides["warmup_steps"] = args.warmup_steps
    return resolve_arguments(
        family="encoder", preset="tiny", overrides=overrides, configs_dir=ROOT / "training" / "configs"
    )


def unigram_frequencies(run, special_ids: list[int]) -> torch.Tensor:
    """(V,) the token frequencies of the first 2,000 training examples, special tokens at 0."""
    counts = torch.zeros(run.config.vocab_size)
    for example in run.train_examples.select(range(min(2000, len(run.train_examples)))):
        counts += torch.bincount(torch.tensor(example["input_ids"]), minlength=run.config.vocab_size).float()
    counts[special_ids] = 0
    return counts / counts.sum()


def replacement_sampler(args: argparse.Namespace, unigram: torch.Tensor):
    """(M, V) generator distributions -> (M,) replacements, after --sampler and --temperature."""

    def sample(probabilities: torch.Tensor) -> torch.Tensor:
        if args.sampler == "uniform":
            weights = (unigram > 0).float().expand_as(probabilities)
        elif args.sampler == "unigram":
            weights = unigram.expand_as(probabilities)
        else:
            weights = probabilities.pow(1.0 / args.temperature)
        return torch.multinomial(weights, 1).squeeze(-1)

    return sample


def parameter_groups(model) -> dict[str, list[nn.Parameter]]:
    """The discriminator's own weights, the generator's own, the shared embedding tables and the projection P."""
    shared = {id(table.weight) for table in embedding_tables(model.discriminator).values()}
    groups = {"discriminator": [], "generator": [], "shared_tables": [], "projection": []}
    for name, parameter in model.named_parameters():
        if id(parameter) in shared:
            groups["shared_tables"].append(parameter)
        elif name.startswith(("discriminator.", "generator.")):
            groups[name.split(".")[0]].append(parameter)
        else:
            groups["projection"].append(parameter)
    return groups


def gradient_norm(parameters: list[nn.Parameter]) -> float:
    return math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in parameters if p.grad is not None))


def roc_auc(logits: torch.Tensor, replaced: torch.Tensor) -> float:
    """The probability that a replaced token's logit is above an original's (Mann-Whitney, ties ignored)."""
    ranks = torch.empty_like(logits)
    ranks[logits.argsort()] = torch.arange(len(logits), dtype=logits.dtype)
    positives = replaced.sum()
    negatives = len(replaced) - positives
    return float((ranks[replaced == 1].sum() - positives * (positives - 1) / 2) / (positives * negatives))


@torch.no_grad()
def held_out(model, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """The discriminator on held-out batches (generator samples seeded alike at every evaluation)."""
    model.eval()
    torch.manual_seed(EVAL_SEED)
    logits, targets = [], []
    for batch in batches:
        outputs = model(**batch)
        real = batch["attention_mask"].bool()
        logits.append(outputs["discriminator_logits"][real])
        targets.append((outputs["corrupted"] != outputs["original"])[real].float())
    model.train()
    logit, target = torch.cat(logits), torch.cat(targets)
    base = float((target == 0).float().mean())
    predicted = (logit > 0).float()
    return {
        "heldout_rtd": float(nn.functional.binary_cross_entropy_with_logits(logit, target)),
        "constant_rtd": -(base * math.log(base) + (1 - base) * math.log(1 - base)),
        "recall_replaced": float(predicted[target == 1].mean()),
        "accuracy_original": float((1 - predicted[target == 0]).mean()),
        "auc": roc_auc(logit, target),
        "logit_mean": float(logit.mean()),
        "logit_std": float(logit.std()),
        "logit_gap": float(logit[target == 1].mean() - logit[target == 0].mean()),
    }


def train_step(model, optimizer, scheduler, batch: dict[str, torch.Tensor], args, groups) -> dict[str, float]:
    """One step as pretraining takes it (one process, no accumulation), measuring before the clip."""
    label_tokens, input_tokens = int((batch["labels"] != -100).sum()), input_token_count(batch)
    terms = electra_loss_terms(
        model(**batch),
        batch["labels"],
        batch.get("attention_mask"),
        label_tokens=label_tokens,
        input_tokens=input_tokens,
        rtd_weight=args.rtd_weight,
    )
    optimizer.zero_grad(set_to_none=True)
    terms["loss"].backward()
    row = {name: float(terms[key].detach()) for name, key in (("mlm", "mlm_loss"), ("rtd", "rtd_loss"))}
    row |= {name: float(terms[name]) for name in ("generator_accuracy", "replaced_share")}
    norms = {f"grad_{name}": gradient_norm(parameters) for name, parameters in groups.items()}
    row |= norms | {"grad_total": math.sqrt(sum(value**2 for value in norms.values()))}
    row["lr"] = scheduler.get_last_lr()[0]
    if args.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    scheduler.step()
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        tokenizer = args.tokenizer
        if tokenizer is None:  # one masked-LM step trains and saves the tokenizer
            run_pretraining(settings(args, work, "masked-lm", 1, None))
            tokenizer = str(work / "masked-lm")
        run = prepare(settings(args, work, "electra", args.steps, tokenizer))
        training = build(run)
        model = training.model
        model.sample_replacements = replacement_sampler(args, unigram_frequencies(run, run.tokenizer.all_special_ids))
        groups, batches, lines = parameter_groups(model), training.eval_batches[:HELD_OUT_BATCHES], []
        model.train()
        for step in range(1, args.steps + 1):
            _, batch = next(training.data)
            row = {"step": step, **train_step(model, training.optimizer, training.scheduler, batch, args, groups)}
            if step % args.every == 0 or step == 1:
                row |= held_out(model, batches)
                lines.append(row)
                print(json.dumps({key: round(value, 4) for key, value in row.items()}), flush=True)
    if args.output is not None:
        args.output.write_text(json.dumps(lines, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
