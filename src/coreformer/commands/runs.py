"""The runs behind `coreformer pretrain | finetune | evaluate | publish` (and the clone's training/*.py scripts).

    pretrain((values, source), prog)   the gathered settings -> PretrainingArguments -> run_pretraining
    finetune(values, prog)             the gathered settings -> FinetuningArguments -> run_finetuning, then its summary
    evaluate(settings, prog)           zero_shot.evaluate_folder, printed as a table or JSON
    publish(given, prog)               coreformer.hub.publishing.publish_folder

Each takes what the command line's `prepare` gathered and checked (coreformer_cli), so settings are read once. Exit
codes: 0 done, 2 a refused setting (one line, nothing written), 1 the Hub refused an upload or evaluation failed, 130
a run stopped by Ctrl-C inside a step (RunStoppedError; outside one, the command line says it).
"""

import json
import os
import sys
from typing import Any

from coreformer_settings.base import FinetuningError, PretrainingError, RunStoppedError
from coreformer_settings.command_line import HUB_FAILED, USAGE_ERROR
from coreformer_settings.evaluation import EvaluationSettings

from .base import stopped


def _refused(prog: str, error: Exception) -> int:
    print(f"{prog}: error: {error}", file=sys.stderr)
    return USAGE_ERROR


def pretrain(prepared: tuple[dict[str, Any], str], prog: str) -> int:
    from ..training.pretraining import PretrainingArguments, run_pretraining

    values, source = prepared
    try:
        run_pretraining(PretrainingArguments.resolve(values, source=source))
    except PretrainingError as error:
        return _refused(prog, error)
    except RunStoppedError as error:
        return stopped(prog, str(error))
    return 0


def finetune(values: dict[str, Any], prog: str) -> int:
    from ..training.finetuning import FinetuningArguments, run_finetuning
    from ..training.finetuning.trainer import BEFORE
    from ..training.reports import finetune_summary

    try:
        args = FinetuningArguments.resolve(values)
        metrics = run_finetuning(args)
    except FinetuningError as error:
        return _refused(prog, error)
    except RunStoppedError as error:
        return stopped(prog, str(error))
    shown = {key: round(value, 4) for key, value in metrics.items() if key.startswith("eval_")}
    before = {key: round(metrics[BEFORE + key], 4) for key in shown if BEFORE + key in metrics}
    print(f"done: {shown} (before training: {before})")
    if int(os.environ.get("RANK", "0")) == 0:  # once under a launcher, as pretraining prints its own
        print(finetune_summary(args))
    return 0


def evaluate(settings: EvaluationSettings, prog: str) -> int:
    import datasets
    import transformers

    from ..training.zero_shot import EvaluationError, evaluate_folder, render_report

    datasets.disable_progress_bars()  # the report is the output: no tokenizing or loading bars around it
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    try:
        report = evaluate_folder(
            settings.folder,
            data=settings.data,
            pairs=settings.pairs,
            batches=settings.batches,
            batch_size=settings.batch_size,
            seed=settings.seed,
        )
    except EvaluationError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if settings.json else render_report(report))
    return 0


def publish(given: dict[str, Any], prog: str) -> int:
    from ..hub.publishing import PublishError, publish_folder

    folder = given.pop("folder")
    try:
        url = publish_folder(folder, **given)
    except PublishError as error:
        return _refused(prog, error)
    except Exception as error:  # the Hub's answer (HfHubHTTPError, a refused token, no connection): say it once
        print(f"{prog}: the Hub did not take the upload: {type(error).__name__}: {error}", file=sys.stderr)
        return HUB_FAILED
    print(f"published {folder} -> {url}")
    return 0
