"""The newer benchmarks still run (their timings are not checked): `--quick` runs of
`benchmarks/context_attention.py` (every strategy, with the collective each compiles to)
and `benchmarks/moe.py` (every case, the expert rows each computes and its collectives)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # a subprocess, as tests/test_examples.py runs benchmarks

ROOT = Path(__file__).resolve().parent.parent


def quick(script: str, tmp_path: Path, *args: str) -> str:
    """`benchmarks/<script> --quick *args`'s standard output, checked to have run and to
    hold the results file it wrote."""
    out = tmp_path / "results.txt"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args, "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert out.read_text() in result.stdout
    return result.stdout


def test_context_attention_benchmark_quick(tmp_path: Path):
    stdout = quick("context_attention.py", tmp_path, "--lengths", "256")
    for case, collective in [
        ("unsplit", "-"),
        ("ring", "cp"),
        ("ring, causal", "cp"),
        ("all_gather", "ag"),
        ("all_to_all", "a2a"),
    ]:
        figures = r"\s+[\d,]+ ms\s+[\d.]+x\s+[\d.]+x\s+[\d.,]+ MiB\s+"
        pattern = rf"256  {re.escape(case)}{figures}.*{re.escape(collective)}"
        assert re.search(pattern, stdout), f"{pattern!r} not in:\n{stdout}"


def test_moe_benchmark_quick(tmp_path: Path):
    stdout = quick("moe.py", tmp_path, "--tokens", "256")
    # 256 tokens, 32 per device, top-2 of E = 8: the rows each device's experts run on.
    for case, rows, collective in [
        ("dense, 1 device", "2,048", "-"),
        ("all_gather experts", "256", "ag 2 rs 2"),
        ("moe, dropless", "512", "a2a"),
        ("moe, capacity 1.0", "64", "a2a 4"),
        ("moe, capacity 1.25", "80", "a2a 4"),
        ("moe, capacity 2.0", "128", "a2a 4"),
    ]:
        figures = r"\s+[\d,]+ ms\s+[\d.]+x\s+[\d.]+x\s+"
        tail = r"\s+(-|[\d.]+%)\s+[\d.,]+ MiB\s+"
        pattern = rf"256  {re.escape(case)}{figures}{rows}{tail}{re.escape(collective)}"
        assert re.search(pattern, stdout), f"{pattern!r} not in:\n{stdout}"
