"""`eqxshard/_pipeline`'s parts, read from their imports, as its `__init__` docstring says:
the shared modules (`checks`, `remat`, `bubble`, `watch`) import no part; `spmd/` and
`mpmd/` import neither each other nor `stacked/`; `stacked/` imports `spmd/`, never `mpmd/`;
no file imports another's underscore names; every part's docstring says what it imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[1] / "eqxshard" / "_pipeline"
PARTS = ("spmd", "mpmd", "stacked")
# The parts each part may import (besides itself and the shared modules).
MAY_IMPORT = {"shared": set(), "spmd": set(), "mpmd": set(), "stacked": {"spmd"}}


def _part(path: Path) -> str:
    inside = path.relative_to(FOLDER).parts
    return inside[0] if len(inside) > 1 and inside[0] in PARTS else "shared"


def _imports(path: Path) -> list[tuple[list[str], list[str]]]:
    """Each `from ... import ...` of `path` as the module's parts under `eqxshard/_pipeline`
    (empty for `_pipeline` itself; `None` outside it) and the names imported."""
    here = list(path.relative_to(FOLDER).with_suffix("").parts)
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        if node.level - 1 > len(package):
            continue  # above `_pipeline`: another folder of the package
        base = package[: len(package) - (node.level - 1)]
        module = [*base, *(node.module.split(".") if node.module else [])]
        found.append((module, [a.name for a in node.names]))
    return found


def _files() -> list[Path]:
    return sorted(FOLDER.rglob("*.py"))


def test_the_checker_reads_the_parts() -> None:
    # Else the tests below could pass on a folder they no longer see.
    assert {_part(p) for p in _files()} == {"shared", *PARTS}
    imported = _imports(FOLDER / "stacked" / "stacked.py")
    assert (["spmd", "pipeline"], ["run_pipeline"]) in imported
    assert (["remat"], ["check_remat"]) in imported


def test_each_part_imports_only_what_the_folder_docstring_allows() -> None:
    wrong = []
    for path in _files():
        mine = _part(path)
        for module, names in _imports(path):
            targets = [[*module, n] for n in names] if not module else [module]
            for target in targets:
                other = target[0] if target and target[0] in PARTS else "shared"
                if other not in (mine, "shared", *MAY_IMPORT[mine]):
                    wrong.append(f"{path.relative_to(FOLDER)} imports {'.'.join(target)}")
    assert not wrong, "imports between `_pipeline`'s parts against its docstring:\n" + "\n".join(
        wrong
    )


def test_no_underscore_name_is_imported_across_files() -> None:
    private = [
        f"{path.relative_to(FOLDER)}: from {'.'.join(module) or '_pipeline'} import {name}"
        for path in _files()
        for module, names in _imports(path)
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private, "name these in-package public:\n" + "\n".join(private)


@pytest.mark.parametrize("part", PARTS)
def test_every_part_says_what_it_owns_and_may_import(part: str) -> None:
    docstring = ast.get_docstring(ast.parse((FOLDER / part / "__init__.py").read_text()))
    assert docstring and "Imports:" in docstring
