"""Every example script runs to the end and prints what it promises; benchmarks still run.

Each script runs in its own process, as a user would run it: the scripts set up their
own 8 CPU devices, which must happen before JAX starts (so not in this process).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # each runs a subprocess: CI runs these on the newest JAX only

ROOT = Path(__file__).resolve().parent.parent
# Files starting with "_" are modules the examples import (so they run with them), not
# examples.
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))

# What each example prints when it did its job. An example not listed here must still
# exit with 0 and print something; list its key lines here to check them too.
KEY_OUTPUT = {
    "train_data_parallel.py": [
        r"8 devices",
        r"laid out as (P|PartitionSpec)\('data',\): each device holds \(32, 8\)",
        r"final loss \d+\.\d+ < first loss \d+\.\d+ / 10",
    ],
    "train_fsdp.py": [r"final loss \d+\.\d+ < first loss \d+\.\d+"],
    "grid_eval.py": [r"model output over the grid: min"],
    "train_tensor_parallel.py": [r"final loss \d+\.\d+ < first loss \d+\.\d+"],
    "jacobian_scan.py": [r"<= budget: True", r"all-gather in HLO: False"],
    "train_multihost.py": [
        r"joined by single process: process 0 of 1; 8 local of 8 devices",
        r"final loss \d+\.\d+ < first loss \d+\.\d+ / 2",
    ],
}


def run_script(
    path: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, str(path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_examples_found():
    names = [p.name for p in EXAMPLES]
    assert "train_data_parallel.py" in names
    assert "_transformer.py" not in names
    assert (ROOT / "examples" / "_transformer.py").exists()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path):
    result = run_script(path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert result.stdout.strip(), output
    for pattern in KEY_OUTPUT.get(path.name, []):
        assert re.search(pattern, result.stdout), f"{pattern!r} not in the output:\n{output}"


def test_placement_benchmark_quick():
    """The benchmark still runs (its timings are not checked) and its HLO check holds. It
    runs without the tests' persistent compilation cache: with it on, the compiled texts it
    compares differed on a first (cold) run although the programs are the same."""
    no_cache = {"JAX_COMPILATION_CACHE_DIR": ""}
    result = run_script(ROOT / "benchmarks" / "placement.py", "--quick", env=no_cache)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "480 array leaves" in result.stdout, output
    assert re.search(r"\(c\) compiled HLO, both f\s+identical", result.stdout), output
    assert re.search(
        r"\(b\) re-place an already-placed model\s+[\d.]+ ms\s+[\d.]+ ms", result.stdout
    )


def test_step_benchmark_quick():
    """The step benchmark still runs (its timings are not checked): every way in its table."""
    result = run_script(ROOT / "benchmarks" / "step.py", "--quick")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "480 array leaves" in result.stdout, output
    for way in ("jax.jit on flat leaves", "eqx.filter_jit", "filter_jit, in_shardings", "StepLoop"):
        assert re.search(re.escape(way) + r".*\d+ us\s+[\d.]+x", result.stdout), output


def test_transfer_benchmark_quick():
    """The staged path, forced onto CPU devices, runs and gives `device_put`'s bits."""
    result = run_script(ROOT / "benchmarks" / "transfer.py", "--quick")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    rows = [line for line in result.stdout.splitlines() if " ms " in line]
    assert len(rows) == 3, output
    assert all(" yes" in row for row in rows), output


def test_gpu_batch_script_runs_its_parts_and_counts_failures(tmp_path: Path):
    """`benchmarks/gpu.sh` (for a GPU machine) runs the parts named, each to its own file,
    and exits with the number that failed (here on the CPU: the versions, and a bad part)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "versions", "nonsense"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "-- versions: exit 0" in result.stdout
    assert "unknown part: nonsense" in result.stdout
    assert re.search(r"\| jax \d+\.\d+", (tmp_path / "versions.txt").read_text())


def test_multihost_resume_of_a_finished_run_says_so(tmp_path: Path):
    script = ROOT / "examples" / "train_multihost.py"
    args = ("--steps", "2", "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path))
    fresh = run_script(script, *args, "--resume")  # 2 steps: too few for its learning check
    assert "no checkpoint in" in fresh.stdout and "starting at step 0" in fresh.stdout
    again = run_script(script, *args, "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from the checkpoint of step 2" in again.stdout
    assert "nothing left to do" in again.stdout, again.stdout


# The same scripts on 1 and 2 devices too (as on machines with 1 or 2 GPUs), a few steps
# each; `test_example_runs` runs each on 8. train_multihost.py takes its step count as an
# argument.
DEVICE_COUNTS = [1, 2]
SHORT = {"train_multihost.py": ("--steps", "2", "--batch-size", "16")}


# jacobian_scan.py compiles a dozen programs (a minute a run): on 1 device only here.
ONE_COUNT = {"jacobian_scan.py": [1]}


def _cases():
    for path in EXAMPLES:
        for devices in ONE_COUNT.get(path.name, DEVICE_COUNTS):
            yield pytest.param(path, devices, id=f"{path.name}-{devices}")


@pytest.mark.parametrize(("path", "devices"), list(_cases()))
def test_example_adapts_to_device_count(path: Path, devices: int):
    env = {"JAX_NUM_CPU_DEVICES": str(devices), "EQXSHARD_EXAMPLE_STEPS": "2"}
    result = run_script(path, *SHORT.get(path.name, ()), env=env)
    output = result.stdout + result.stderr
    if path.name == "train_multihost.py":  # 2 steps are too few for its learning check
        assert "final parameters" in result.stdout, output
    else:
        assert result.returncode == 0, output
    assert re.search(rf"\b{devices} (local of {devices} )?devices\b", result.stdout), output


def test_multihost_batch_that_does_not_split_says_the_sizes_and_the_fix(tmp_path: Path):
    """As after a restart on fewer hosts: the global batch no longer divides the devices."""
    script = ROOT / "examples" / "train_multihost.py"
    six = {"JAX_NUM_CPU_DEVICES": "6"}
    result = run_script(script, "--steps", "2", "--batch-size", "64", env=six)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "--batch-size 64 does not split over the 6 devices of this run (1 process x 6 "
        "devices): 64 % 6 = 4. Give a multiple of 6 (e.g. 60)"
    ) in result.stderr, result.stderr
    assert "step 1 loss" not in result.stdout  # stopped at start-up
