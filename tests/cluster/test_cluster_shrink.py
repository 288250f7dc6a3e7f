"""`--min-hosts K`: a run that loses a node for good goes on with the others, takes a node
that comes back in again, and stops below K (see `eqxshard._processes.membership`).

A node is made to die with its process (`Cluster.fragile`): when its process fails, it
refuses the launcher's later tries with ssh's 255, as a node that died would. The first
test trains `examples/train_multihost.py` (4 nodes, then 3), and once more on the 3 to
compare; the others run `fragile.py` (a collective and a checkpoint per step, no model).
About two minutes in all: heavy.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from runs import EXAMPLE, Run, final_parameters, losses

pytestmark = pytest.mark.heavy

FRAGILE = Path(__file__).resolve().parent / "fragile.py"
LAUNCH = ["--devices-per-process", "1", "--heartbeat-timeout", "5", "--grace", "1"]
STEPS, EVERY, DIE = 20, 5, 12
TRAIN = [
    "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--log-every", "1",
    "--batch-size", "48", "--resume",
]  # fmt: skip
DOWN = (
    r"`sh \S+/enter {host}` exited with 255: enter: ssh: connect to host {host} port 22: "
    r"No route to host"
)


def test_a_node_lost_for_good_the_run_ends_on_the_others(make_cluster, tmp_path: Path) -> None:
    """4 nodes; node4 dies at step 12 (after the checkpoint of step 10) and stays down: the
    run goes on with 3 processes from the checkpoint, the global batch of 48 rows re-split
    (16 per process, was 12), and ends as a run that went to the checkpoint on 4 nodes and
    from it to the end on the 3."""
    cluster = make_cluster(4)
    cluster.fragile("node4")
    directory = tmp_path / "run"
    run = Run(
        cluster, *LAUNCH, "--max-restarts", "2", "--min-hosts", "3", "--", str(EXAMPLE),
        *TRAIN, "--checkpoint-dir", str(directory), "--die-at-step", str(DIE),
        "--die-process", "3",
    )  # fmt: skip
    assert run.finish() == 0, run.text
    text = run.text
    assert cluster.is_down("node4")
    assert "[launch] 4 processes on 4 hosts, coordinator node1:" in text
    assert re.search(
        r"\[launch\] process 3 on node4 exited with code 1; (ending the 3 still running|none "
        r"left); restarting the run \(restart 1 of 2\)",
        text,
    ), text
    left = (
        r"\[launch\] leaving out node4: it cannot be started again: "
        + DOWN.format(host="node4")
        + r"; the run goes on with 3 processes on 3 hosts \(--min-hosts 3\)"
    )
    assert re.search(left, text), text
    assert "[launch] 3 processes on 3 hosts, coordinator node1:" in text
    back = re.search(
        r"\[launch\] the run is back (\d+\.\d) s after process 3 on node4 exited with code 1: "
        r"3 processes on 3 hosts joined it",
        text,
    )
    assert back, text
    assert "[0] joined by eqxshard.launch: process 0 of 3;" in text
    found = re.search(r"\[0\] resumed from the checkpoint of step (\d+)", text)
    assert found, text
    saved = int(found.group(1))
    assert saved in (5, 10), text  # the newest complete one before step 12
    resumed = losses(text)

    # The reference: from the same checkpoint, on the same 3 nodes, started by hand.
    reference_dir = tmp_path / "reference"
    shutil.copytree(directory / str(saved), reference_dir / str(saved))
    again = Run(
        cluster, *LAUNCH, "--", str(EXAMPLE), *TRAIN, "--checkpoint-dir", str(reference_dir),
        hosts=cluster.hosts[:3],
    )  # fmt: skip
    assert again.finish() == 0, again.text
    assert f"[0] resumed from the checkpoint of step {saved}" in again.text
    reference = losses(again.text)
    steps = range(saved + 1, STEPS + 1)
    assert sorted(reference) == list(steps)
    # Both continued from one checkpoint on the same 3 processes: to float32 summation
    # order (the losses logged by the broken run for steps after the checkpoint are
    # those of its restart, the last logged for each step).
    np.testing.assert_allclose(
        [resumed[s] for s in steps], [reference[s] for s in steps], rtol=1e-6, atol=1e-7
    )
    assert final_parameters(text) == final_parameters(again.text)


def test_a_node_that_comes_back_is_taken_in_again(make_cluster, tmp_path: Path) -> None:
    """node3 dies and refuses one try; the run goes on with 2; when node2's process then
    fails, node3 answers again and the run goes on with all 3."""
    cluster = make_cluster(3)
    cluster.fragile("node3", refuse=1)
    run = Run(
        cluster, *LAUNCH, "--max-restarts", "3", "--min-hosts", "2", "--", str(FRAGILE),
        str(tmp_path / "run"), "8", "--die", "0:2:4", "--die", "1:1:4",
    )  # fmt: skip
    assert run.finish() == 0, run.text
    text = run.text
    assert re.search(
        r"\[launch\] leaving out node3: it cannot be started again: "
        + DOWN.format(host="node3")
        + r"; the run goes on with 2 processes on 2 hosts \(--min-hosts 2\)",
        text,
    ), text
    assert "[1] starting after step 3 with 2 processes" in text
    assert re.search(
        r"\[launch\] process 1 on node2 exited with code 1; .*restarting the run "
        r"\(restart 2 of 3\)",
        text,
    ), text
    assert (
        "[launch] taking node3 in again: it can be started again; the run goes on with "
        "3 processes on 3 hosts"
    ) in text
    again = r"\[launch\] 3 processes on 3 hosts, coordinator node1:\d+ \(restart 2\)"
    assert re.search(again, text), text
    assert "[2] step 8 of 3 processes" in text, text
    assert not cluster.is_down("node3")


def test_below_min_hosts_the_run_stops(make_cluster, tmp_path: Path) -> None:
    """node3 dies for good; then node2's process fails, and fails again at start-up: it
    is left out too, 1 host is fewer than --min-hosts 2, and the run stops saying so."""
    cluster = make_cluster(3)
    cluster.fragile("node3")
    run = Run(
        cluster, *LAUNCH, "--max-restarts", "5", "--min-hosts", "2", "--", str(FRAGILE),
        str(tmp_path / "run"), "8", "--die", "0:2:4", "--die", "1:1:4", "--fail-start", "2:1",
    )  # fmt: skip
    assert run.finish() == 2, run.text
    text = run.text
    assert "[1] process 1 fails at start-up" in text
    assert re.search(
        r"\[launch\] leaving out node2: it failed again at start-up \(process 1 on node2 "
        r"exited with code 2, before joining the run\); it stays out for the rest of the run$",
        text,
        flags=re.M,
    ), text
    assert re.search(
        r"\[launch\] only 1 of 3 hosts can be started \(node1\), fewer than --min-hosts 2; "
        r"stopping the run\. Left out: node3 \(it cannot be started again: "
        + DOWN.format(host="node3")
        + r"\), node2 \(it failed again at start-up",
        text,
    ), text
    assert "(restart 3" not in text  # it stopped there, restarts left or not
