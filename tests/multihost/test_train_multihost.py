"""`examples/train_multihost.py` on 2 processes x 4 CPU devices: resume and faults.

Four runs of the example, made once per pytest session (also under pytest-xdist: the
first test to need them makes them, holding a lock file, and caches what they printed):

- `straight`: 20 steps with `python -m eqxshard.launch`, checkpoints every 10 steps;
- `crash`: the two processes started by hand (no launcher to end the survivor), process
  1 dies (`os._exit(1)`) at step 15; the survivor must exit with an error by itself;
- `resume`: with the launcher, `--resume` from the newest checkpoint (step 10) to 20;
- `coordinator_crash`: like `crash`, but process 0 (which hosts JAX's coordination
  service) dies.

Each subprocess has a time limit that only stops a hang.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import child_env, own_processes, run_once

from eqxshard._processes import launcher as _launch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_multihost.py"
STEPS, EVERY, DIE_AT = 20, 10, 15
# Only stops a run that hangs; each run takes seconds.
HANG_S = 240
# The survivor waits at most this long for a dead peer's heartbeat (JAX's default: 100 s).
HEARTBEAT_S = 5
COMMON = [
    "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--log-every", "1",
    "--heartbeat-timeout", str(HEARTBEAT_S),
]  # fmt: skip
# What JAX says on the survivor when its peer is gone: the next collective fails
# (gloo: "Connection reset by peer"), or the coordination service reports the missed
# heartbeats and ends the process.
PEER_GONE = (
    r"Gloo \w+ failed|detected fatal errors|another task died|tasks are unhealthy"
    r"|Task \d+ heartbeat timeout"
)


def with_launcher(*args: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "eqxshard.launch", "-n", "2", "--devices-per-process", "4"]
    result = subprocess.run(
        [*command, "--", str(EXAMPLE), *args],
        env=child_env(cpu=False),
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=ROOT,
    )
    return {
        "returncodes": [result.returncode],
        "stdout": [result.stdout],
        "stderr": [result.stderr],
    }


def by_hand(*args: str) -> dict[str, Any]:
    """Both processes started here, with the launcher's environment but no launcher."""
    port, base = _launch.free_port(), child_env(cpu=False)
    with own_processes() as procs:
        for i in range(2):
            env = _launch.process_env(
                base, process_id=i, num_processes=2, port=port, devices_per_process=4
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(EXAMPLE), *args],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )
            )
        outputs = [p.communicate(timeout=HANG_S) for p in procs]
    return {
        "returncodes": [p.returncode for p in procs],
        "stdout": [out for out, _ in outputs],
        "stderr": [err for _, err in outputs],
    }


def make_runs(workdir: Path) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    runs["straight"] = with_launcher(
        *COMMON, "--checkpoint-dir", str(workdir / "straight"),
        "--expect-processes", "2", "--expect-devices", "8", "--platform", "cpu",
    )  # fmt: skip
    crashed = str(workdir / "crashed")
    runs["crash"] = by_hand(*COMMON, "--checkpoint-dir", crashed, "--die-at-step", str(DIE_AT))
    runs["resume"] = with_launcher(*COMMON, "--checkpoint-dir", crashed, "--resume")
    runs["coordinator_crash"] = by_hand(
        *COMMON, "--checkpoint-dir", str(workdir / "coordinator"),
        "--die-at-step", str(DIE_AT), "--die-process", "0",
    )  # fmt: skip
    return runs


@pytest.fixture(scope="session")
def runs(multihost_dir: Path) -> dict[str, Any]:
    workdir = multihost_dir / "train"
    workdir.mkdir(exist_ok=True)
    return run_once(workdir, "runs", lambda: make_runs(workdir))


def steps_logged(stdout: str) -> list[tuple[int, str]]:
    """(step, loss as printed) for every step process 0 logged, in order."""
    return [(int(s), loss) for s, loss in re.findall(r"^(?:\[0\] )?step (\d+) loss (\S+)$",
                                                         stdout, flags=re.M)]  # fmt: skip


def fingerprint(stdout: str) -> str:
    found = re.findall(r"final parameters ([0-9a-f]+)", stdout)
    assert len(found) == 1, stdout
    return found[0]


def output(run: dict[str, Any]) -> str:
    return "\n".join(run["stdout"] + run["stderr"])


def test_straight_run(runs):
    run = runs["straight"]
    assert run["returncodes"] == [0], output(run)
    stdout = run["stdout"][0]
    # The startup check's report (each process checked its own: 2 processes, 8 devices).
    assert "[0] joined by eqxshard.launch: process 0 of 2; 4 local of 8 devices" in stdout
    assert [s for s, _ in steps_logged(stdout)] == list(range(1, STEPS + 1))
    saved = re.findall(r"^\[0\] saved the checkpoint of step (\d+)$", stdout, flags=re.M)
    assert saved == [str(s) for s in range(EVERY, STEPS + 1, EVERY)]
    assert not re.search(r"^\[1\] step", stdout, flags=re.M)  # only process 0 logs
    losses = [float(loss) for _, loss in steps_logged(stdout)]
    assert losses[-1] < losses[0] / 2


def test_survivor_exits_with_an_error(runs):
    """Nothing ends the survivor but JAX itself: no launcher, and it must not hang."""
    run = runs["crash"]
    assert run["returncodes"][1] == 1, output(run)
    assert f"process 1 dies at step {DIE_AT}" in run["stdout"][1]
    assert run["returncodes"][0] != 0, output(run)
    assert re.search(PEER_GONE, run["stderr"][0]), run["stderr"][0][-3000:]
    assert "final parameters" not in run["stdout"][0]
    assert [s for s, _ in steps_logged(run["stdout"][0])] == list(range(1, DIE_AT))


def test_survivor_of_the_coordinator_exits_with_an_error(runs):
    run = runs["coordinator_crash"]
    assert run["returncodes"][0] == 1, output(run)
    assert f"process 0 dies at step {DIE_AT}" in run["stdout"][0]
    assert run["returncodes"][1] != 0, output(run)
    assert re.search(PEER_GONE, run["stderr"][1]), run["stderr"][1][-3000:]
    assert "final parameters" not in run["stdout"][1]


def test_resume_has_no_lost_or_repeated_steps(runs):
    crash, resume = runs["crash"], runs["resume"]
    assert resume["returncodes"] == [0], output(resume)
    stdout = resume["stdout"][0]
    last = (DIE_AT - 1) // EVERY * EVERY  # the newest checkpoint before the crash
    assert f"[0] resumed from the checkpoint of step {last}" in stdout
    resumed = steps_logged(stdout)
    assert [s for s, _ in resumed] == list(range(last + 1, STEPS + 1))
    # The run's history: the crashed run up to its newest checkpoint, then the resumed one.
    history = [(s, loss) for s, loss in steps_logged(crash["stdout"][0]) if s <= last] + resumed
    assert [s for s, _ in history] == list(range(1, STEPS + 1))
    # ... and it is the straight run's history, loss for loss (printed to 9 digits).
    assert history == steps_logged(runs["straight"]["stdout"][0])


def test_resume_gives_bit_identical_parameters(runs):
    straight, resume = runs["straight"]["stdout"][0], runs["resume"]["stdout"][0]
    assert fingerprint(resume) == fingerprint(straight)
