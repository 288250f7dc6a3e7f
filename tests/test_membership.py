"""`--min-hosts`: which hosts each attempt runs on (`Membership`), the probe of a host
(`TEMPLATE true`), and the line `initialize` writes for the launcher once a process joined
(taken off the output). The runs on simulated nodes are in tests/cluster/test_cluster_shrink.py."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path

from eqxshard._processes import launcher
from eqxshard._processes.attempt import Start, run_attempt
from eqxshard._processes.clusters import JOINED_LINE
from eqxshard._processes.membership import Membership, attempt_starts, probe

# A stand-in for ssh: `hostX` cannot be reached (255), `slow` never answers, others run.
FAKE = """\
host=$1; shift
case $host in
  hostX) echo "ssh: connect to host hostX port 22: No route to host" >&2; exit 255;;
  slow) exec sleep 60;;
  odd) echo "bash: env: command not found" >&2; exit 127;;
esac
exec sh -c "$*"
"""


def test_probe(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    fake.write_text(FAKE)
    found = probe(["sh", str(fake), "{host}"], ["a", "hostX", "slow", "odd"], {}, 2.0)
    assert found["a"] is None
    assert found["hostX"] == (
        f"`sh {fake} hostX` exited with 255: ssh: connect to host hostX port 22: No route to host"
    )
    assert found["slow"] == f"`sh {fake} slow` did not answer within 2 s"
    assert found["odd"] == f"`sh {fake} odd` exited with 127: bash: env: command not found"
    missing = probe(["/no/such/ssh", "{host}"], ["a"], {}, 2.0)["a"]
    assert missing is not None and missing.startswith("`/no/such/ssh a` cannot run: ")


def test_membership_leaves_out_takes_in_and_stops_below_min_hosts() -> None:
    members = Membership(["n1", "n2", "n3", "n4"], 2, 2)
    assert members.shrinks and members.current() == ["n1", "n2", "n3", "n4"]
    assert members.leave_out("n3", "it cannot be started: x") == (
        "leaving out n3: it cannot be started: x; the run goes on with 6 processes on 3 "
        "hosts (--min-hosts 2)"
    )
    assert members.current() == ["n1", "n2", "n4"]
    # n3 answers again, n1 does not: n3 in, n1 out (the coordinator moves to n2).
    lines = members.refresh({"n1": "`ssh n1` exited with 255: down", "n2": None, "n3": None})
    assert lines == [
        "leaving out n1: it cannot be started again: `ssh n1` exited with 255: down; the run "
        "goes on with 4 processes on 2 hosts (--min-hosts 2)",
        "taking n3 in again: it can be started again; the run goes on with 6 processes on 3 hosts",
    ]
    assert members.current() == ["n2", "n3", "n4"]
    members.leave_out("n4", "it failed again at start-up", for_good=True)
    assert members.to_probe() == ["n1", "n2", "n3"]
    assert members.refresh({"n1": None}) == [
        "taking n1 in again: it can be started again; the run goes on with 6 processes on 3 hosts"
    ]
    assert members.refresh({"n2": "gone", "n3": "gone"})[-1] == (
        "leaving out n3: it cannot be started again: gone"  # below 2: no "goes on"
    )
    assert not members.enough()
    assert members.too_few() == (
        "only 1 of 4 hosts can be started (n1), fewer than --min-hosts 2; stopping the run. "
        "Left out: n4 (it failed again at start-up), n2 (it cannot be started again: gone), "
        "n3 (it cannot be started again: gone)"
    )
    assert not Membership(["a", "b"], 2, 1).shrinks  # the default: every host


def test_attempt_starts_on_fewer_hosts_renumber_the_processes() -> None:
    starts = attempt_starts(
        ["train.py"], num_processes=4, hosts=["n2", "n4"], processes_per_host=2,
        template=["ssh", "{host}"], port=1234, base={}, restart=3,
        variables={"devices_per_process": None, "heartbeat_timeout": None,
                   "initialization_timeout": None},
    )  # fmt: skip
    assert [(s.process_id, s.host) for s in starts] == [(0, "n2"), (1, "n2"), (2, "n4"), (3, "n4")]
    words = starts[3].argv
    assert words[:2] == ["ssh", "n4"]
    for expected in ("EQXSHARD_PROCESS_ID=3", "EQXSHARD_NUM_PROCESSES=4",
                     "JAX_COORDINATOR_ADDRESS=n2:1234", "EQXSHARD_HOSTS=n2,n4",
                     "EQXSHARD_RESTART_COUNT=3"):  # fmt: skip
        assert expected in words


def test_the_joined_line_is_taken_off_the_output_and_counted() -> None:
    code = (
        "import sys; print('before', file=sys.stderr); "
        f"print({JOINED_LINE!r}, file=sys.stderr, flush=True); print('after', flush=True)"
    )
    starts = [Start(k, [sys.executable, "-c", code], {}, None) for k in range(2)]
    out, err = io.BytesIO(), io.BytesIO()
    joined: list[int] = []
    outcome = run_attempt(
        starts, out=out, err=err, lock=threading.Lock(), note=lambda m: None, deadline=None,
        timeout=None, grace=0.5, remote=False, on_joined=lambda: joined.append(1),
    )  # fmt: skip
    assert outcome.kind == "done"
    assert joined == [1]  # once, when both had joined
    text = out.getvalue().decode() + err.getvalue().decode()
    assert JOINED_LINE not in text
    assert sorted(text.splitlines()) == ["[0] after", "[0] before", "[1] after", "[1] before"]


def test_a_host_that_cannot_be_started_is_left_out_at_once(tmp_path: Path, capfd) -> None:
    """With `min_hosts`, a host whose start fails (255) is left out and the run starts
    again at once on the others, no restart used; without it, the run stops."""
    fake = tmp_path / "fake"
    fake.write_text(FAKE)
    script = tmp_path / "hello.py"
    script.write_text("import os; print('hello from', os.environ['EQXSHARD_NUM_PROCESSES'])\n")
    remote = f"sh {fake} {{host}}"
    code = launcher.launch(
        [str(script)], hosts=["a", "hostX"], remote=remote, min_hosts=1, timeout=60, grace=0.5
    )
    err = capfd.readouterr().err
    assert code == 0, err
    assert (
        f"[launch] leaving out hostX: it cannot be started: `sh {fake} hostX` exited with "
        "255: ssh: connect to host hostX port 22: No route to host; the run goes on with "
        "1 process on 1 host (--min-hosts 1)"
    ) in err
    assert "[launch] 1 processes on 1 hosts, coordinator a:" in err
    for min_hosts in (None, 2):  # every host needed: the run stops, saying it fell below
        code = launcher.launch(
            [str(script)], hosts=["a", "hostX"], remote=remote, min_hosts=min_hosts, timeout=60
        )
        assert code == 255
        err = capfd.readouterr().err
        assert (
            "hostX` exited with 255: ssh: connect to host hostX port 22: No route to host; "
            "stopping the run" in err
        )
        assert (
            "[launch] only 1 of 2 hosts can be started (a), fewer than --min-hosts 2; stopping "
            "the run. Left out: hostX (it cannot be started: " in err
        )


def test_a_probe_interrupted_while_waiting_is_ended_and_its_pipe_closed(
    tmp_path: Path, monkeypatch
) -> None:
    """Ctrl-C while the probe waits: the probe is killed, reaped and its pipe closed
    before the interrupt goes on (no process left running, no unclosed pipe)."""
    import os
    import subprocess

    import pytest

    from eqxshard._processes import membership

    seen: list[subprocess.Popen] = []
    communicate = subprocess.Popen.communicate

    def interrupted(self, *args, **kwargs):
        if not seen:
            seen.append(self)
            raise KeyboardInterrupt
        return communicate(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        membership._probe_one([sys.executable, "-c", "import time; time.sleep(60)"], os.environ, 30)
    (proc,) = seen
    assert proc.returncode is not None  # killed and reaped
    assert proc.stderr is not None and proc.stderr.closed
