"""The pytest side of the multi-host tests: start worker processes, collect their reports.

Each worker process (see `worker_common.py`) prints one JSON line per scenario:
`{"scenario": name, "process": id, "ok": bool, "error": traceback or null, ...}`.
`run_workers` starts them on 127.0.0.1 and gathers those lines; `run_once` makes a run
once per pytest session, also under pytest-xdist: the first test to need it makes it
(holding a lock file) and caches it as JSON, and every later test reads it from there.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import eqxshard

HERE = Path(__file__).resolve().parent
# Startup is seconds; this only stops a run that hangs (e.g. processes out of step).
TIMEOUT_S = 240


def load_worker(path: Path, name: str) -> ModuleType:
    """Imports the worker script `path` as module `name` (registered in `sys.modules`:
    dataclasses, such as a worker's `eqx.Module`, look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(*, cpu: bool = True) -> dict[str, str]:
    """This environment without JAX/XLA settings, importing the eqxshard under test;
    with `cpu`, JAX on CPU only."""
    # Imported here: the scripts that import this module run where tests/ is not on the path.
    from helpers import without_jax_settings

    env = without_jax_settings(os.environ)
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(eqxshard.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def own_processes() -> Iterator[list[subprocess.Popen[Any]]]:
    """A list for the processes started here; on leaving, any of them still running is
    killed (only those, nothing else)."""
    procs: list[subprocess.Popen[Any]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_workers(
    worker: Path, num_processes: int, workdir: Path, prefix: str, *args: str
) -> dict[str, Any]:
    """Runs `worker PORT PROCESS_ID NUM_PROCESSES *args` on `num_processes` processes
    (output in `workdir/{prefix}{i}.out|err`); returns their reports and how they ended.

    `reports[scenario][str(process id)]` is that process's report of that scenario.
    """
    port, env = free_port(), child_env()
    logs = []
    with own_processes() as procs:
        for i in range(num_processes):
            out = open(workdir / f"{prefix}{i}.out", "w+")
            err = open(workdir / f"{prefix}{i}.err", "w+")
            logs.append((out, err))
            command = [sys.executable, str(worker), str(port), str(i), str(num_processes), *args]
            procs.append(subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=HERE))
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    reports: dict[str, dict[str, Any]] = {}
    stderr = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        for line in out:
            if line.startswith("{"):
                report = json.loads(line)
                reports.setdefault(report["scenario"], {})[str(report["process"])] = report
        stderr.append(err.read()[-3000:])
        out.close()
        err.close()
    return {
        "reports": reports,
        "returncodes": [p.returncode for p in procs],
        "timed_out": timed_out,
        "stderr": stderr,
    }


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """The directory `name` that every pytest-xdist worker of this session shares."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(exist_ok=True)
    return path


def run_once(directory: Path, name: str, make: Callable[[], Any]) -> Any:
    """`make()`, made once per session: cached as `directory/{name}.json` under a lock."""
    with open(directory / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        cached = directory / f"{name}.json"
        if not cached.exists():
            cached.write_text(json.dumps(make()))
        return json.loads(cached.read_text())


def run_scenarios(directory: Path, tag: str, worker: Path, num_processes: int) -> Any:
    """The workers of `worker` run once per session, each process every scenario in turn;
    their reports are cached under `directory` as `tag`."""
    return run_once(
        directory, tag, lambda: run_workers(worker, num_processes, directory, f"{tag}-")
    )


def check_listed(worker: Path, scenarios: list[str]) -> None:
    """Fails unless `worker` defines exactly `scenarios`, each under `@scenario`."""
    text = worker.read_text()
    missing = [name for name in scenarios if f"def {name}(" not in text]
    assert not missing, f"{worker.name} lacks {missing}"
    assert text.count("@scenario") == len(scenarios), f"{worker.name} has unlisted scenarios"


def check_scenario(run: dict[str, Any], name: str, num_processes: int) -> None:
    """Fails the test unless every process reported scenario `name` passed."""
    reports = run["reports"].get(name, {})
    problems = []
    for process in range(num_processes):
        report = reports.get(str(process))
        if report is None:
            problems.append(
                f"process {process} gave no report (timed out: {run['timed_out']}, return "
                f"codes {run['returncodes']}); its stderr ends with:\n{run['stderr'][process]}"
            )
        elif not report["ok"]:
            problems.append(f"process {process} failed:\n{report['error']}")
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def check_clean_exit(run: dict[str, Any], num_processes: int, what: str = "") -> None:
    """Fails the test unless every process of `run` exited with 0 in time."""
    assert not run["timed_out"], f"{what}timed out; stderr: {run['stderr']}"
    assert run["returncodes"] == [0] * num_processes, f"{what}{run['stderr']}"
