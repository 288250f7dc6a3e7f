"""The package's layering (ARCHITECTURE.md), read from its imports: every import goes down
the layers or stays in its own folder, no import cycle, no underscore-private name
imported from another file, no file over ~500 lines, and private JAX API only in
`_compat`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "eqxshard"

# Lower numbers are lower layers; a folder may import its own modules and lower layers.
# `_mapping`, `_shard_map` and `_step` share a layer: siblings, none imports another.
LAYERS = {
    "_compat": 0,
    "_tree": 0,
    "_version": 0,
    "_caches": 0,
    "_placement": 1,
    "_mapping": 2,
    "_shard_map": 2,
    "_sequence": 2,
    "_step": 2,
    "_pipeline": 3,
    # A sibling of `_pipeline`: `Experts` runs inside a `Stacked` without either importing
    # the other, and `_plans` (the `experts` rule, auto_plan) reads `Experts`.
    "_experts": 3,
    "_plans": 4,
    "_checkpoint": 5,
    "_processes": 6,
    "launch": 7,
    "report": 7,
    "links": 7,
    "rules": 7,
    "_deprecated": 7,
    "__init__": 8,
}
MAX_LINES = 500  # one concept per file; past this it is two


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported_module(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base[: len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _private_imports(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """The underscore-private names `name` takes from another eqxshard module: `from .x
    import _name`, and `x._name` on a module `x` it imported. A private *module* or
    package (`from .. import _compat`, `_compat.name`) is fine, and so are dunders."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}  # local name -> the eqxshard module it stands for
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _imported_module(name, path, node)
            if not module.startswith("eqxshard"):
                continue
            for a in node.names:
                if f"{module}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{module}.{a.name}"
                elif _is_private(a.name):
                    found.append(f"{name}: from {module} import {a.name}")
        elif isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in modules})
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _is_private(node.attr)
            and f"{aliases[node.value.id]}.{node.attr}" not in modules
        ):
            found.append(f"{name}: {node.value.id}.{node.attr}")
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The eqxshard modules `name` imports, wherever the import stands: at the top, inside
    a function, or under `if TYPE_CHECKING:` (an import for annotations only is still a
    dependency, and a cycle through one is still a cycle)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom):
            module = _imported_module(name, path, node)
            candidates = [f"{module}.{a.name}" for a in node.names] + [module]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            candidates = []
        for c in candidates:
            if c in modules and c != name:
                found.add(c)
                break
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_belongs_to_a_layer() -> None:
    unplaced = sorted(m for m in _modules() if _component(m) not in LAYERS)
    assert not unplaced, f"modules outside every layer of ARCHITECTURE.md: {unplaced}"


def test_imports_go_down_the_layers() -> None:
    wrong = []
    for module, imported in _graph().items():
        for other in imported:
            a, b = _component(module), _component(other)
            if a == b:
                continue
            if LAYERS[b] > LAYERS[a] or (LAYERS[b] == LAYERS[a] and a != b):
                wrong.append(f"{module} -> {other}")
    assert not wrong, "imports against the layering of ARCHITECTURE.md:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return cycles


def test_no_import_cycle_between_files() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_between_folders() -> None:
    folders: dict[str, set[str]] = {}
    for module, imported in _graph().items():
        a = _component(module)
        folders.setdefault(a, set()).update(_component(m) for m in imported if _component(m) != a)
    cycles = _cycles(folders)
    assert not cycles, "import cycles between folders:\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_no_file_over_about_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, (
        f"one concept per file: past {MAX_LINES} lines a file holds two; make the folder "
        f"a sub-folder whose `__init__` names each: {long}"
    )


def test_no_private_name_imported_across_files() -> None:
    # A name another file needs is part of its module's interface (public, documented),
    # or the two files are one concept (one file), as in Equinox.
    modules = _modules()
    found = [f for name, path in modules.items() for f in _private_imports(name, path, modules)]
    assert not found, (
        "underscore-private names imported from another file (make each public, with a "
        "docstring, or merge the two files if they are one concept):\n" + "\n".join(found)
    )


def test_private_jax_api_only_in_compat() -> None:
    offenders = []
    for module, path in _modules().items():
        if _component(module) == "_compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            offenders += [
                f"{module}: {n}"
                for n in names
                if n.startswith(("jax._src", "jax.experimental", "jaxlib"))
            ]
    assert not offenders, "private or experimental JAX API outside _compat:\n" + "\n".join(
        offenders
    )


def test_every_folder_says_what_it_owns_and_may_import() -> None:
    silent = [
        p.parent.name
        for p in PACKAGE.glob("_*/__init__.py")
        if "Imports:" not in (ast.get_docstring(ast.parse(p.read_text())) or "")
    ]
    assert not silent, f"folders whose docstring does not say what they may import: {silent}"


@pytest.mark.parametrize("folder", ["examples", "benchmarks"])
def test_examples_and_benchmarks_use_only_public_names(folder: str) -> None:
    private = []
    for path in sorted((PACKAGE.parent / folder).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eqxshard."):
                private.append(f"{path.name}: from {node.module}")
            if isinstance(node, ast.Import):
                private += [
                    f"{path.name}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("eqxshard.")
                ]
    assert not private, "import public names from `eqxshard` only:\n" + "\n".join(private)


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    # The graph reader resolves relative imports: a module of `_placement` importing
    # `_plans` must show up as that edge (else the layering test could never fail).
    modules = {"eqxshard._placement.x": tmp_path / "x.py", "eqxshard._plans.rules": Path()}
    (tmp_path / "x.py").write_text("from .._plans import rules\nfrom .._plans.rules import a\n")
    found = _imports("eqxshard._placement.x", tmp_path / "x.py", modules)
    assert found == {"eqxshard._plans.rules"}


def test_the_checker_sees_a_private_import(tmp_path: Path) -> None:
    # A private name taken by `from` or read off an imported module is found; a private
    # module (`_compat`), its public names and dunders are not.
    modules = {
        "eqxshard._step.x": tmp_path / "x.py",
        "eqxshard._step.call": Path(),
        "eqxshard._compat": Path(),
    }
    (tmp_path / "x.py").write_text(
        "from .call import _Config, run\n"
        "from . import call as c\n"
        "from .. import _compat\n"
        "c._SITES.clear()\n"
        "c.__name__, _compat.name, _compat._private\n"
    )
    found = _private_imports("eqxshard._step.x", tmp_path / "x.py", modules)
    assert sorted(found) == [
        "eqxshard._step.x: _compat._private",
        "eqxshard._step.x: c._SITES",
        "eqxshard._step.x: from eqxshard._step.call import _Config",
    ]


def test_the_checker_sees_a_cycle_through_type_checking(tmp_path: Path) -> None:
    # An import for annotations only still ties the two files together: the cycle
    # table <-> view must be found although one side is under `if TYPE_CHECKING:`.
    (tmp_path / "table.py").write_text("from . import view\n")
    (tmp_path / "view.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .table import T\n"
    )
    modules = {f"eqxshard._plans.{n}": tmp_path / f"{n}.py" for n in ("table", "view")}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == [
        ["eqxshard._plans.table", "eqxshard._plans.view", "eqxshard._plans.table"]
    ]
