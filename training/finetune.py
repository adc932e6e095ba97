"""Fine-tune a coreformer folder with transformers' Trainer (Seq2SeqTrainer for seq2seq).

    python training/finetune.py --task sequence-classification --model outputs/encoder-tiny --output-dir out/cls
    python training/finetune.py --task token-classification --model M --dataset conll2003 --label-column ner_tags ...
    python training/finetune.py --task question-answering --model M --train-file train.jsonl --validation-file dev.jsonl
    python training/finetune.py --task causal-lm --model outputs/decoder-tiny --peft lora --output-dir out/clm-lora
    python training/finetune.py --task seq2seq --model outputs/seq2seq-tiny --max-steps 500 --output-dir out/sum
    python training/finetune.py --task multiple-choice --model outputs/electra-tiny --output-dir out/mc
    python training/finetune.py --task seq2seq --model M --output-dir out/sum --resume-from-checkpoint latest

Checkpoints go to OUTPUT_DIR/checkpoints/step-N every --save-every steps (500) and at the end, each written whole
(Trainer's files renamed into place); --resume-from-checkpoint latest continues the newest one exactly, and starts
the run when there is none.

Tasks: sequence-classification (run_glue), token-classification (run_ner), question-answering (run_qa), causal-lm
(run_clm), seq2seq (run_summarization), multiple-choice (run_swag). Without --dataset / --train-file each task trains
on its embedded offline default, built from the Python standard library (see README, "Fine-tuning"). Settings come
from the dataclass defaults, then --config FILE (YAML/JSON of the same keys), then the flags given here; the example
scripts' flag names (--model_name_or_path, --dataset_name, --max_seq_length, --per_device_train_batch_size,
--learning_rate, --overwrite_output_dir, ...) are accepted too. Everything lives in coreformer.training.finetuning;
this file only parses the command line.
"""

import argparse
import sys

# torch-free imports only (the package's run module, which imports torch, comes in main after parsing)
from coreformer_cli import USAGE_ERROR, NoSuchFolderError, add_version_argument, check_model_location
from coreformer_settings.base import INTERRUPTED, FinetuningError, RunStoppedError, load_config_file
from coreformer_settings.finetuning import add_settings_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", metavar="FILE", help="a YAML/JSON file of settings (the flags' names as keys)")
    # --field-name, --field_name and the example scripts' names; only flags given override the config file
    add_settings_flags(parser)
    add_version_argument(parser)
    return parser


def check_locations(given: dict, config: str | None) -> None:
    """A mistyped --model or --tokenizer folder (given here or in --config): one line, before torch is imported or
    the Hub is asked."""
    values = {**(load_config_file(config, error=FinetuningError) if config is not None else {}), **given}
    for key in ("model", "tokenizer"):
        if values.get(key) is not None:
            check_model_location(values[key])


def main(argv: list[str] | None = None) -> int:
    given = vars(build_parser().parse_args(argv))
    config = given.pop("config", None)
    try:
        check_locations(given, config)
        from coreformer.training.finetuning import BEFORE, resolve_arguments, run_finetuning  # torch: after the checks

        metrics = run_finetuning(resolve_arguments(config_file=config, overrides=given))
    except (FinetuningError, NoSuchFolderError) as error:
        print(f"finetune.py: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except RunStoppedError as stopped:
        print(f"finetune.py: {stopped}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:  # while loading, evaluating or saving: the output folder is only replaced complete
        print(
            "finetune.py: stopped before or after the training steps; the final folder was not written. Run the "
            "command again (after training, --resume-from-checkpoint latest continues from its last checkpoint)",
            file=sys.stderr,
        )
        return INTERRUPTED
    shown = {key: round(value, 4) for key, value in metrics.items() if key.startswith("eval_")}
    before = {key: round(metrics[BEFORE + key], 4) for key in shown if BEFORE + key in metrics}
    print(f"done: {shown} (before training: {before})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
