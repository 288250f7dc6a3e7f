"""How this process was started, read from its environment: what `initialize` passes to
`jax.distributed.initialize`, and how many processes the launcher says the run has.

JAX detects Slurm, Open MPI 4 (`OMPI_MCA_orte_hnp_uri`), Kubernetes and Cloud TPU pods
by itself. It does not detect Open MPI 5 (PRRTE no longer sets `OMPI_MCA_orte_hnp_uri`)
nor MPICH's hydra: under those, `jax.distributed.initialize()` finds nothing, and every
process trains alone without a word. Here both are read from the variables their
launchers set, and passed through `jax.distributed.initialize`'s public arguments.

The coordinator of an MPI run (process 0 hosts it; every process must name the same
`host:port`) is chosen so that every process agrees without talking to the others:

- `JAX_COORDINATOR_ADDRESS`, if set (e.g. `mpirun -x JAX_COORDINATOR_ADDRESS=node0:1234`);
- all processes on this node (the launcher's local size equals its world size):
  `127.0.0.1`, on the port `JAX_COORDINATOR_PORT`, else on a port derived from an id of
  the job that every process of it sees: Open MPI 5's `PMIX_NAMESPACE` (it names the
  `mpirun` host and process id), MPICH's `hydra_pmi_proxy` process (its id and this
  host's name). As JAX does for Slurm, the port is in 61440-65535;
- processes on several nodes: rank 0's host is in no variable, so mpi4py (if installed)
  tells it (JAX's `cluster_detection_method="mpi4py"`); else it is an error saying to
  set `JAX_COORDINATOR_ADDRESS`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import zlib
from collections.abc import Mapping
from typing import Any

from .. import _compat

# What `python -m eqxshard.launch` sets for each process it starts (besides JAX's own
# `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_CPU_DEVICES`, `JAX_PLATFORMS`, ...).
PROCESS_ID_VAR = "EQXSHARD_PROCESS_ID"
NUM_PROCESSES_VAR = "EQXSHARD_NUM_PROCESSES"
COORDINATOR_VAR = "JAX_COORDINATOR_ADDRESS"
PORT_VAR = "JAX_COORDINATOR_PORT"
LOCAL_DEVICE_IDS_VAR = "JAX_LOCAL_DEVICE_IDS"
# Also set by the launcher: the bounds `initialize` uses where its arguments are `None`,
# the run's hosts and processes per host (for the lines naming a lost peer), and how
# many times the run was restarted before this attempt.
HEARTBEAT_TIMEOUT_VAR = "EQXSHARD_HEARTBEAT_TIMEOUT"
INITIALIZATION_TIMEOUT_VAR = "EQXSHARD_INITIALIZATION_TIMEOUT"
HOSTS_VAR = "EQXSHARD_HOSTS"
PROCESSES_PER_HOST_VAR = "EQXSHARD_PROCESSES_PER_HOST"
RESTART_VAR = "EQXSHARD_RESTART_COUNT"
# What `initialize` writes on stderr, under the launcher, once this process joined the run:
# the launcher takes it off the output, and tells a failure at start-up from a later one.
JOINED_LINE = "eqxshard.launch: this process joined the run"

# Open MPI (4 and 5) sets these for each process `mpirun` starts; 4 also sets ORTE_URI.
OMPI_SIZE, OMPI_RANK = "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"
OMPI_LOCAL_SIZE, OMPI_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"
ORTE_URI, PMIX_NAMESPACE = "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE"
# MPICH's hydra (`mpiexec`, `mpirun`); also Intel MPI, which is built on it.
PMI_SIZE, PMI_RANK = "PMI_SIZE", "PMI_RANK"
HYDRA_LOCAL_SIZE, HYDRA_LOCAL_RANK = "MPI_LOCALNRANKS", "MPI_LOCALRANKID"
# Slurm (`srun`): what JAX's own detection reads.
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
SLURM_SIZE, SLURM_RANK = "SLURM_NTASKS", "SLURM_PROCID"

# As JAX does for Slurm and Open MPI 4: a port in the top 4096 of the ephemeral range.
PORT_BASE, PORT_RANGE = 65536 - 4096, 4096


@dataclasses.dataclass(frozen=True)
class Join:
    """How to join the run: `jax.distributed.initialize(**kwargs)`.

    - `how`: who started the run, as `initialize` returns it.
    - `expected`: the process count the launcher says, or `None` where it does not.
    - `seen`: the variables read, for error messages.
    """

    how: str
    kwargs: dict[str, Any]
    expected: int | None
    seen: dict[str, str]


def seen_str(seen: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in seen.items()) or "none"


def _int(env: Mapping[str, str], name: str, who: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"The environment variable {name}={value!r} is not an integer. It is set by "
            f"{who}; unset it to run without it."
        ) from None


def derived_port(key: str) -> int:
    """A port every process of a job derives alike from `key`, an id of the job."""
    return PORT_BASE + zlib.crc32(key.encode()) % PORT_RANGE


def hydra_proxy_pid(pid: int | None = None) -> int | None:
    """The id of the `hydra_pmi_proxy` process this process descends from (Linux only:
    read from `/proc`), or `None` where there is none or `/proc` cannot say."""
    pid = os.getpid() if pid is None else pid
    for _ in range(64):  # a bound on the depth, not a limit met in practice
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if comm == "hydra_pmi_proxy":
            return pid
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if pid <= 1:
            return None
    return None


def has_mpi4py() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def _mpi_join(env: Mapping[str, str], how: str, names: dict[str, str], job_key: Any) -> Join:
    """`names`: the variables of this launcher for size, rank, local_size, local_rank.
    `job_key`: a callable giving an id of the job every local process sees, or `None`."""
    seen = {v: env[v] for v in names.values() if v in env}
    for v in (COORDINATOR_VAR, PORT_VAR):
        if v in env:
            seen[v] = env[v]
    size = _int(env, names["size"], how)
    rank = _int(env, names["rank"], how)
    local_size = _int(env, names["local_size"], how) if names["local_size"] in env else None
    local_rank = _int(env, names["local_rank"], how) if names["local_rank"] in env else None
    kwargs: dict[str, Any] = {"num_processes": size, "process_id": rank}
    # As JAX does under Slurm and Open MPI 4: one accelerator per process when several
    # share a node (ignored on the CPU); JAX_LOCAL_DEVICE_IDS, if set, decides instead.
    if local_rank is not None and (local_size or 0) > 1 and LOCAL_DEVICE_IDS_VAR not in env:
        kwargs["local_device_ids"] = [local_rank]
    if COORDINATOR_VAR in env:
        kwargs["coordinator_address"] = env[COORDINATOR_VAR]
    elif local_size == size:
        if PORT_VAR in env:
            port = _int(env, PORT_VAR, "you (or JAX's documentation)")
        else:
            key = job_key()
            if key is None:
                raise ValueError(
                    f"`initialize` found a run of {size} processes started by {how}'s "
                    f"launcher ({seen_str(seen)}), but no id of the job to derive the "
                    f"coordinator's port from. Set {PORT_VAR} (a free port, the same for "
                    f"every process), e.g. `mpiexec -genv {PORT_VAR} 12345 ...`."
                )
            seen["job id"] = key
            port = derived_port(key)
        kwargs["coordinator_address"] = f"127.0.0.1:{port}"
    elif has_mpi4py():
        # JAX's opt-in detection: rank 0 tells every process its host over MPI.
        return Join(f"{how} (mpi4py)", {"cluster_detection_method": "mpi4py"}, size, seen)
    else:
        raise ValueError(
            f"`initialize` found a run of {size} processes started by {how}'s launcher "
            f"on several nodes ({seen_str(seen)}), but no variable names the host of "
            "process 0, which every process must connect to. Set "
            "JAX_COORDINATOR_ADDRESS=HOST:PORT for every process (HOST: the node of rank 0, "
            "the first of your host list; PORT: a free port), e.g. "
            "`mpirun -x JAX_COORDINATOR_ADDRESS=node0:12345 ...`; or "
            "`pip install mpi4py` (built for this MPI), which JAX then asks."
        )
    # Everything is given: JAX must not fill the rest from another cluster's variables
    # (e.g. Slurm's, inherited by `mpirun` inside an allocation).
    if "local_device_ids" not in kwargs and LOCAL_DEVICE_IDS_VAR not in env:
        kwargs["cluster_detection_method"] = "deactivate"
    return Join(how, kwargs, size, seen)


def _slurm_agrees(env: Mapping[str, str], size_var: str, rank_var: str) -> bool:
    """Whether Slurm's variables describe the same processes as an MPI launcher's
    (`srun --mpi=pmi2`), rather than being inherited by `mpirun` inside an allocation."""
    return all(v in env for v in SLURM_VARS) and (env[SLURM_SIZE], env[SLURM_RANK]) == (
        env[size_var],
        env[rank_var],
    )


def _hydra_key() -> str | None:
    pid = hydra_proxy_pid()
    return None if pid is None else f"{socket.gethostname()}:{pid}"


def detect(env: Mapping[str, str] | None = None) -> Join | None:
    """How this process joins a run, from `env` (default `os.environ`); `None`: alone.

    In this order: `python -m eqxshard.launch`; Open MPI's `mpirun` (4 through JAX,
    5 here); MPICH's hydra (unless Slurm started the same processes); a cluster JAX
    detects itself (Slurm, Kubernetes, Cloud TPU pods); `JAX_COORDINATOR_ADDRESS` by hand.
    MPI's variables come before Slurm's: `mpirun` inside a Slurm allocation inherits the
    allocation's `SLURM_*`, which do not describe its processes.
    """
    env = os.environ if env is None else env
    if PROCESS_ID_VAR in env or NUM_PROCESSES_VAR in env:
        names = (PROCESS_ID_VAR, NUM_PROCESSES_VAR, COORDINATOR_VAR)
        missing = [v for v in names if v not in env]
        if missing:
            raise ValueError(
                f"`initialize` found some of the variables `python -m eqxshard.launch` sets "
                f"but not {', '.join(missing)}. Start the script with the launcher, or unset "
                f"{PROCESS_ID_VAR} and {NUM_PROCESSES_VAR}."
            )
        who = "`python -m eqxshard.launch`"
        size = _int(env, NUM_PROCESSES_VAR, who)
        kwargs = {
            "coordinator_address": env[COORDINATOR_VAR],
            "num_processes": size,
            "process_id": _int(env, PROCESS_ID_VAR, who),
        }
        return Join("eqxshard.launch", kwargs, size, {v: env[v] for v in names})
    if OMPI_SIZE in env and OMPI_RANK in env:
        if ORTE_URI in env:  # Open MPI 4: JAX reads it itself, and knows rank 0's host
            seen = {v: env[v] for v in (OMPI_SIZE, OMPI_RANK, ORTE_URI)}
            size = _int(env, OMPI_SIZE, "Open MPI's `mpirun`")
            return Join("OmpiCluster", {"cluster_detection_method": "ompi"}, size, seen)
        names = {
            "size": OMPI_SIZE,
            "rank": OMPI_RANK,
            "local_size": OMPI_LOCAL_SIZE,
            "local_rank": OMPI_LOCAL_RANK,
        }
        return _mpi_join(env, "Open MPI", names, lambda: env.get(PMIX_NAMESPACE))
    if PMI_SIZE in env and PMI_RANK in env and not _slurm_agrees(env, PMI_SIZE, PMI_RANK):
        names = {
            "size": PMI_SIZE,
            "rank": PMI_RANK,
            "local_size": HYDRA_LOCAL_SIZE,
            "local_rank": HYDRA_LOCAL_RANK,
        }
        return _mpi_join(env, "MPICH", names, _hydra_key)
    if env is os.environ and (cluster := _compat.detected_cluster()) is not None:
        seen = {v: env[v] for v in SLURM_VARS if v in env}
        expected = None
        if cluster == "SlurmCluster" and SLURM_SIZE in env:
            expected = _int(env, SLURM_SIZE, "Slurm's `srun`")
        return Join(cluster, {}, expected, seen)
    if COORDINATOR_VAR in env:  # set by hand: JAX reads it (and says what else it needs)
        return Join(COORDINATOR_VAR, {}, None, {COORDINATOR_VAR: env[COORDINATOR_VAR]})
    return None
