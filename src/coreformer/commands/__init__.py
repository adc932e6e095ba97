"""The work behind each `coreformer` subcommand: one handler `(prepared, prog) -> exit code` per command.

    runs.py            pretrain, finetune, evaluate, publish: the runs of coreformer.training and coreformer.hub
    convert.py         convert: a transformers folder -> a coreformer folder (coreformer.native), checked and carded
    export.py          export: a coreformer folder -> a native transformers folder, ONNX or GGUF (coreformer.export)
    attention_map.py   attention-map: a saved model's attention probabilities drawn to an image
    tokenize.py        tokenize: a corpus -> shards of token ids (coreformer.training.shards), resumable
    base.py            what the handlers share: their error types and how each becomes an exit code

The command line (`coreformer_cli`, torch-free, beside the package) parses and checks the arguments, then imports the
handler it names. Nothing here imports the command line: the arrows run one way, from it to here.
"""
