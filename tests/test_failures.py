"""The `eqxshard: ...` lines made from JAX's own failure text (`_processes/failures.py`),
and the watcher that adds them to a process's stderr.

The texts are JAX 0.10.2's, as two processes on two simulated nodes printed them (cut to
the lines that matter; the full runs are in tests/cluster/test_cluster_faults.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eqxshard._processes import failures, watch

UNHEALTHY = """\
E1125 14:48:59.936091   10535 coordination_service.cc:1549] [16522419572628876446] Use error polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
F1125 14:48:59.936622   10546 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.

RPC: /xla.coordination.CoordinationService/PollForError [type.googleapis.com/tensorflow.CoordinationServiceError='']
*** Check failure stack trace: ***
"""  # noqa: E501
HEARTBEAT_DEADLINE = """\
F1125 14:48:59.955300   10553 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded

RPC: /xla.coordination.CoordinationService/Heartbeat
*** Check failure stack trace: ***
"""  # noqa: E501
SOCKET_CLOSED = """\
F1125 14:49:51.196548   11883 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues.
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}
*** Check failure stack trace: ***
"""  # noqa: E501
NEVER_JOINED = """\
F1125 14:50:37.793111   12633 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded

RPC: /xla.coordination.CoordinationService/RegisterTask
*** Check failure stack trace: ***
"""  # noqa: E501
GLOO_CLOSED = """\
Traceback (most recent call last):
jax.errors.JaxRuntimeError: UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer [10.23.0.2]:33670
"""  # noqa: E501
GLOO_ALL_REDUCE = """\
ValueError: UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer [10.23.0.2]:46759
eqxshard: process 0 ended by an uncaught ValueError (exit code 1), without waiting for the other processes.
"""  # noqa: E501
GLOO_LOOPBACK = """\
jax.errors.JaxRuntimeError: UNKNOWN: Gloo context initialization failed: [external/gloo/gloo/transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused, remote=[127.0.1.1]:7085$0
"""  # noqa: E501
# Process 1 hung; process 0 reached the end of the script (`initialize(
# shutdown_timeout_seconds=5)`, `python -m eqxshard.launch -n 2`): both print this.
SHUTDOWN_BARRIER = """\
[0] p0 done
E1125 18:36:00.457182   23615 coordination_service.cc:1520] [11197648042492692161] Shutdown barrier in coordination service has failed:
DEADLINE_EXCEEDED: Barrier timed out. Id: Shutdown::11197648042492692161::0. This usually happens because a task triggered the barrier too early or too slowly. Please look at the task logs (both timed out and first task) to debug further.
# of tasks that reached the barrier: 1/2.
The first task at the barrier: 0. Some timed out task names:
1
 [type.googleapis.com/tensorflow.BarrierError='\\n\\x1eShutdown::11197648042492692161'] [type.googleapis.com/tensorflow.CoordinationServiceError='']
F1125 18:36:00.457634   22780 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: INTERNAL: Failed to disconnect from coordination service with status: INTERNAL: Shutdown barrier has failed.

RPC: /xla.coordination.CoordinationService/ShutdownTask [type.googleapis.com/tensorflow.CoordinationServiceError='']
*** Check failure stack trace: ***
"""  # noqa: E501

PEERS = {"0": ["node1", "10.23.0.1"], "1": ["node2", "10.23.0.2"]}


def info(process: int, **more) -> dict:
    host = ["node1", "node2"][process]
    return {"process": process, "num_processes": 2, "host": host, "peers": PEERS,
            "heartbeat_timeout": 4, "initialization_timeout": 10, **more}  # fmt: skip


def test_heartbeats_stopped_names_the_lost_process_and_the_checkpoint():
    line = failures.explain(UNHEALTHY, info(0, checkpoint=["/ckpt", 40]))
    assert line == (
        "eqxshard: process 0 on node1 lost process 1 (host node2, address 10.23.0.2): it "
        "stopped sending heartbeats for 4 s (the heartbeat timeout) (crashed, killed, "
        "stopped, or its link cut), as JAX's coordination service reported. This process "
        "ends too. The newest complete checkpoint is step 40 in /ckpt. Resume from it (e.g. "
        "`--resume`), or let `python -m eqxshard.launch --max-restarts R` restart the run "
        "by itself; if it happens again, look at the log of process 1 (host node2, address "
        "10.23.0.2) and at its node and network."
    )


# What the survivor's own eqxshard check (a coordination-service barrier) raises when its
# peer stops: text from a real run (CI, 2026-11-25).
BARRIER_TIMEOUT = """\
jax.errors.JaxRuntimeError: INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout. This indicates that the remote task has failed, got preempted, or crashed unexpectedly. Check the task logs for an earlier error or scheduler events (e.g. preemption, eviction) to debug further.

RPC: /xla.coordination.CoordinationService/Barrier [type.googleapis.com/tensorflow.CoordinationServiceError='']
"""  # noqa: E501


def test_a_barrier_that_timed_out_on_a_peer_names_that_peer():
    # Not "lost the coordinator": process 0 is the coordinator; it lost process 1.
    line = failures.explain(BARRIER_TIMEOUT, info(0))
    assert line is not None
    assert line.startswith(
        "eqxshard: process 0 on node1 lost process 1 (host node2, address 10.23.0.2): it "
        "stopped sending heartbeats for 4 s"
    )


def test_the_straggler_hears_it_was_taken_as_lost():
    line = failures.explain(UNHEALTHY, info(1))
    assert line is not None
    assert line.startswith("eqxshard: process 1 on node2 was itself taken as lost: it sent no")
    assert "No checkpoint was completed by this process in this run." in line


@pytest.mark.parametrize(
    ("text", "seen"),
    [
        (HEARTBEAT_DEADLINE, "no answer to its heartbeats for 4 s (the heartbeat timeout)"),
        (SOCKET_CLOSED, "the connection to it closed"),
    ],
)
def test_the_coordinator_lost(text, seen):
    line = failures.explain(text, info(1))
    assert line is not None
    assert line.startswith(
        f"eqxshard: process 1 on node2 lost the coordinator, process 0 (host node1, address "
        f"10.23.0.1): {seen}"
    )


def test_a_process_that_never_joined():
    line = failures.explain(NEVER_JOINED, info(0))
    assert line is not None
    assert line.startswith(
        "eqxshard: process 0 on node1 gave up at start-up: process 1 (host node2, address "
        "10.23.0.2) never joined the run within 10 s (the initialization timeout)"
    )
    many = failures.explain(NEVER_JOINED, {**info(0), "num_processes": 3})
    assert many is not None and "one or more of process 1 (host node2" in many


@pytest.mark.parametrize(
    ("text", "name"), [(GLOO_CLOSED, "AllGather"), (GLOO_ALL_REDUCE, "all-reduce")]
)
def test_a_collective_that_lost_its_peer(text, name):
    line = failures.explain(text, info(0))
    assert line is not None
    assert line.startswith(
        "eqxshard: process 0 on node1 lost process 1 (host node2, address 10.23.0.2): its "
        f"connection failed in a collective (gloo {name}: connection closed by peer)"
    )
    unknown = failures.explain(GLOO_CLOSED, {"process": 0})
    assert unknown is not None and "lost the process at 10.23.0.2" in unknown


def test_a_peer_advertising_loopback():
    line = failures.explain(GLOO_LOOPBACK, info(0))
    assert line is not None and "cannot reach a peer at 127.0.1.1, a loopback address" in line


def test_before_the_process_knows_its_id():
    line = failures.explain(NEVER_JOINED, {"process": -1, "num_processes": 2, "host": "n1"})
    assert line is not None
    assert line.startswith("eqxshard: this process on n1 gave up at start-up: one or more of")


def test_nothing_to_explain():
    assert failures.explain("Traceback ...\nValueError: bad\n", info(0)) is None


def test_the_watcher_forwards_everything_and_adds_the_line():
    """The watcher run as `initialize` runs it: bytes pass unchanged, control lines are
    taken (also split over two writes), and the line comes at the end of the stream."""
    script = os.path.join(os.path.dirname(failures.__file__), "failures.py")
    control = failures.CONTROL + json.dumps({"checkpoint": ["/ckpt", 8]}).encode() + b"\n"
    text = b"a line\n" + control[:5]
    rest = control[5:] + UNHEALTHY.encode()
    watcher = subprocess.Popen(
        [sys.executable, "-S", "-E", script, json.dumps(info(0))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert watcher.stdin is not None
    watcher.stdin.write(text)
    watcher.stdin.flush()
    watcher.stdin.write(rest)
    out, _ = watcher.communicate(timeout=60)
    shown = out.decode()
    assert shown.startswith("a line\nE1125")
    assert "eqxshard-watch" not in shown
    assert UNHEALTHY in shown
    assert shown.rstrip().splitlines()[-1].startswith("eqxshard: process 0 on node1 lost process 1")
    assert "The newest complete checkpoint is step 8 in /ckpt." in shown


def test_tell_without_a_watcher_does_nothing(capfd):
    assert not watch.started()
    watch.tell(checkpoint=["/x", 1])
    assert capfd.readouterr().err == ""


def test_a_process_that_did_not_reach_the_end_of_the_script():
    """It said "lost the coordinator ... start the run again" before: the run lost
    nothing, one process hung while the others had ended."""
    line = failures.explain(SHUTDOWN_BARRIER, info(0))
    assert line is not None
    assert line.startswith(
        "eqxshard: process 0 on node1 reached the end of the script, but process 1 (host "
        "node2, address 10.23.0.2) did not within the shutdown timeout: it is still working, "
        "or hung"
    )
    assert "shutdown_timeout_seconds" in line and "`--timeout`" in line
    assert "lost the coordinator" not in line
    line = failures.explain(SHUTDOWN_BARRIER, info(1))
    assert line is not None
    assert line.startswith(
        "eqxshard: process 1 on node2 did not reach the end of the script within the shutdown "
        "timeout, while other processes of the run had and waited for it"
    )
