"""Faults between simulated nodes: every surviving process ends, non-zero, with
eqxshard's own line naming the lost peer (id, host, address), what was seen, the newest
complete checkpoint, and what to do; within the bound the docs state (the heartbeat
timeout, or the initialization timeout at start-up, plus a few seconds).

Each case is one 2-node run of `steady.py` (1 CPU device per process, a gloo collective
and a checkpoint every few steps) under `python -m eqxshard.launch --hosts node1,node2`,
with a 4 s heartbeat: ~20 s each, so they are heavy (CI runs them once). The launcher
gets `--grace 10` so that the survivor says its own line before the launcher would end it.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from runs import EXAMPLE, STEADY, Run

import eqxshard

pytestmark = pytest.mark.heavy

HEARTBEAT_S = 4
INIT_S = 10
# The documented bound is the timeout plus a few seconds; this only catches a hang
# (the machine running the tests is loaded, its timings noisy).
SLACK_S = 30
LAUNCH = [
    "--devices-per-process", "1", "--heartbeat-timeout", str(HEARTBEAT_S),
    "--initialization-timeout", str(INIT_S), "--grace", "10",
]  # fmt: skip
NODE1 = r"process 0 \(host node1, address 10\.23\.0\.1\)"
NODE2 = r"process 1 \(host node2, address 10\.23\.0\.2\)"
HEARTBEATS = rf"it stopped sending heartbeats for {HEARTBEAT_S} s"


def eqxshard_line(run: Run, process: int) -> str:
    found = re.findall(rf"^\[{process}\] (eqxshard: .*)$", run.text, flags=re.M)
    found = [line for line in found if " lost " in line or "gave up" in line or "itself" in line]
    assert len(found) == 1, f"process {process} said no single eqxshard line:\n{run.text[-8000:]}"
    return found[0]


def check_checkpoint(line: str, directory: Path) -> None:
    """The line names a complete checkpoint of this run, and what to do."""
    found = re.search(r"The newest complete checkpoint is step (\d+) in (\S+)\.", line)
    assert found, line
    step = int(found.group(1))
    assert Path(found.group(2)) == directory.resolve()
    assert step % 5 == 0 and step <= (eqxshard.latest_step(directory) or 0)
    assert "Resume from it (e.g. `--resume`)" in line


def start(cluster, tmp_path: Path, **kwargs) -> tuple[Run, Path]:
    directory = tmp_path / "checkpoints"
    run = Run(cluster, *LAUNCH, "--", str(STEADY), str(directory), "90", **kwargs)
    run.wait_for(r"^\[0\] step 12 ")  # two checkpoints (steps 5 and 10) on disk
    return run, directory


def ended_within(run: Run, since: float, process: int, bound: float) -> None:
    when = run.when(rf"^\[{process}\] eqxshard: ")
    assert when is not None and when - since < bound + SLACK_S, (when, since, run.text[-4000:])


# Either end's link cut (no reset: packets are dropped), the two sides see the same.
@pytest.mark.parametrize("node", ["node2", "node1"], ids=["worker-cut", "coordinator-cut"])
def test_link_cut_both_sides_say_whom_they_lost(make_cluster, tmp_path: Path, node: str) -> None:
    cluster = make_cluster(2)
    run, directory = start(cluster, tmp_path)
    cut = time.monotonic() - run.start
    cluster.cut(node)
    assert run.finish() != 0
    zero, one = eqxshard_line(run, 0), eqxshard_line(run, 1)
    assert re.search(rf"process 0 on node1 lost {NODE2}: {HEARTBEATS}", zero), zero
    assert re.search(rf"process 1 on node2 lost the coordinator, {NODE1}: no answer", one), one
    for process, line in ((0, zero), (1, one)):
        check_checkpoint(line, directory)
        ended_within(run, cut, process, HEARTBEAT_S)


def test_coordinator_killed(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(2)
    run, directory = start(cluster, tmp_path)
    killed = time.monotonic() - run.start
    assert cluster.signal("node1", signal.SIGKILL)  # every process of the node
    assert run.finish() != 0
    one = eqxshard_line(run, 1)
    assert re.search(rf"process 1 on node2 lost (the coordinator, )?{NODE1}", one), one
    assert "[launch] process 0 on node1 exited with code 137 (128 + SIGKILL" in run.text
    check_checkpoint(one, directory)
    ended_within(run, killed, 1, HEARTBEAT_S)


def test_a_node_s_process_killed(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(2)
    run, directory = start(cluster, tmp_path)
    killed = time.monotonic() - run.start
    assert cluster.signal("node2", signal.SIGKILL, main_only=True)
    assert run.finish() != 0
    zero = eqxshard_line(run, 0)
    # At its next collective (or after the heartbeat timeout, whichever comes first).
    assert re.search(rf"process 0 on node1 lost {NODE2}: ", zero), zero
    assert "[launch] process 1 on node2 exited with code 137 (128 + SIGKILL" in run.text
    check_checkpoint(zero, directory)
    ended_within(run, killed, 0, HEARTBEAT_S)


def test_a_stopped_straggler_ends_too_once_it_wakes(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(2)
    run, directory = start(cluster, tmp_path)
    stopped = time.monotonic() - run.start
    assert cluster.signal("node2", signal.SIGSTOP, main_only=True)
    run.wait_for(r"^\[0\] eqxshard: ", timeout=HEARTBEAT_S + SLACK_S)
    cluster.signal("node2", signal.SIGCONT, main_only=True)
    assert run.finish() != 0
    zero, one = eqxshard_line(run, 0), eqxshard_line(run, 1)
    assert re.search(rf"process 0 on node1 lost {NODE2}: {HEARTBEATS}", zero), zero
    # Awake, the straggler hears that it was taken as lost, or finds the coordinator gone
    # (through the coordination service, or at its collective's next send).
    itself = rf"process 1 on node2 (was itself taken as lost|lost (the coordinator, )?{NODE1})"
    assert re.search(itself, one), one
    check_checkpoint(zero, directory)
    ended_within(run, stopped, 0, HEARTBEAT_S)


def test_a_node_that_never_starts(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(2)
    # A stand-in for an ssh that hangs: node2's process is never started.
    never = tmp_path / "never"
    never.write_text(f'[ "$1" = node2 ] && exec sleep 120\nexec sh {cluster.enter} "$@"\n')
    directory = tmp_path / "checkpoints"
    run = Run(cluster, *LAUNCH, "--", str(STEADY), str(directory), remote=f"sh {never} {{host}}")
    assert run.finish() != 0
    zero = eqxshard_line(run, 0)
    said = (
        rf"process 0 on node1 gave up at start-up: {NODE2} never joined the run within {INIT_S} s"
    )
    assert re.search(said, zero), zero
    assert "Nothing was trained." in zero
    ended_within(run, 0.0, 0, INIT_S)


def test_hostnames_that_resolve_to_loopback(make_cluster, tmp_path: Path) -> None:
    """Debian's `127.0.1.1 HOSTNAME` on every node: gloo gets the address that reaches
    the other hosts, and the run trains."""
    cluster = make_cluster(2, loopback_hostnames=["node1", "node2"])
    run = Run(cluster, *LAUNCH, "--", str(EXAMPLE), "--steps", "20")
    assert run.finish() == 0, run.text
    for process, address in ((0, "10.23.0.1"), (1, "10.23.0.2")):
        assert (
            f"[{process}] eqxshard: this host's name 'node{process + 1}' resolves to 127.0.1.1 "
            f"(loopback); gloo uses {address}, the address that reaches the other hosts."
        ) in run.text
    assert "[0] step 20 loss" in run.text
