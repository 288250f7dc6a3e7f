"""Checkpoints across process counts: bit-exact round trips between 1 process x 8 CPU
devices (this pytest process) and 2 processes x 4 CPU devices (`checkpoint_worker.py`).

(a) This process saves checkpoint A on a (8,) mesh; the two workers restore it on a
    (2, 4) mesh spanning both of them.
(b) The workers save checkpoint B from both processes; this process restores it on all
    8 devices and on a 4-device mesh.

One pair of workers runs per pytest session, also under pytest-xdist (see
`harness.run_once`); each worker scenario is one test here, which passes when both
processes report it passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest
from harness import (
    HERE,
    check_clean_exit,
    check_listed,
    check_scenario,
    load_worker,
    run_once,
    run_workers,
)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from worker_common import NUM_PROCESSES

import eqxshard
from eqxshard import filter_restore, filter_save, latest_step

WORKER = HERE / "checkpoint_worker.py"
worker = load_worker(WORKER, "eqxshard_checkpoint_worker")
SCENARIOS = list(worker.SCENARIOS)


def _save_a_and_run_workers(workdir: Path) -> dict[str, Any]:
    # Checkpoint A: one process, 8 devices, fsdp over a (8,) mesh.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    model = eqxshard.filter_shard(
        worker.make_model(jax.random.key(1)), mesh, eqxshard.fsdp("data", min_size=0)
    )
    filter_save(workdir / "a", 0, model)
    np.savez(workdir / "a.npz", **worker.as_numpy(model))
    run = run_workers(WORKER, NUM_PROCESSES, workdir, "", str(workdir))
    return {"workdir": str(workdir), **run}


@pytest.fixture(scope="session")
def run(multihost_dir: Path) -> dict[str, Any]:
    workdir = multihost_dir / "checkpoint"
    workdir.mkdir(exist_ok=True)
    return run_once(workdir, "run", lambda: _save_a_and_run_workers(workdir))


def test_worker_runs_the_listed_scenarios() -> None:
    check_listed(WORKER, SCENARIOS)
    assert len(SCENARIOS) == 4


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_passes_on_every_process(name: str, run: dict[str, Any]) -> None:
    check_scenario(run, name, NUM_PROCESSES)


def test_processes_exit_cleanly(run: dict[str, Any]) -> None:
    check_clean_exit(run, NUM_PROCESSES)


@pytest.mark.parametrize("devices", [8, 4])
def test_restore_in_one_process_what_two_saved(devices: int, run: dict[str, Any]) -> None:
    """Checkpoint B, saved from 2 processes x 4 devices, read here on `devices` devices."""
    workdir = Path(run["workdir"])
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


@pytest.mark.heavy
def test_restore_in_four_processes_what_two_saved(run: dict[str, Any]) -> None:
    """Checkpoint B, saved from 2 processes, read by 4 processes x 4 devices."""
    workdir = Path(run["workdir"])
    if not (workdir / "b.npz").exists():
        pytest.fail(f"the workers wrote no checkpoint B; their stderr: {run['stderr']}")
    four = run_workers(HERE / "restore4_worker.py", 4, workdir, "r4-", str(workdir))
    check_scenario(four, "restore_on_four_processes", 4)
    check_clean_exit(four, 4)
