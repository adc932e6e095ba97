"""The names of export formats, GGUF weight types and parity tolerances, declared once and importable without torch.

    EXPORT_FORMATS        what `coreformer export --to` writes (coreformer.export.EXPORTERS has one writer each)
    RUN_EXPORT_FORMATS    what a training run's `--export` writes at its end (a subset: the native folder)
    GGUF_DTYPES           the weight types `--to gguf` writes (coreformer.export.gguf.DTYPES describes each)
    CHECK_TOLERANCES      dtype -> the largest output difference a parity check accepts (coreformer.native.parity)
    CHECK_TOLERANCE       the fp32 one: what `convert --check`, `export --check` and the ONNX check accept

The torch-free command line (coreformer_cli, through coreformer_settings.tools) offers these as choices and quotes
the tolerance in its help; the package reads them from here, so a name is never written twice.
"""

EXPORT_FORMATS = ("native", "onnx", "gguf")
RUN_EXPORT_FORMATS = ("native",)
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")

# The largest max-abs output difference a parity check accepts, by the dtype the compared side computes in. fp32:
# converted, exported and ONNX-runtime models all reproduce the reference to rounding (each check runs both sides in
# fp32). The others are GGUF weight types read back against the fp32 native model.
CHECK_TOLERANCES = {"f32": 1e-5, "f16": 1e-2, "bf16": 5e-2, "q8_0": 5e-2}
CHECK_TOLERANCE = CHECK_TOLERANCES["f32"]
