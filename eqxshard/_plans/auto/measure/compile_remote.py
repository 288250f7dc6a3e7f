"""Compiling candidates in another process: those whose mesh has more devices than this
process, and a share of the others, compiled alongside this process's own compiles (XLA
holds the GIL while it compiles, so a second process is how two cores both compile).
Each is lowered here on an `AbstractMesh` (StableHLO, no devices needed) and compiled in
a subprocess that starts JAX with enough CPU devices (`jax_num_cpu_devices`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from ..trace.problem import Problem
from .compiled import Measurement, Placed, lower_text, measurement

# Seconds a subprocess may take to compile all its candidates.
TIMEOUT = 1800


@dataclasses.dataclass
class Running:
    """A subprocess compiling modules: its process, folder and each module's mesh."""

    process: subprocess.Popen[bytes]
    folder: str
    count: int
    shapes: list[dict[str, int]]


def start(problem: Problem, work: Sequence[tuple[Placed, dict[str, int]]]) -> Running:
    """Lowers each `(placed on a mesh, mesh shape)` here and starts compiling them all in
    one subprocess with as many CPU devices as the largest mesh; `finish` waits for it."""
    texts = [lower_text(problem, placed) for placed, _ in work]
    # With constant folding, as in this process (`compiled.FAST_COMPILE`).
    folds = [True for _ in work]
    return _launch(texts, [dict(shape) for _, shape in work], folds)


def _launch(texts: list[str], shapes: list[dict[str, int]], folds: list[bool]) -> Running:
    counts = [math.prod(shape.values()) for shape in shapes]
    folder = tempfile.mkdtemp(prefix="eqxshard-auto-plan-")
    src, dst = os.path.join(folder, "in.json"), os.path.join(folder, "out.json")
    with open(src, "w") as f:
        json.dump({"devices": max(counts), "modules": texts, "counts": counts, "folds": folds}, f)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with open(os.path.join(folder, "stderr"), "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "eqxshard._plans.auto.measure.compile_worker", src, dst],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    return Running(process, folder, max(counts), shapes)


def finish(running: Running) -> list[Measurement]:
    """The measurements of a `start`ed subprocess, in order."""
    try:
        try:
            code = running.process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait()
            code = "timed out"
        if code != 0:
            with open(os.path.join(running.folder, "stderr"), errors="replace") as f:
                stderr = f.read()
            raise RuntimeError(
                f"`auto_plan` could not compile on {running.count} CPU devices in a "
                f"subprocess (exit {code}):\n{stderr[-2000:]}\nPass a smaller "
                "`compile_limit` to estimate these meshes from smaller ones instead."
            )
        with open(os.path.join(running.folder, "out.json")) as f:
            results: list[Any] = json.load(f)
    finally:
        shutil.rmtree(running.folder, ignore_errors=True)
    return [
        measurement(SimpleNamespace(**r["memory"]), r["flops"], r["hlo"], shape)
        for r, shape in zip(results, running.shapes, strict=True)
    ]


def compile_all(
    problem: Problem, work: Sequence[tuple[Placed, dict[str, int]]]
) -> list[Measurement]:
    """Measurements of each `(placed on an AbstractMesh, mesh shape)`, in order, one
    subprocess per device count."""
    by_count: dict[int, list[int]] = {}
    for k, (_, shape) in enumerate(work):
        by_count.setdefault(math.prod(shape.values()), []).append(k)
    out: dict[int, Measurement] = {}
    for indices in by_count.values():
        found = finish(start(problem, [work[k] for k in indices]))
        out.update(zip(indices, found, strict=True))
    return [out[k] for k in range(len(work))]
