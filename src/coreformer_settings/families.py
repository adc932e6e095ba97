"""The family names, read without torch from THE family registry, `coreformer/families.py`.

    FAMILY_NAMES     ("encoder", "decoder", "seq2seq"): the keys of coreformer.families.FAMILIES, in its order

`coreformer/families.py` imports neither torch nor the rest of the package (it is copied next to every checkpoint),
but importing it as `coreformer.families` runs the package's `__init__`, which registers the models with
transformers (torch, about 5 s). So the file is executed on its own, from beside this package, and only its names
are kept: the registry stays the one declaration of every family.
"""

import importlib.util
from pathlib import Path

_REGISTRY_FILE = Path(__file__).resolve().parent.parent / "coreformer" / "families.py"


def _registered_names() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("coreformer_settings._family_registry", _REGISTRY_FILE)
    registry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registry)
    return tuple(registry.FAMILIES)


FAMILY_NAMES: tuple[str, ...] = _registered_names()
