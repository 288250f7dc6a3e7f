"""`benchmarks/context_attention.py` still runs (its timings are not checked): every
strategy in its table, with the collective each compiles to."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # a subprocess, as tests/test_examples.py runs benchmarks

ROOT = Path(__file__).resolve().parent.parent


def test_context_attention_benchmark_quick(tmp_path: Path):
    out = tmp_path / "results.txt"
    command = [sys.executable, str(ROOT / "benchmarks" / "context_attention.py"), "--quick"]
    result = subprocess.run(
        [*command, "--lengths", "256", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for case, collective in [
        ("unsplit", "-"),
        ("ring", "cp"),
        ("ring, causal", "cp"),
        ("all_gather", "ag"),
        ("all_to_all", "a2a"),
    ]:
        figures = r"\s+[\d,]+ ms\s+[\d.]+x\s+[\d.]+x\s+[\d.,]+ MiB\s+"
        pattern = rf"256  {re.escape(case)}{figures}.*{re.escape(collective)}"
        assert re.search(pattern, result.stdout), f"{pattern!r} not in:\n{output}"
    assert out.read_text() in result.stdout
