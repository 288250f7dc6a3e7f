"""`initialize`: join a multi-process run, as the one first call of a training script.

It reads, in this order:
- the variables `python -m eqxshard.launch` sets for each process it starts
  (`EQXSHARD_PROCESS_ID`, `EQXSHARD_NUM_PROCESSES`, and JAX's own
  `JAX_COORDINATOR_ADDRESS`);
- a cluster JAX detects by itself (Slurm, Open MPI, Kubernetes, Cloud TPU pods);
- neither: one process, nothing to join.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import jax

from . import _compat

# What `python -m eqxshard.launch` sets for each process it starts (besides JAX's own
# `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_CPU_DEVICES`, `JAX_PLATFORMS`, ...).
PROCESS_ID_VAR = "EQXSHARD_PROCESS_ID"
NUM_PROCESSES_VAR = "EQXSHARD_NUM_PROCESSES"
COORDINATOR_VAR = "JAX_COORDINATOR_ADDRESS"


def _int_var(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"The environment variable {name}={value!r} is not an integer. It is set by "
            "`python -m eqxshard.launch`; unset it to run without the launcher."
        ) from None


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
    - in a cluster JAX detects (Slurm, Open MPI, Kubernetes, Cloud TPU pods): with no
      arguments, so that JAX reads the cluster's variables;
    - `JAX_COORDINATOR_ADDRESS` set by hand: with no arguments, so that JAX reads it;
    - none of these (e.g. `python train.py` on a laptop): nothing is called, and the run
      is one process.

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

    How the run was joined: `"eqxshard.launch"`, the name of the cluster JAX detected
    (e.g. `"SlurmCluster"`), `"JAX_COORDINATOR_ADDRESS"`, `"already initialized"` or
    `"single process"`.

    **Raises:**

    - `ValueError`: if the launcher's variables are not integers, or `JAX_COORDINATOR_ADDRESS`
      is missing beside them.
    - `RuntimeError`: from JAX, if a JAX computation already ran in this process.
    """
    if jax.distributed.is_initialized():
        return "already initialized"
    timeouts: dict[str, Any] = {}
    if initialization_timeout is not None:
        timeouts["initialization_timeout"] = initialization_timeout
    if heartbeat_timeout_seconds is not None:
        timeouts["heartbeat_timeout_seconds"] = heartbeat_timeout_seconds
    if PROCESS_ID_VAR in os.environ or NUM_PROCESSES_VAR in os.environ:
        missing = [
            v for v in (PROCESS_ID_VAR, NUM_PROCESSES_VAR, COORDINATOR_VAR) if v not in os.environ
        ]
        if missing:
            raise ValueError(
                f"`initialize` found some of the variables `python -m eqxshard.launch` sets "
                f"but not {', '.join(missing)}. Start the script with the launcher, or unset "
                f"{PROCESS_ID_VAR} and {NUM_PROCESSES_VAR}."
            )
        jax.distributed.initialize(
            coordinator_address=os.environ[COORDINATOR_VAR],
            num_processes=_int_var(NUM_PROCESSES_VAR),
            process_id=_int_var(PROCESS_ID_VAR),
            **timeouts,
        )
        how = "eqxshard.launch"
    elif (cluster := _compat.detected_cluster()) is not None:
        jax.distributed.initialize(**timeouts)
        how = cluster
    elif COORDINATOR_VAR in os.environ:  # set by hand: JAX reads it (and says what else it needs)
        jax.distributed.initialize(**timeouts)
        how = COORDINATOR_VAR
    else:
        return "single process"
    if exit_on_error and jax.process_count() > 1:
        sys.excepthook = _exit_on_uncaught
    return how
