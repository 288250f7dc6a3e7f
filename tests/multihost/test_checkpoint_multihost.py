"""Checkpoints across process counts: bit-exact round trips between 1 process x 8 CPU
devices (this pytest process) and 2 processes x 4 CPU devices (`checkpoint_worker.py`).

(a) This process saves checkpoint A on a (8,) mesh; the two workers restore it on a
    (2, 4) mesh spanning both of them.
(b) The workers save checkpoint B from both processes; this process restores it on all
    8 devices and on a 4-device mesh.

One pair of workers runs per pytest session (module fixture); each worker scenario is
one test here, which passes when both processes report it passed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard._checkpoint import filter_restore, filter_save, latest_step

HERE = Path(__file__).resolve().parent
WORKER = HERE / "checkpoint_worker.py"
# Startup is seconds; this only stops a run that hangs (e.g. processes out of step).
TIMEOUT_S = 240


def _load_worker() -> Any:
    spec = importlib.util.spec_from_file_location("eqxshard_checkpoint_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses (the worker's `eqx.Module`) look their module up in `sys.modules`.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


worker = _load_worker()
NUM_PROCESSES: int = worker.NUM_PROCESSES
SCENARIOS = list(worker.SCENARIOS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    """The environment without JAX/XLA settings of the parent, CPU only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(eqxshard.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _run_workers(workdir: Path) -> dict[str, Any]:
    port, env = _free_port(), _child_env()
    procs, logs = [], []
    try:
        for i in range(NUM_PROCESSES):
            out = open(workdir / f"{i}.out", "w+")
            err = open(workdir / f"{i}.err", "w+")
            logs.append((out, err))
            command = [
                sys.executable,
                str(WORKER),
                str(port),
                str(i),
                str(NUM_PROCESSES),
                str(workdir),
            ]
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
    reports: dict[str, dict[int, Any]] = {}
    stderr = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        for line in out:
            if line.startswith("{"):
                report = json.loads(line)
                reports.setdefault(report["scenario"], {})[report["process"]] = report
        stderr.append(err.read()[-3000:])
        out.close()
        err.close()
    return {
        "reports": reports,
        "returncodes": [p.returncode for p in procs],
        "timed_out": timed_out,
        "stderr": stderr,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("checkpoint_multihost")
    # Checkpoint A: one process, 8 devices, fsdp over a (8,) mesh.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    model = eqxshard.filter_shard(
        worker.make_model(jax.random.key(1)), mesh, eqxshard.fsdp("data", min_size=0)
    )
    filter_save(workdir / "a", 0, model)
    np.savez(workdir / "a.npz", **worker.as_numpy(model))
    return {"workdir": workdir, **_run_workers(workdir)}


def test_worker_runs_the_listed_scenarios() -> None:
    text = WORKER.read_text()
    assert all(f"def {name}(" in text for name in SCENARIOS)
    assert text.count("@scenario") == len(SCENARIOS) == 4


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_passes_on_every_process(name: str, run: dict[str, Any]) -> None:
    reports = run["reports"].get(name, {})
    problems = []
    for process in range(NUM_PROCESSES):
        report = reports.get(process)
        if report is None:
            problems.append(
                f"process {process} gave no report (timed out: {run['timed_out']}, return "
                f"codes {run['returncodes']}); its stderr ends with:\n{run['stderr'][process]}"
            )
        elif not report["ok"]:
            problems.append(f"process {process} failed:\n{report['error']}")
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def test_processes_exit_cleanly(run: dict[str, Any]) -> None:
    assert not run["timed_out"], run["stderr"]
    assert run["returncodes"] == [0] * NUM_PROCESSES, run["stderr"]


@pytest.mark.parametrize("devices", [8, 4])
def test_restore_in_one_process_what_two_saved(devices: int, run: dict[str, Any]) -> None:
    """Checkpoint B, saved from 2 processes x 4 devices, read here on `devices` devices."""
    workdir = run["workdir"]
    if not (workdir / "b.npz").exists():
        pytest.fail(f"the workers wrote no checkpoint B; their stderr: {run['stderr']}")
    assert latest_step(workdir / "b") == 2
    shape = (devices,) if devices == 8 else (2, 2)
    names = ("data",) if devices == 8 else ("data", "model")
    mesh = jax.make_mesh(
        shape, names, axis_types=(AxisType.Explicit,) * len(shape), devices=jax.devices()[:devices]
    )
    like = eqx.filter_eval_shape(worker.make_model, jax.random.key(0))
    out = filter_restore(workdir / "b", like, mesh, P("data"), step=1)
    for leaf in (out.weight, out.bias, out.count, out.keys):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), leaf.ndim)
        assert leaf.sharding.device_set == set(jax.devices()[:devices])
    worker.check_types(out, like, f"B on {devices} devices")
    worker.check_bit_exact(out, dict(np.load(workdir / "b.npz")), f"B on {devices} devices")
