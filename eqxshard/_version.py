"""`eqxshard.__version__`: the installed distribution's version, or, for a source tree
that was never installed (a checkout on `PYTHONPATH`, a machine where nothing can be
installed), the version its `pyproject.toml` declares."""

import importlib.metadata
import re
from pathlib import Path

# What a source tree without a readable `pyproject.toml` reports (PEP 440 local version).
UNKNOWN = "0+unknown"


def version() -> str:
    try:
        return importlib.metadata.version("eqxshard")
    except importlib.metadata.PackageNotFoundError:
        return source_version(Path(__file__).resolve().parents[1] / "pyproject.toml")


def source_version(pyproject: Path) -> str:
    """The `version` of `[project]` in `pyproject`, or `UNKNOWN` (no file, no version)."""
    try:
        text = pyproject.read_text()
    except OSError:
        return UNKNOWN
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = project and re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M)
    return found.group(1) if found else UNKNOWN
