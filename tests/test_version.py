"""`eqxshard.__version__`, installed or not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import eqxshard
from eqxshard import _version

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_declared_one() -> None:
    declared = _version.source_version(ROOT / "pyproject.toml")
    assert declared != _version.UNKNOWN
    assert eqxshard.__version__ == declared


def test_a_source_tree_that_was_never_installed_imports() -> None:
    # No distribution metadata: the version comes from the tree's pyproject.toml.
    code = (
        "import importlib.metadata as m\n"
        "found = m.version\n"
        "def version(name):\n"
        "    if name == 'eqxshard':\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return found(name)\n"
        "m.version = version\n"
        "import eqxshard\n"
        "print(eqxshard.__version__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == _version.source_version(ROOT / "pyproject.toml")


def test_source_version_without_a_readable_version(tmp_path: Path) -> None:
    assert _version.source_version(tmp_path / "absent.toml") == _version.UNKNOWN
    (tmp_path / "pyproject.toml").write_text('[tool.x]\nversion = "9"\n[project]\nname = "a"\n')
    assert _version.source_version(tmp_path / "pyproject.toml") == _version.UNKNOWN
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "a"\nversion = "1.2.3"\n')
    assert _version.source_version(tmp_path / "pyproject.toml") == "1.2.3"
