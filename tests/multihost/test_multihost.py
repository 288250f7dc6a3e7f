"""Real multi-host runs: 2 processes x 4 CPU devices on 127.0.0.1 (gloo collectives).

Each group of scenarios in `worker.py` is one pair of processes; each scenario is one
test here, which passes when both processes report it passed. A group runs once per
pytest session, also under pytest-xdist: the first test of a group to need it runs the
pair (holding a lock file), writes every report to a JSON file, and the tests of that
group read it from there.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import eqxshard

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
# Startup is seconds; this only stops a run that hangs (e.g. processes out of step).
TIMEOUT_S = 240


def _load_worker() -> Any:
    spec = importlib.util.spec_from_file_location("eqxshard_multihost_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_worker = _load_worker()
NUM_PROCESSES: int = _worker.NUM_PROCESSES
SCENARIOS: dict[str, dict[str, Any]] = _worker.SCENARIOS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    """The environment without JAX/XLA settings of the parent, CPU only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    # The workers import the eqxshard this test session imports.
    root = str(Path(eqxshard.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def run_group(group: str, workdir: Path) -> dict[str, Any]:
    """Runs `group` on `NUM_PROCESSES` processes; returns their reports and output."""
    port = _free_port()
    env = _child_env()
    procs, logs = [], []
    try:
        for i in range(NUM_PROCESSES):
            out = open(workdir / f"{group}-{i}.out", "w+")
            err = open(workdir / f"{group}-{i}.err", "w+")
            logs.append((out, err))
            command = [sys.executable, str(WORKER), str(port), str(i), str(NUM_PROCESSES), group]
            procs.append(subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=HERE))
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for p in procs:  # only the processes started here
            if p.poll() is None:
                p.kill()
                p.wait()
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


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory all pytest-xdist workers of this session share."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "multihost"
    path.mkdir(exist_ok=True)
    return path


def group_results(group: str, shared_dir: Path) -> dict[str, Any]:
    with open(shared_dir / f"{group}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        cached = shared_dir / f"{group}.json"
        if not cached.exists():
            cached.write_text(json.dumps(run_group(group, shared_dir)))
        return json.loads(cached.read_text())


CASES = [(group, name) for group, names in SCENARIOS.items() for name in names]


@pytest.mark.parametrize(("group", "name"), CASES, ids=[f"{g}-{n}" for g, n in CASES])
def test_scenario_passes_on_every_process(group: str, name: str, shared_dir: Path) -> None:
    run = group_results(group, shared_dir)
    reports = run["reports"].get(name, {})
    problems = []
    for process in range(NUM_PROCESSES):
        report = reports.get(str(process))
        if report is None:
            problems.append(
                f"process {process} gave no report (timed out: {run['timed_out']}, "
                f"return codes {run['returncodes']}); its stderr ends with:\n"
                f"{run['stderr'][process]}"
            )
        elif not report["ok"]:
            problems.append(f"process {process} failed:\n{report['error']}")
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def test_every_group_exits_cleanly(shared_dir: Path) -> None:
    for group in SCENARIOS:
        run = group_results(group, shared_dir)
        assert not run["timed_out"], f"{group}: timed out; stderr: {run['stderr']}"
        assert run["returncodes"] == [0] * NUM_PROCESSES, f"{group}: {run['stderr']}"
        assert set(run["reports"]) == set(SCENARIOS[group]), f"{group}: {run['reports'].keys()}"
