"""Every public name is importable, documented, and its `!!! Example` code runs."""

import inspect
import re
import textwrap

import pytest

import eqxshard

PUBLIC = sorted(name for name in dir(eqxshard) if not name.startswith("_"))
EXAMPLE = re.compile(r"!!! Example\s*\n\s*```python\n(.*?)```", re.S)


def test_public_names_import_and_have_docstrings():
    assert "filter_shard" in PUBLIC and "filter_map" in PUBLIC
    undocumented = [
        n
        for n in PUBLIC
        if callable(getattr(eqxshard, n)) and not inspect.getdoc(getattr(eqxshard, n))
    ]
    assert not undocumented, undocumented


def _examples():
    for name in PUBLIC:
        doc = inspect.getdoc(getattr(eqxshard, name)) or ""
        for k, code in enumerate(EXAMPLE.findall(doc)):
            yield pytest.param(textwrap.dedent(code), id=f"{name}-{k}")


# Examples may take these names as given, as the Equinox docs do.
PRELUDE = """
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
import eqxshard
"""


@pytest.mark.parametrize("code", list(_examples()))
def test_docstring_example_runs(code):
    exec(compile(PRELUDE + code, "<docstring example>", "exec"), {})
