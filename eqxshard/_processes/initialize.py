"""`initialize`: join a multi-process run, as the one first call of a training script.

What the environment says about the run is read in `clusters.py` (`python -m
eqxshard.launch`, Open MPI 4 and 5, MPICH, Slurm, Kubernetes, Cloud TPU pods, or one
process); here it is passed to `jax.distributed.initialize`, and the process count the
run ends up with is checked against the one the launcher said.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax

from . import addresses, clusters, joining
from .clusters import (
    COORDINATOR_VAR as COORDINATOR_VAR,
    NUM_PROCESSES_VAR as NUM_PROCESSES_VAR,
    PROCESS_ID_VAR as PROCESS_ID_VAR,
)
from .exits import end_promptly_on_errors


def _check_count(join: clusters.Join) -> None:
    """Raises unless the run has the process count its launcher said."""
    if join.expected is None or jax.process_count() == join.expected:
        return
    raise RuntimeError(
        f"`initialize` joined a run of {jax.process_count()} processes, but the environment "
        f"says {join.expected} ({join.how}; variables seen: {clusters.seen_str(join.seen)}). "
        "Each process is training with a different set of processes than the launcher "
        "started. Call `eqxshard.initialize()` before any other JAX call and no "
        "`jax.distributed.initialize` of your own; or, where the variables are stale "
        "(inherited from another job), unset them."
    )


def _check_arguments(
    initialization_timeout: Any,
    heartbeat_timeout_seconds: Any,
    shutdown_timeout_seconds: Any,
    exit_on_error: Any,
) -> None:
    """The checks of `initialize`'s own arguments, before anything is joined."""
    for name, value in (
        ("initialization_timeout", initialization_timeout),
        ("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
        ("shutdown_timeout_seconds", shutdown_timeout_seconds),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"`initialize` takes `{name}` as an int number of seconds or None, but got "
                f"{type(value).__name__} {value!r}."
            )
        if value < 1:
            raise ValueError(
                f"`initialize` takes `{name}` >= 1 second, but got {value}. Pass `None` for "
                "JAX's default."
            )
    if not isinstance(exit_on_error, bool):
        raise TypeError(
            f"`initialize` takes `exit_on_error` as a bool, but got {type(exit_on_error).__name__}."
        )


def initialize(
    *,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int | None = None,
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

    In a run of several processes, when the run loses a process (its node cut off,
    killed, stopped for longer than the heartbeat timeout, or never started), JAX ends
    every other process with a native abort and its own text. `initialize` routes
    stderr through a small watcher process that passes everything on unchanged and,
    after such text, adds one line: `eqxshard: process 0 on node1 lost process 1 (host
    node2, address 10.0.0.2): it stopped sending heartbeats for 10 s ... The newest
    complete checkpoint is step 40 in /ckpt. ...` (`EQXSHARD_WATCH=0` turns it off).
    Where this host's name resolves to a loopback address (Debian and Ubuntu's
    `/etc/hosts`) on a run across hosts, gloo's CPU collectives are given the address of
    the interface that reaches the other hosts instead (a line on stderr says so).

    In a run of several processes, with `exit_on_error=True`, a process that fails ends
    at once: an uncaught exception with exit code 1 (after printing the traceback), and
    `sys.exit(n)` or `raise SystemExit(n)` with n != 0 with code n (after printing a
    message given instead of a code). Without it, the process would wait at exit in
    JAX's shutdown barrier for the others, which wait for it in their next collective:
    the whole run hangs until JAX's timeouts (minutes), and then ends with the wrong
    code. Ended at once, the others stop too: `python -m eqxshard.launch` ends them and
    exits with this process's code, and under any other launcher they exit with an error
    after `heartbeat_timeout_seconds`. `sys.exit(0)` and the end of the script wait for
    the others as usual. On Python 3.11, which has no `sys.monitoring`, `sys.exit(n)` is
    covered everywhere (`initialize` replaces `sys.exit` there) and `raise SystemExit(n)`
    written out only in processes started by `python -m eqxshard.launch` (which runs the
    script through a small runner that sees it); under other launchers it waits as above.
    `os._exit(n)` ends the process at once anyway.

    **Arguments:**

    - `initialization_timeout`: seconds to wait for every process to join; a process
      that never joins ends the others after it. `None` takes the launcher's
      `--initialization-timeout`, else JAX's default (300).
    - `heartbeat_timeout_seconds`: seconds without a heartbeat after which a process is
      taken as lost; every other process then ends with an error ("the JAX distributed
      service detected fatal errors", and eqxshard's line naming the lost process)
      instead of waiting for it. It also bounds a collective stuck on a lost peer (JAX
      has no timeout of its own for those). `None` takes the launcher's
      `--heartbeat-timeout`, else JAX's default (100).
    - `shutdown_timeout_seconds`: seconds the processes wait for each other when the
      script ends. `None` keeps JAX's default (300).
    - `exit_on_error`: end this process at once on an uncaught exception or an uncaught
      non-zero `SystemExit` (see above), by setting `sys.excepthook` and watching for
      `SystemExit` leaving the program with `sys.monitoring` (Python 3.12+; on 3.11, by
      setting `sys.exit` to one that raises a `SystemExit` all the same, which
      `except SystemExit` catches). Such an exit skips `atexit`
      handlers: a checkpoint still being written in the background is not finished (it
      says so on stderr; the one before it stays the newest).

    **Returns:**

    How the run was joined: `"eqxshard.launch"`, `"Open MPI"` (5; `mpirun`),
    `"MPICH"` (`mpiexec`; either with `" (mpi4py)"` where mpi4py told the coordinator),
    the name of the cluster JAX detected (`"SlurmCluster"`, `"OmpiCluster"` for Open MPI
    4, `"K8sCluster"`, ...), `"JAX_COORDINATOR_ADDRESS"`, `"already initialized"` or
    `"single process"`.

    **Raises:**

    - `TypeError`: if an argument has the wrong type.
    - `ValueError`: if a timeout is < 1; if the launcher's variables are not integers, or
      `JAX_COORDINATOR_ADDRESS` is missing beside them; if an MPI run spans several nodes
      and neither `JAX_COORDINATOR_ADDRESS` nor mpi4py says where process 0 is; if an MPI
      run on one node has no job id to derive the port from and no `JAX_COORDINATOR_PORT`.
    - `RuntimeError`: if the run has another process count than the environment says
      (the variables seen are in the message).
    - `RuntimeError`: from JAX, if a JAX computation already ran in this process.
    - `RuntimeError`: on process 0, if the coordinator's port is taken.
    """
    _check_arguments(
        initialization_timeout, heartbeat_timeout_seconds, shutdown_timeout_seconds, exit_on_error
    )
    if jax.distributed.is_initialized():
        return "already initialized"
    join = clusters.detect()
    if join is None:
        return "single process"
    timeouts: dict[str, Any] = {}
    for name, value in (
        ("initialization_timeout", initialization_timeout),
        ("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
        ("shutdown_timeout_seconds", shutdown_timeout_seconds),
    ):
        value = joining.launcher_timeout(name, value)
        if value is not None:
            timeouts[name] = value
    address = join.kwargs.get("coordinator_address") or os.environ.get(clusters.COORDINATOR_VAR)
    # JAX cannot start the coordinator on a taken port: it raises a bare "Failed to start
    # RPC server", or crashes (SIGSEGV). Say so first.
    taken = (
        f"`initialize` could not start the coordinator of the run (process 0) at {address}: "
        "its port is taken (by another program, or a run before this one that still holds "
        f"it). Pick a free port (the launcher's `--port`, or `{clusters.COORDINATOR_VAR}`), "
        "or end what holds it."
    )
    if join.kwargs.get("process_id") == 0 and address and addresses.port_taken(address):
        raise RuntimeError(taken)
    joining.before(join, timeouts)
    try:
        jax.distributed.initialize(**join.kwargs, **timeouts)
    except Exception as e:
        if "Failed to start RPC server" in str(e):
            raise RuntimeError(taken) from e
        raise
    _check_count(join)
    if join.how == "eqxshard.launch" and clusters.RESTART_VAR in os.environ:
        print(clusters.JOINED_LINE, file=sys.stderr, flush=True)  # for the launcher only
    if jax.process_count() > 1:
        joining.after()
        if exit_on_error:
            end_promptly_on_errors()
    return join.how
