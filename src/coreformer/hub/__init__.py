"""Saved folders and the Hub: how a folder is written, what its model card says, and how it is published.

    folders.py       staged (atomic) folder writes, set-aside runs, a folder's tokenizer, serving files
    model_card.py    the model card of every folder coreformer writes (templates in model_cards/), and its checks
    publishing.py    publish_folder: a checked folder pushed to a Hub model repository in one commit

Never imported by the modeling files: those are copied next to checkpoints, these are not.
"""
