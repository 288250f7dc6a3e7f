"""`initialize`: join a multi-process run, as the one first call of a training script.

What the environment says about the run is read in `clusters.py` (`python -m
eqxshard.launch`, Open MPI 4 and 5, MPICH, Slurm, Kubernetes, Cloud TPU pods, or one
process); here it is passed to `jax.distributed.initialize`, and the process count the
run ends up with is checked against the one the launcher said.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

import jax

from . import clusters
from .clusters import (
    COORDINATOR_VAR as COORDINATOR_VAR,
    NUM_PROCESSES_VAR as NUM_PROCESSES_VAR,
    PROCESS_ID_VAR as PROCESS_ID_VAR,
)


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


def _end_now(code: int, why: str) -> None:
    """Ends this process at once with `code`, skipping JAX's shutdown barrier (which would
    wait for processes that themselves wait for this one in a collective)."""
    try:
        from .._checkpoint.async_save import unfinished_saves

        for save in unfinished_saves():
            print(
                f"eqxshard: the background save of step {save.step} to {save.directory} is "
                "NOT finished (the process ends at once on an error).",
                file=sys.stderr,
            )
        print(
            f"eqxshard: process {jax.process_index()} ended by {why} (exit code {code}), "
            "without waiting for the other processes.",
            file=sys.stderr,
        )
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(code)


def _exit_on_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """`sys.excepthook` of a multi-process run: the traceback, then an immediate exit."""
    try:
        traceback.print_exception(kind, value, tb)
    finally:
        _end_now(1, f"an uncaught {kind.__name__}")


def _status_code(status: Any) -> int:
    """The exit code Python gives `sys.exit(status)` (a message is printed, code 1)."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    return 1


class _Exit(SystemExit):
    """What `sys.exit` raises in a multi-process run: a `SystemExit` like any other
    (catchable, same `code`), except when it reaches the top of the program with a
    non-zero code: Python reads `code` then, with no Python frame left on the stack, and
    the process ends at once instead of waiting in JAX's shutdown barrier."""

    @property
    def code(self) -> Any:  # pyright: ignore[reportIncompatibleVariableOverride]
        status = self.__dict__.get("_code", self.args[0] if len(self.args) == 1 else None)
        if len(self.args) > 1 and "_code" not in self.__dict__:
            status = self.args
        frame = sys._getframe()
        if frame.f_back is None and _status_code(status) != 0:
            if not isinstance(status, int):
                print(status, file=sys.stderr)
            _end_now(_status_code(status), f"SystemExit({status!r})")
        return status

    @code.setter
    def code(self, value: Any) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        self.__dict__["_code"] = value


def _exit(status: Any = None) -> None:
    raise _Exit(status)


_exit.__doc__ = sys.exit.__doc__


def _watch_system_exit() -> bool:
    """On Python 3.12+, ends this process at once when a `SystemExit` with a non-zero code
    leaves the outermost Python frame of the main thread (nothing can catch it there):
    `sys.exit(n)` and `raise SystemExit(n)` alike, with `sys.exit` left as it is.

    Uses `sys.monitoring`'s `PY_UNWIND` event (a global event: the callback returns at
    once for every frame but the outermost). Returns whether it is installed: not on
    Python 3.11, off the main thread, or when every free tool id is taken.
    """
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None or threading.current_thread() is not threading.main_thread():
        return False
    frame = sys._getframe()
    while frame.f_back is not None:
        frame = frame.f_back
    outermost = frame.f_code
    for tool in (4, 3):  # the ids `sys.monitoring` leaves to tools other than its named ones
        if monitoring.get_tool(tool) is None:
            break
    else:
        return False
    events = monitoring.events

    def unwind(code: Any, offset: int, exception: BaseException) -> Any:
        if code is not outermost or not isinstance(exception, SystemExit):
            return None
        end_on_system_exit(exception.code)

    monitoring.use_tool_id(tool, "eqxshard")
    monitoring.register_callback(tool, events.PY_UNWIND, unwind)
    monitoring.set_events(tool, monitoring.get_events(tool) | events.PY_UNWIND)
    return True


def end_on_system_exit(status: Any) -> None:
    """Ends this process at once for a `SystemExit(status)` that left the program, unless
    its code is 0 (then Python exits as usual, waiting for the others)."""
    if _status_code(status) == 0:
        return
    if not isinstance(status, int):
        print(status, file=sys.stderr)
    _end_now(_status_code(status), f"SystemExit({status!r})")


_PROMPT = False  # whether `_end_promptly_on_errors` ran in this process


def ends_promptly() -> bool:
    """Whether an uncaught error ends this process at once (`initialize` joined a run of
    several processes with `exit_on_error=True`): read by `run_main.py`."""
    return _PROMPT


def _end_promptly_on_errors() -> None:
    """Makes an uncaught exception and an uncaught `SystemExit` with a non-zero code end
    this process at once. On Python 3.11, `sys.exit(n)` only (see `_Exit`), and
    `raise SystemExit(n)` too where the launcher started the process (`run_main.py`)."""
    global _PROMPT
    _PROMPT = True
    sys.excepthook = _exit_on_uncaught
    if not _watch_system_exit():
        sys.exit = _exit


def _check_arguments(
    initialization_timeout: Any, heartbeat_timeout_seconds: Any, exit_on_error: Any
) -> None:
    """The checks of `initialize`'s own arguments, before anything is joined."""
    for name, value in (
        ("initialization_timeout", initialization_timeout),
        ("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
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

    - `initialization_timeout`: seconds to wait for every process to join. `None` keeps
      JAX's default (300).
    - `heartbeat_timeout_seconds`: seconds without a heartbeat after which a process is
      taken as dead; every other process then exits with an error ("the JAX distributed
      service detected fatal errors") instead of waiting for it. `None` keeps JAX's
      default (100).
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
    """
    _check_arguments(initialization_timeout, heartbeat_timeout_seconds, exit_on_error)
    if jax.distributed.is_initialized():
        return "already initialized"
    timeouts: dict[str, Any] = {}
    if initialization_timeout is not None:
        timeouts["initialization_timeout"] = initialization_timeout
    if heartbeat_timeout_seconds is not None:
        timeouts["heartbeat_timeout_seconds"] = heartbeat_timeout_seconds
    join = clusters.detect()
    if join is None:
        return "single process"
    jax.distributed.initialize(**join.kwargs, **timeouts)
    _check_count(join)
    if exit_on_error and jax.process_count() > 1:
        _end_promptly_on_errors()
    return join.how
