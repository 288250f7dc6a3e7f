"""Every test runs with 8 CPU devices; warnings are errors (see pyproject.toml)."""

import os
from pathlib import Path

import jax
import pytest

# Before JAX initialises its backends: 8 CPU devices on this one machine.
jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# JAX's persistent compilation cache, for these processes and those the tests start
# (examples, notebooks, docs pages, multi-process runs: they inherit the variables): a
# program compiled once is loaded, not compiled again, by the next test or process that
# builds it, in this run or a later one. `JAX_COMPILATION_CACHE_DIR=` (empty) turns it
# off. Entries are keyed by the program and the JAX version, so one folder serves every
# venv. JAX writes an entry unlocked: a process that reads one while another writes it
# warns and compiles instead, which is only a miss (so that warning is ignored, here by
# pyproject.toml's filterwarnings, in the processes started by PYTHONWARNINGS).
# `auto_plan`'s disk cache is off in the tests and the processes they start (a test of it
# passes its own `cache_dir=`): nothing is written under the home folder.
os.environ.setdefault("EQXSHARD_CACHE_DIR", "")

CACHE_DIR = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "jax")
)
CACHE_MISSES = ",".join(
    f"ignore:Error {verb} persistent compilation cache entry" for verb in ("reading", "writing")
)
if CACHE_DIR:
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if CACHE_MISSES not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(
            filter(None, [os.environ.get("PYTHONWARNINGS"), CACHE_MISSES])
        )
    jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )


# The tests CI runs once (in its tests part) and not again on the lowest and the newest
# JAX: the slow ones that are not parity tests (see tests/once.txt and .ci/once.py).
ONCE = {
    line
    for line in (Path(__file__).parent / "once.txt").read_text().splitlines()
    if line and not line.startswith("#")
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks
def pytest_collection_modifyitems(config, items):
    """Marks the tests listed in tests/once.txt `once`, and orders them: the files whose
    every test is heavy (subprocesses: notebooks, examples, launchers,
    simulated nodes) run first, then those with some heavy tests (docs pages, searches), then
    the rest; each file kept whole, in its order (its module fixtures set up once). Under
    `-n 2` the long tests start early and the many short ones fill in at the end, instead of
    one worker waiting while the other runs a minute-long page."""
    marks: dict[object, set[bool]] = {}
    for item in items:
        if item.nodeid in ONCE:
            item.add_marker(pytest.mark.once)
        module = getattr(item, "module", None)
        marks.setdefault(module, set()).add(item.get_closest_marker("heavy") is not None)
    group = {
        module: 0 if kinds == {True} else 1 if True in kinds else 2
        for module, kinds in marks.items()
    }
    items.sort(key=lambda item: group[getattr(item, "module", None)])
