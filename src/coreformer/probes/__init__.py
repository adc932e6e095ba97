"""Probes: small synthetic tasks that measure what an attention type can do, for benchmarks and tests.

Not part of the model package: nothing here is copied next to a checkpoint, and modeling code never imports it.

    associative_recall   multi-query associative recall (MQAR): AssociativeRecall, recall_model_config,
                         train_associative_recall
"""

from .associative_recall import AssociativeRecall, recall_model_config, train_associative_recall

__all__ = ["AssociativeRecall", "recall_model_config", "train_associative_recall"]
