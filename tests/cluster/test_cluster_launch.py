"""`python -m eqxshard.launch --hosts ...` on simulated nodes (see `nodes.py`): where each
process runs and with what, a host that cannot be started, and restarts.

The first two start no JAX (a few seconds each) and run by default; the restart test
trains `examples/train_multihost.py` twice (heavy).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import nodes
import pytest
from runs import EXAMPLE, HANG_S, Run, child_env, final_parameters

HELLO = """\
import os, socket, sys
names = ("EQXSHARD_", "JAX_")
# (The stand-in for ssh passes the launcher's environment on: the test suite's own
# EQXSHARD_TEST_* settings, auto_plan's cache folder and its compilation cache are not the
# run's variables.)
ours = ("EQXSHARD_TEST_", "EQXSHARD_CACHE_DIR", "JAX_COMPILATION_CACHE_", "JAX_PERSISTENT_CACHE_")
print("hello", socket.gethostname(), sorted((k, v) for k, v in os.environ.items()
      if k.startswith(names) and not k.startswith(ours)), sys.argv[1:],
      sys.executable, __file__, flush=True)
if len(sys.argv) > 2 and os.environ["EQXSHARD_PROCESS_ID"] == sys.argv[2]:
    import time
    time.sleep(120)
"""


def test_processes_on_hosts_get_the_run_s_variables(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(2)
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    run = Run(
        cluster, "--processes-per-host", "2", "--devices-per-process", "3", "--port", "23456",
        "--heartbeat-timeout", "7", "--", str(script), "one 'arg' with spaces",
    )  # fmt: skip
    assert run.finish() == 0, run.text
    seen = {}
    for line in run.text.splitlines():
        found = re.match(r"^\[(\d)\] hello (\S+) (\[.*\]) (\[.*\]) (\S+) (\S+)$", line)
        if found:
            k, host, env, args, python, path = found.groups()
            seen[int(k)] = (host, dict(ast.literal_eval(env)), ast.literal_eval(args), python, path)
    assert sorted(seen) == [0, 1, 2, 3], run.text
    for k, (host, env, args, python, path) in seen.items():
        assert host == ["node1", "node2"][k // 2]  # K = 2 processes per host, in order
        assert env == {
            "EQXSHARD_PROCESS_ID": str(k),
            "EQXSHARD_NUM_PROCESSES": "4",
            "EQXSHARD_HOSTS": "node1,node2",
            "EQXSHARD_PROCESSES_PER_HOST": "2",
            "EQXSHARD_HEARTBEAT_TIMEOUT": "7",
            "EQXSHARD_RESTART_COUNT": "0",
            "JAX_COORDINATOR_ADDRESS": "node1:23456",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "JAX_NUM_CPU_DEVICES": "3",
            "JAX_PLATFORMS": "cpu",
        }
        assert args == ["one 'arg' with spaces"]  # quoted for the remote shell
        assert python == sys.executable and path == str(script)
    assert "[launch] 4 processes on 2 hosts, coordinator node1:23456" in run.text


def test_a_host_that_cannot_be_started_stops_the_run(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(1)
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    # Process 0 (node1) would sleep 120 s: the run must stop at once, not wait for it.
    run = Run(cluster, "--max-restarts", "3", "--", str(script), "x", "0", hosts=["node1", "nodeX"])
    code = run.finish(timeout=60)
    assert code == 255, run.text
    assert re.search(
        r"\[launch\] cannot start process 1 on nodeX: `sh \S+/enter nodeX` exited with 255: "
        r"enter: ssh: Could not resolve hostname nodeX: .*; stopping the run",
        run.text,
    ), run.text
    assert "restarting" not in run.text  # no restart can help


@pytest.mark.heavy
def test_a_restarted_run_ends_as_an_unbroken_one(make_cluster, tmp_path: Path) -> None:
    """One node's process is killed mid-run; the launcher restarts the run, which resumes
    from its newest checkpoint and ends with the parameters of a run never broken."""
    cluster = make_cluster(2)
    train = [
        "--devices-per-process", "2", "--heartbeat-timeout", "5", "--grace", "1", "--",
        str(EXAMPLE), "--steps", "20", "--checkpoint-every", "5", "--log-every", "1",
        "--resume",
    ]  # fmt: skip
    unbroken = Run(cluster, *train[:-1], "--checkpoint-dir", str(tmp_path / "unbroken"))
    assert unbroken.finish() == 0, unbroken.text
    broken = Run(cluster, "--max-restarts", "2", *train, "--checkpoint-dir", str(tmp_path / "b"))
    broken.wait_for(r"^\[0\] saved the checkpoint of step 10$")
    assert cluster.signal("node2", 9, main_only=True), "no process to kill on node2"
    assert broken.finish() == 0, broken.text
    assert re.search(
        r"\[launch\] process 1 on node2 exited with code 137 \(128 \+ SIGKILL: killed by it\); "
        # (the survivor may end by itself, its gloo link reset, before the launcher does)
        r"(ending the 1 still running|none left); restarting the run \(restart 1 of 2\)",
        broken.text,
    ), broken.text
    assert re.search(r"\[0\] resumed from the checkpoint of step (10|15)", broken.text)
    assert final_parameters(broken.text) == final_parameters(unbroken.text)


def test_cli_hostfile_errors(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n")
    done = subprocess.run(
        [sys.executable, "-m", "eqxshard.launch", "--hostfile", str(hostfile), "--", "x.py"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=child_env(),
    )
    assert done.returncode == 2
    assert "more than a host name on these lines:\n  line 1: 'node1 slots=2'" in done.stderr


def test_a_killed_session_s_cluster_is_swept(make_cluster, tmp_path: Path) -> None:
    """A test process killed before its finalizers ran leaves its namespaces and bridge;
    the next session's sweep removes them (and nothing of a live owner's)."""
    live = make_cluster(1)  # this process's own: must survive the sweep
    owner = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time; from pathlib import Path; sys.path.insert(0, sys.argv[1])\n"
            "from nodes import Cluster\n"
            "c = Cluster(2, Path(sys.argv[2])).__enter__()\n"
            "print(c.id, flush=True); time.sleep(120)\n"
        ), str(Path(__file__).parent), str(tmp_path / "left")],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        left = owner.stdout.readline().strip()
    finally:
        owner.kill()  # no clean-up: as a killed test session
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"eqxsn{left}1" in listed
    assert left in nodes.sweep()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert left not in listed and left not in links
    assert live.netns("node1") in listed  # a live owner's cluster is left alone
