"""`benchmarks/moe.py` still runs (its timings are not checked): every case in its table,
the expert rows each computes and the collectives each compiles to."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # a subprocess, as tests/test_examples.py runs benchmarks

ROOT = Path(__file__).resolve().parent.parent


def test_moe_benchmark_quick(tmp_path: Path):
    out = tmp_path / "results.txt"
    command = [sys.executable, str(ROOT / "benchmarks" / "moe.py"), "--quick"]
    result = subprocess.run(
        [*command, "--tokens", "256", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
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
        assert re.search(pattern, result.stdout), f"{pattern!r} not in:\n{output}"
    assert out.read_text() in result.stdout
