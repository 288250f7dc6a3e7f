"""`check_setup`: what JAX sees from this process, checked against what the run expects.

The "silently fell back to CPU" failure, or a run where every process thinks it is
alone, shows up at the first line of the run, not as a training run that is eight times
slower than it should be. `initialize` (joining the run) is in `initialize.py`.
"""

from __future__ import annotations

import dataclasses

import jax

# Platforms as the user may name them -> the names JAX's devices and backends use.
_PLATFORM_ALIASES = {
    "cpu": {"cpu"},
    "gpu": {"gpu", "cuda", "rocm"},
    "cuda": {"gpu", "cuda"},
    "rocm": {"gpu", "rocm"},
    "tpu": {"tpu"},
}


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
