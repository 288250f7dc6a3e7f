"""More nodes, other counts: `examples/train_multihost.py` on 4 simulated nodes x 1 process
x 2 CPU devices gives the losses of one process with 8 devices (to float tolerance), and
a checkpoint saved on 2 nodes resumes on 4 nodes and on 1 process with the same
continuation. Five runs of the example, about two minutes: heavy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from runs import EXAMPLE, HANG_S, ROOT, Run, child_env, losses

pytestmark = pytest.mark.heavy

STEPS, SAVED = 20, 10
TRAIN = ["--steps", str(STEPS), "--checkpoint-every", str(SAVED), "--log-every", "1"]
NODES = ["--processes-per-host", "1", "--devices-per-process", "2", "--heartbeat-timeout", "10"]


def one_process(*args: str) -> str:
    """The example as one process with 8 CPU devices; its output."""
    env = {**child_env(), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Steps 1-20 of one process with 8 devices."""
    directory = tmp_path_factory.mktemp("reference")
    found = losses(one_process(*TRAIN, "--checkpoint-dir", str(directory)), prefix="")
    assert sorted(found) == list(range(1, STEPS + 1))
    return found


def same_losses(found: dict[int, float], reference: dict[int, float], steps: range) -> None:
    assert sorted(found) == list(steps), found
    np.testing.assert_allclose(
        [found[s] for s in steps], [reference[s] for s in steps], rtol=1e-5, atol=1e-7
    )


def test_four_nodes_train_as_one_process(make_cluster, reference, tmp_path: Path) -> None:
    cluster = make_cluster(4)
    run = Run(cluster, *NODES, "--", str(EXAMPLE), *TRAIN, "--checkpoint-dir", str(tmp_path))
    assert run.finish() == 0, run.text
    assert "[0] joined by eqxshard.launch: process 0 of 4; 2 local of 8 devices" in run.text
    same_losses(losses(run.text), reference, range(1, STEPS + 1))


def test_a_checkpoint_of_two_nodes_resumes_on_four_and_on_one(
    make_cluster, reference, tmp_path: Path
) -> None:
    cluster = make_cluster(4)
    saved = tmp_path / "two-nodes"
    first = ["--steps", str(SAVED), "--checkpoint-every", str(SAVED), "--log-every", "1"]
    two = Run(
        cluster, *NODES, "--", str(EXAMPLE), *first, "--checkpoint-dir", str(saved),
        hosts=cluster.hosts[:2],
    )  # fmt: skip
    # The example's own check (the loss halves) needs the whole run: only the losses count.
    two.finish()
    assert "[0] saved the checkpoint of step 10" in two.text, two.text
    same_losses(losses(two.text), reference, range(1, SAVED + 1))

    on_four, on_one = tmp_path / "on-four", tmp_path / "on-one"
    shutil.copytree(saved, on_four)
    shutil.copytree(saved, on_one)
    four = Run(
        cluster, *NODES, "--", str(EXAMPLE), *TRAIN, "--resume", "--checkpoint-dir", str(on_four)
    )
    assert four.finish() == 0, four.text
    assert "[0] resumed from the checkpoint of step 10" in four.text
    same_losses(losses(four.text), reference, range(SAVED + 1, STEPS + 1))

    one = one_process(*TRAIN, "--resume", "--checkpoint-dir", str(on_one))
    assert "resumed from the checkpoint of step 10" in one
    same_losses(losses(one, prefix=""), reference, range(SAVED + 1, STEPS + 1))
