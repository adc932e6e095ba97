"""Zero-shot evaluation of a pretrained folder: held-out loss and perplexity, minimal-pair accuracy.

    python training/zero_shot.py FOLDER [--data FILES] [--json]      (the same as `coreformer evaluate`)

Argument parsing lives in coreformer_settings.evaluation (--help needs no torch), the evaluation in
coreformer.training.zero_shot. Not named evaluate.py: a script's folder comes first on sys.path, and that name would
shadow the `evaluate` package for the scripts beside it.
"""

import sys

if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        from coreformer_settings.evaluation import build_parser

        build_parser("training/zero_shot.py").print_help()
        sys.exit(0)
    from coreformer.training.zero_shot import main

    sys.exit(main(sys.argv[1:]))
