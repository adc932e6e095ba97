"""Names read without torch from the package's registry files, so each stays declared once, there.

    FAMILY_NAMES     ("encoder", "decoder", "seq2seq"): the keys of coreformer.families.FAMILIES, in its order
    NATIVE_NAMES     model_type -> printed name of every native architecture (coreformer/native/names.py), in
                     export's order of preference
    native_list()    "BERT, RoBERTa, GPT-2, ...": the native architectures as help texts write them

The registry files import neither torch nor the rest of the package (families.py is copied next to every
checkpoint), but importing one as `coreformer.families` runs the package's `__init__`, which registers the models
with transformers (torch, about 5 s). So each file is executed on its own, from beside this package, and only its
names are kept.
"""

import importlib.util
from pathlib import Path
from types import ModuleType

_PACKAGE = Path(__file__).resolve().parent.parent / "coreformer"


def _registry_file(relative: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"coreformer_settings._{Path(relative).stem}", _PACKAGE / relative)
    registry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registry)
    return registry


FAMILY_NAMES: tuple[str, ...] = tuple(_registry_file("families.py").FAMILIES)
NATIVE_NAMES: dict[str, str] = dict(_registry_file("native/names.py").NATIVE_NAMES)


def native_list() -> str:
    return ", ".join(NATIVE_NAMES.values())
