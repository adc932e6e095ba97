"""Every run's settings, importable without torch or transformers (a package beside `coreformer`, not in it: importing
anything inside `coreformer` registers its classes with transformers and so imports torch, about 5 s).

    base.py          the settings base (RunSettings, arg, flags, config files, coercion) and the run errors
    registries.py    FAMILY_NAMES and NATIVE_NAMES, read from the package's registry files
    components.py    what the objective and task registries share: entries, owned settings, their flags
    objectives.py    OBJECTIVE_REGISTRY and each objective's own settings
    tasks.py         TASK_REGISTRY and each task's own settings
    pretraining.py   PretrainingSettings, the presets and how a run's settings are gathered
    finetuning.py    FinetuningSettings
    command_line.py  what every command line shares: the suggesting parser, --version, the folder and Hub checks

The command line (coreformer_cli, beside this package) builds their parsers from these, so
`--help`, `--version` and a bad flag answer before torch is imported; the runs (`coreformer.training.pretraining` /
`finetuning`) subclass the settings with the checks that need the registries.
"""
