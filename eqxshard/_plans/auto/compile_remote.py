"""Compiling candidates whose mesh has more devices than this process: each is lowered
here on an `AbstractMesh` (StableHLO, no devices needed) and compiled in a subprocess
that starts JAX with that many CPU devices (`jax_num_cpu_devices`), one subprocess per
device count."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from .measure import Measurement, Placed, Problem, lower_text, measurement

# Seconds a subprocess may take to compile all its candidates.
TIMEOUT = 1800


def compile_all(
    problem: Problem, work: Sequence[tuple[Placed, dict[str, int]]]
) -> list[Measurement]:
    """Measurements of each `(placed on an AbstractMesh, mesh shape)`, in order."""
    by_count: dict[int, list[int]] = {}
    for k, (_, shape) in enumerate(work):
        by_count.setdefault(math.prod(shape.values()), []).append(k)
    out: dict[int, Measurement] = {}
    for count, indices in by_count.items():
        texts = [lower_text(problem, work[k][0]) for k in indices]
        for k, (memory, flops, hlo) in zip(indices, _run(count, texts), strict=True):
            out[k] = measurement(SimpleNamespace(**memory), flops, hlo, work[k][1])
    return [out[k] for k in range(len(work))]


def _run(count: int, texts: list[str]) -> list[tuple[dict[str, int], float, str]]:
    with tempfile.TemporaryDirectory(prefix="eqxshard-auto-plan-") as folder:
        src, dst = os.path.join(folder, "in.json"), os.path.join(folder, "out.json")
        with open(src, "w") as f:
            json.dump({"devices": count, "modules": texts}, f)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        done = subprocess.run(
            [sys.executable, "-m", "eqxshard._plans.auto.compile_worker", src, dst],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"`auto_plan` could not compile on {count} CPU devices in a subprocess "
                f"(exit {done.returncode}):\n{done.stderr[-2000:]}\nPass a smaller "
                "`compile_limit` to estimate these meshes from smaller ones instead."
            )
        with open(dst) as f:
            results: list[Any] = json.load(f)
    return [(r["memory"], r["flops"], r["hlo"]) for r in results]
