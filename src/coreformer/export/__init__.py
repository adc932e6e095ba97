"""Exports: a coreformer folder written in a form that runs without coreformer.

    exporters.py   export_to (every format), the native one: the same function under a transformers architecture
                   (to_native, choose_target), checked by plain transformers in a fresh process (check_exported)
    onnx.py        ONNX graphs for onnxruntime / Optimum (export_onnx), checked by onnxruntime
    gguf.py        GGUF files for llama.cpp (export_gguf), checked by reading the file back

onnx.py and gguf.py import their optional packages (coreformer[export]) only when they run.
"""

from .exporters import (
    EXPORTERS,
    CheckJob,
    CheckResult,
    ExportCheckError,
    check_exported,
    choose_target,
    export_native,
    export_to,
    to_native,
)

__all__ = [
    "EXPORTERS",
    "CheckJob",
    "CheckResult",
    "ExportCheckError",
    "check_exported",
    "choose_target",
    "export_native",
    "export_to",
    "to_native",
]
