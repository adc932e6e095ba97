"""docs/architecture.md's rules, measured from the code's own imports (read as text with `ast`, nothing imported):

the modeling files (copied next to every checkpoint) import only each other, by single-dot imports
nothing in the package imports the command line (coreformer_cli), a script or a benchmark
coreformer_settings imports nothing of the package (it reads registry files by path)
the package's modules import each other without a circle
the page's layout names every folder of the package, and the wheel lists every package folder
"""

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "coreformer"
MODELING_ROOTS = ("modeling_encoder", "modeling_decoder", "modeling_seq2seq", "configuration_coreformer")
FRONT_DOOR = "coreformer_cli"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py") if "metrics" not in path.parts}


def imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in `path` (in functions too), relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] if not node.module else [base]
            found += [(name, node.lineno) for name in names]
    return found


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module an imported name refers to (a module, or a name inside one), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def shipped_files() -> set[str]:
    """The modeling files: what `save_pretrained` copies, every file their relative imports reach."""
    seen, todo = set(), list(MODELING_ROOTS)
    while todo:
        stem = todo.pop()
        if stem in seen:
            continue
        seen.add(stem)
        tree = ast.parse((PACKAGE / f"{stem}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                todo += [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
    return seen


def test_the_modeling_files_import_only_each_other_by_single_dot_imports():
    shipped = shipped_files()
    assert {"attention", "layer_types", "compat", "modeling_base"} <= shipped
    for stem in shipped:
        path = PACKAGE / f"{stem}.py"
        assert path.is_file(), f"{stem} is imported by a modeling file but is not a flat file of the package"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and (node.module is None or "." not in node.module), (
                    f"{path.name}:{node.lineno}: the modeling files are copied flat next to a checkpoint, so they "
                    f"import siblings with one dot only"
                )
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            for name in names:
                assert not name.startswith(("coreformer", "training", "benchmarks")), (
                    f"{path.name}:{node.lineno} imports {name}; a checkpoint's folder holds only the modeling files"
                )


def test_nothing_in_the_package_imports_the_front_door_a_script_or_a_benchmark():
    for path in package_modules().values():
        for imported, line in imports(path):
            root = imported.split(".")[0]
            assert root not in (FRONT_DOOR, "training", "benchmarks", "conftest"), (
                f"{path.relative_to(ROOT)}:{line} imports {imported}: the command line and the scripts import the "
                f"package, never the reverse"
            )
    for path in (SRC / "coreformer_settings").glob("*.py"):
        for imported, line in imports(path):
            assert imported.split(".")[0] not in ("coreformer", FRONT_DOOR), (
                f"{path.relative_to(ROOT)}:{line} imports {imported}: the settings are the ground floor (they read "
                f"the registry files by path)"
            )


def test_the_package_imports_without_a_circle():
    modules = package_modules()
    graph = {
        name: {target for imported, _ in imports(path) if (target := resolve(imported, modules)) not in (None, name)}
        for name, path in modules.items()
    }
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circle = trail[trail.index(target) :] + [target] if target in trail else [name, target]
                raise AssertionError(f"an import circle: {' -> '.join(circle)}")
            if target not in state:
                visit(target, [*trail, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_wheel_lists_every_package_folder():
    """pyproject.toml lists its packages (the model card templates ship inside one), so a new folder is listed too."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {module_name(path) for path in SRC.rglob("__init__.py") if "egg-info" not in str(path)}
    assert folders <= listed, f"pyproject.toml's packages lack {sorted(folders - listed)}"


def test_the_layout_on_the_page_names_every_folder_of_the_package():
    page = (ROOT / "docs" / "architecture.md").read_text()
    layout = page.split("```text", 1)[1].split("```", 1)[0]
    folders = sorted(path.name for path in PACKAGE.iterdir() if path.is_dir() and not path.name.startswith(("_", ".")))
    missing = [name for name in folders if not re.search(rf"\b{name}/", layout)]
    assert not missing, f"docs/architecture.md's layout does not name {missing}"
