"""`initialize`: join a multi-process run, as the one first call of a training script.

What the environment says about the run is read in `_clusters.py` (`python -m
eqxshard.launch`, Open MPI 4 and 5, MPICH, Slurm, Kubernetes, Cloud TPU pods, or one
process); here it is passed to `jax.distributed.initialize`, and the process count the
run ends up with is checked against the one the launcher said.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import jax

from . import _clusters
from ._clusters import (  # the launcher's variables, re-exported for `_launch`
    COORDINATOR_VAR as COORDINATOR_VAR,
    NUM_PROCESSES_VAR as NUM_PROCESSES_VAR,
    PROCESS_ID_VAR as PROCESS_ID_VAR,
)


def _check_count(join: _clusters.Join) -> None:
    """Raises unless the run has the process count its launcher said."""
    if join.expected is None or jax.process_count() == join.expected:
        return
    raise RuntimeError(
        f"`initialize` joined a run of {jax.process_count()} processes, but the environment "
        f"says {join.expected} ({join.how}; variables seen: {_clusters.seen_str(join.seen)}). "
        "Each process is training with a different set of processes than the launcher "
        "started. Call `eqxshard.initialize()` before any other JAX call and no "
        "`jax.distributed.initialize` of your own; or, where the variables are stale "
        "(inherited from another job), unset them."
    )


def _exit_on_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """`sys.excepthook` of a multi-process run: the traceback, then an immediate exit."""
    try:
        traceback.print_exception(kind, value, tb)
        print(
            f"eqxshard: process {jax.process_index()} ended by an uncaught "
            f"{kind.__name__}, without waiting for the other processes.",
            file=sys.stderr,
        )
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(1)


def initialize(
    *,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    exit_on_error: bool = True,
) -> str:
    """Joins this process to a multi-process run, wherever it was started.

    Call it first thing, before any JAX computation. It calls
    `jax.distributed.initialize` with what the environment says:

    - started by `python -m eqxshard.launch`: the coordinator, process count and process
      id the launcher set for this process (CPU devices and gloo collectives are set by
      the launcher through JAX's own variables);
    - started by Open MPI's `mpirun` (4 or 5) or MPICH's `mpiexec` (hydra): the process
      count and rank from `OMPI_COMM_WORLD_SIZE`/`OMPI_COMM_WORLD_RANK` or
      `PMI_SIZE`/`PMI_RANK`. The coordinator is `JAX_COORDINATOR_ADDRESS` if set; on one
      node, `127.0.0.1` on `JAX_COORDINATOR_PORT` or a port derived from the job's id
      (Open MPI's `PMIX_NAMESPACE`, MPICH's `hydra_pmi_proxy` process); on several
      nodes without `JAX_COORDINATOR_ADDRESS`, mpi4py tells it. Where several processes
      share a node, each gets one accelerator (`local_device_ids=[local rank]`, as JAX
      does under Slurm), unless `JAX_LOCAL_DEVICE_IDS` says otherwise;
    - in a cluster JAX detects (Slurm's `srun`, Kubernetes, Cloud TPU pods): with no
      arguments, so that JAX reads the cluster's variables;
    - `JAX_COORDINATOR_ADDRESS` set by hand: with no arguments, so that JAX reads it;
    - none of these (e.g. `python train.py` on a laptop): nothing is called, and the run
      is one process.

    Where the environment says how many processes the run has, the run must end up with
    that many: a process that joined a run of another size (e.g. alone) raises, instead
    of training on its own.

    A run that is already initialised is left as it is.

    In a run of several processes, an uncaught exception then ends its process at once
    (exit code 1, after printing the traceback) with `exit_on_error=True`. Without it, the
    process would wait at exit in JAX's shutdown barrier for the others, which wait for it
    in their next collective: the whole run hangs until JAX's timeouts (minutes). Ended at
    once, the others stop too: `python -m eqxshard.launch` ends them, and under any other
    launcher they exit with an error after `heartbeat_timeout_seconds`.

    **Arguments:**

    - `initialization_timeout`: seconds to wait for every process to join. `None` keeps
      JAX's default (300).
    - `heartbeat_timeout_seconds`: seconds without a heartbeat after which a process is
      taken as dead; every other process then exits with an error ("the JAX distributed
      service detected fatal errors") instead of waiting for it. `None` keeps JAX's
      default (100).
    - `exit_on_error`: end this process at once on an uncaught exception (see above),
      by setting `sys.excepthook`. Such an exit skips `atexit` handlers: a checkpoint
      still being written in the background is not finished (the one before it stays
      the newest).

    **Returns:**

    How the run was joined: `"eqxshard.launch"`, `"Open MPI"` (5; `mpirun`),
    `"MPICH"` (`mpiexec`; either with `" (mpi4py)"` where mpi4py told the coordinator),
    the name of the cluster JAX detected (`"SlurmCluster"`, `"OmpiCluster"` for Open MPI
    4, `"K8sCluster"`, ...), `"JAX_COORDINATOR_ADDRESS"`, `"already initialized"` or
    `"single process"`.

    **Raises:**

    - `ValueError`: if the launcher's variables are not integers, or `JAX_COORDINATOR_ADDRESS`
      is missing beside them; if an MPI run spans several nodes and neither
      `JAX_COORDINATOR_ADDRESS` nor mpi4py says where process 0 is; if an MPI run on one
      node has no job id to derive the port from and no `JAX_COORDINATOR_PORT`.
    - `RuntimeError`: if the run has another process count than the environment says
      (the variables seen are in the message).
    - `RuntimeError`: from JAX, if a JAX computation already ran in this process.
    """
    if jax.distributed.is_initialized():
        return "already initialized"
    timeouts: dict[str, Any] = {}
    if initialization_timeout is not None:
        timeouts["initialization_timeout"] = initialization_timeout
    if heartbeat_timeout_seconds is not None:
        timeouts["heartbeat_timeout_seconds"] = heartbeat_timeout_seconds
    join = _clusters.detect()
    if join is None:
        return "single process"
    jax.distributed.initialize(**join.kwargs, **timeouts)
    _check_count(join)
    if exit_on_error and jax.process_count() > 1:
        sys.excepthook = _exit_on_uncaught
    return join.how
