"""Starting a multi-process run: `initialize` joins it, `check_setup` says what JAX sees.

`initialize` is the one call a training script makes before anything else touches JAX.
It reads, in this order:
- the variables `python -m eqxshard.launch` sets for each process it starts
  (`EQXSHARD_PROCESS_ID`, `EQXSHARD_NUM_PROCESSES`, and JAX's own
  `JAX_COORDINATOR_ADDRESS`);
- a cluster JAX detects by itself (Slurm, Open MPI, Kubernetes, Cloud TPU pods);
- neither: one process, nothing to join.

`check_setup` is the other half: the "silently fell back to CPU" failure, or a run where
every process thinks it is alone, shows up at the first line of the run, not as a
training run that is eight times slower than it should be.
"""

from __future__ import annotations

import dataclasses
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

# Platforms as the user may name them -> the names JAX's devices and backends use.
_PLATFORM_ALIASES = {
    "cpu": {"cpu"},
    "gpu": {"gpu", "cuda", "rocm"},
    "cuda": {"gpu", "cuda"},
    "rocm": {"gpu", "rocm"},
    "tpu": {"tpu"},
}


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


@dataclasses.dataclass(frozen=True)
class SetupReport:
    """What JAX sees from this process; `str(report)` is a short readable summary.

    **Fields:**

    - `process_index`, `process_count`: this process and how many there are.
    - `local_device_count`, `device_count`: devices of this process, and of all processes.
    - `devices_per_process`: the device count of each process, by process index.
    - `backend`: `jax.default_backend()` (`"cpu"`, `"gpu"`, `"tpu"`).
    - `platform`: the platform of the devices (`"cpu"`, `"gpu"`, `"tpu"`, ...).
    - `device_kind`: the kind of this process's first device (e.g. `"NVIDIA H100"`).
    - `jax_version`: `jax.__version__`.
    """

    process_index: int
    process_count: int
    local_device_count: int
    device_count: int
    devices_per_process: tuple[int, ...]
    backend: str
    platform: str
    device_kind: str
    jax_version: str

    def __str__(self) -> str:
        per_process = ", ".join(str(n) for n in self.devices_per_process)
        return (
            f"process {self.process_index} of {self.process_count}; "
            f"{self.local_device_count} local of {self.device_count} devices "
            f"(per process: {per_process}); backend {self.backend!r}, "
            f"platform {self.platform!r} ({self.device_kind}); jax {self.jax_version}"
        )


def _report() -> SetupReport:
    devices = jax.devices()
    local = jax.local_devices()
    counts = [0] * jax.process_count()
    for d in devices:
        counts[d.process_index] += 1
    return SetupReport(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=len(local),
        device_count=len(devices),
        devices_per_process=tuple(counts),
        backend=jax.default_backend(),
        platform=local[0].platform,
        device_kind=local[0].device_kind,
        jax_version=jax.__version__,
    )


def _check_count(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int or None, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"`{name}` must be at least 1, got {value}.")


def _platform_problem(expected: str, report: SetupReport) -> str:
    found = report.platform
    text = f"- platform: expected {expected!r}, but JAX is using {found!r}."
    if found == "cpu":
        accelerator = {"tpu": "TPU"}.get(expected, "CUDA/ROCm")
        text += (
            f" JAX fell back to the CPU: jaxlib has no {accelerator} support installed "
            '(e.g. `pip install -U "jax[cuda12]"`), the accelerators are hidden '
            "(CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES, the job's resource request), or "
            "JAX_PLATFORMS=cpu is set. `jax.devices()` with JAX_PLATFORMS unset and "
            "logging on (`TF_CPP_MIN_LOG_LEVEL=0`) says why the backend did not load."
        )
    else:
        text += f" Set JAX_PLATFORMS={expected} to make JAX use it, or fail where it is missing."
    return text


def _process_problem(expected: int, report: SetupReport) -> str:
    found = report.process_count
    text = f"- processes: expected {expected}, but this run has {found}."
    if found == 1:
        text += (
            " Every process is running alone: `jax.distributed.initialize()` (or "
            "`eqxshard.initialize()`) was not called before the first JAX computation, or it "
            "found no cluster to join. Locally, start the script with "
            f"`python -m eqxshard.launch -n {expected} -- script.py`; on a cluster, with "
            f"`srun`/`mpirun` and {expected} tasks."
        )
    else:
        text += (
            " The launcher or the cluster started a different number of processes than "
            "expected: check `-n` of `python -m eqxshard.launch`, or the job's task count "
            "(e.g. Slurm `--ntasks`)."
        )
    return text


def _device_problem(what: str, expected: int, found: int, report: SetupReport) -> str:
    text = f"- {what}: expected {expected}, but found {found}."
    if report.platform == "cpu":
        text += (
            " On CPU, each process has the number of devices set by `jax_num_cpu_devices` "
            "(`JAX_NUM_CPU_DEVICES`; `--devices-per-process` of `python -m eqxshard.launch`), "
            "set before JAX starts; if accelerators were expected, JAX fell back to the CPU."
        )
    else:
        text += (
            " Some accelerators are hidden from this process (CUDA_VISIBLE_DEVICES, "
            "`local_device_ids` of `jax.distributed.initialize`, the job's resource "
            "request), or busy in another process."
        )
    return text


def check_setup(
    *,
    processes: int | None = None,
    devices: int | None = None,
    local_devices: int | None = None,
    platform: str | None = None,
) -> SetupReport:
    """Reports what JAX sees from this process, and fails loudly where it is not what
    the run expects.

    Call it after `initialize` (or `jax.distributed.initialize`) and before the real work:
    a run that silently fell back to the CPU, or whose processes did not find each other
    (each then trains alone), is stopped at its first line. It runs no collective: every
    process checks its own view, so a wrong setup never leaves processes waiting on each
    other here.

    **Arguments:**

    - `processes`: the number of processes expected, or `None` for any.
    - `devices`: the number of devices expected over all processes, or `None` for any.
    - `local_devices`: the number of devices expected on this process, or `None` for any.
    - `platform`: the platform expected: `"cpu"`, `"gpu"` (CUDA or ROCm), `"cuda"`,
      `"rocm"` or `"tpu"`; `None` for any.

    **Returns:**

    A `SetupReport`; `print(report)` gives one line.

    **Raises:**

    - `RuntimeError`: if what JAX sees differs from what was expected; the message lists
      every difference with what was expected, what was found, and the likely cause.
    - `ValueError`: if a count is below 1 or `platform` is not one of those above.
    - `TypeError`: if a count is not an int, or `platform` not a string.

    !!! Example

        ```python
        import eqxshard

        eqxshard.initialize()
        print(eqxshard.check_setup(platform="cpu"))
        ```
    """
    for name, value in (
        ("processes", processes),
        ("devices", devices),
        ("local_devices", local_devices),
    ):
        _check_count(name, value)
    if platform is not None:
        if not isinstance(platform, str):
            raise TypeError(f"`platform` must be a string or None, got {type(platform).__name__}.")
        if platform.lower() not in _PLATFORM_ALIASES:
            raise ValueError(
                f"`platform` must be one of {', '.join(map(repr, _PLATFORM_ALIASES))}, "
                f"got {platform!r}."
            )
    report = _report()
    problems = []
    if platform is not None:
        names = {report.platform.lower(), report.backend.lower()}
        if not names & _PLATFORM_ALIASES[platform.lower()]:
            problems.append(_platform_problem(platform.lower(), report))
    if processes is not None and processes != report.process_count:
        problems.append(_process_problem(processes, report))
    if devices is not None and devices != report.device_count:
        problems.append(_device_problem("devices", devices, report.device_count, report))
    if local_devices is not None and local_devices != report.local_device_count:
        problems.append(
            _device_problem("local devices", local_devices, report.local_device_count, report)
        )
    if problems:
        raise RuntimeError(
            f"`check_setup` found a setup other than expected, on {report}:\n" + "\n".join(problems)
        )
    return report
