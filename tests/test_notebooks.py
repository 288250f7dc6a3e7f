"""Every `examples/*.ipynb` runs top to bottom on 8 CPU devices; a failing cell fails the test.

Notebooks are committed without outputs (checked here too), so what they show is what
this run produces. Needs `nbclient`, `nbformat` and `ipykernel`; the kernel is this
interpreter (`python3` resolves to `sys.executable`), which a last cell added to each
run checks, with its JAX version. A notebook must also run without writing to stderr
(warnings included), the counterpart of `filterwarnings = error` for the kernel.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ipykernel  # noqa: F401  (the kernel the notebooks run in)
import jax
import matplotlib.font_manager  # noqa: F401  (builds the font cache here, not in a kernel's stderr)
import nbclient
import nbformat
import pytest

pytestmark = pytest.mark.heavy  # each runs a kernel: CI runs these on the newest JAX only

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {EXAMPLES}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_outputs_stripped(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"{path.name}: cell {i} has saved outputs; strip them"
            assert cell.execution_count is None, f"{path.name}: cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    # The kernel is a new process: it inherits these, so it starts with 8 CPU devices.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count=8".strip()
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(path, as_version=4)
    # One more cell, not saved: which interpreter and which JAX the kernel really runs.
    nb.cells.append(
        nbformat.v4.new_code_cell("import sys, jax\nprint(sys.executable)\nprint(jax.__version__)")
    )
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    outputs = [
        (i, output)
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for output in cell.outputs
    ]
    assert not [o for _, o in outputs if o.get("output_type") == "error"]
    stderr = [f"cell {i}: {o.text}" for i, o in outputs if o.get("name") == "stderr"]
    assert not stderr, f"{path.name} wrote to stderr:\n" + "\n".join(stderr)
    executable, version = "".join(o.text for o in nb.cells[-1].outputs).splitlines()
    assert os.path.realpath(executable) == os.path.realpath(sys.executable)
    assert version == jax.__version__
