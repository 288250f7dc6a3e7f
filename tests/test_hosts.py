"""The launcher on hosts, without starting anything: host lists and files, the remote
template and the command it runs, the arguments' checks, the bounds `initialize` reads
from the launcher, and the loopback host-name check."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from eqxshard._processes import addresses, joining, launcher, watch
from eqxshard._processes.clusters import Join
from eqxshard._processes.hosts import (
    check_hosts,
    check_template,
    placements,
    read_hostfile,
    remote_argv,
    script_command,
)


def test_hostfile(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# the run's nodes\nnode1\n\n  node2  # the second\n")
    assert read_hostfile(path) == ["node1", "node2"]
    path.write_text("node1 slots=2\nnode2\nnode3 x\n")
    with pytest.raises(ValueError, match=r"line 1: 'node1 slots=2'\n  line 3: 'node3 x'"):
        read_hostfile(path)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match=r"names no host: write one per line"):
        read_hostfile(path)


@pytest.mark.parametrize(
    ("hosts", "match"),
    [
        ([], r"`hosts` is empty"),
        (["node1", "", "-x"], r"not host names: \['', '-x'\]"),
        (["a", "b", "a"], r"`hosts` names a more than once"),
    ],
)
def test_bad_hosts(hosts, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_hosts(hosts)


def test_template() -> None:
    assert check_template("ssh -p 2222 {host}") == ["ssh", "-p", "2222", "{host}"]
    with pytest.raises(ValueError, match=r"has no `\{host\}`"):
        check_template("ssh node1")
    with pytest.raises(ValueError, match=r"cannot be split into words"):
        check_template("ssh 'node1 {host}")


def test_placements_and_the_remote_command(tmp_path: Path) -> None:
    hosts = ["a", "b"]
    assert [(p.process_id, p.host) for p in placements(hosts, 4)] == [
        (0, "a"), (1, "a"), (2, "b"), (3, "b"),
    ]  # fmt: skip
    script = tmp_path / "train.py"
    argv = remote_argv(
        ["ssh", "-o", "BatchMode=yes", "{host}"],
        "b",
        {"EQXSHARD_PROCESS_ID": "2", "X": "two words"},
        script_command([str(script), "--name", "it's"]),
    )
    assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "b"]
    # What the remote shell runs: the words back, as given.
    assert shlex.split(" ".join(argv[4:])) == [
        "env", "EQXSHARD_PROCESS_ID=2", "X=two words", sys.executable, str(script.resolve()),
        "--name", "it's",
    ]  # fmt: skip
    assert script_command(["-m", "pkg"]) == [sys.executable, "-m", "pkg"]
    assert script_command(["./run.sh"]) == ["./run.sh"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hosts": "node1,node2"}, TypeError, r"`hosts` must be a list of host names"),
        ({"hosts": ["a", 1]}, TypeError, r"`hosts` must be a list of strings"),
        ({"hosts": ["a"], "processes_per_host": 0}, ValueError, r"`processes_per_host` must be"),
        ({"hosts": ["a"], "remote": None}, TypeError, r"`remote` must be a string"),
        ({"hosts": ["a"], "remote": "ssh"}, ValueError, r"has no `\{host\}`"),
        ({"max_restarts": -1}, ValueError, r"`max_restarts` must be at least 0, got -1"),
        ({"heartbeat_timeout": 0}, ValueError, r"`heartbeat_timeout` must be at least 1"),
        ({"initialization_timeout": 1.5}, TypeError, r"`initialization_timeout` must be an int"),
        (
            {"hosts": ["a", "b"], "num_processes": 3},
            ValueError,
            r"`num_processes` is 3, but 2 hosts x 1 processes per host make 2",
        ),
        ({"hosts": ["a", "b"], "min_hosts": 0}, ValueError, r"`min_hosts` must be at least 1"),
        ({"hosts": ["a", "b"], "min_hosts": "1"}, TypeError, r"`min_hosts` must be an int"),
        (
            {"hosts": ["a", "b"], "min_hosts": 3},
            ValueError,
            r"`min_hosts` is 3, but the run has 2 hosts: give at most 2",
        ),
        ({"min_hosts": 1}, ValueError, r"`min_hosts` \(1\) is for runs on hosts: give `hosts`"),
    ],
)
def test_bad_launch_arguments(kwargs, error, match) -> None:
    arguments = {"command": ["x.py"], "num_processes": None, **kwargs}
    if "hosts" not in kwargs:
        arguments["num_processes"] = 1
    with pytest.raises(error, match=match):
        launcher.launch(**arguments)


def test_a_template_that_cannot_run_stops_the_run(capsys) -> None:
    code = launcher.main(
        ["--hosts", "a", "--remote", "/no/such/ssh {host}", "--timeout", "60", "--", "x.py"]
    )
    assert code == 127
    err = capsys.readouterr().err
    assert "[launch] cannot start process 0 on host a: `/no/such/ssh`: " in err
    assert "stopping the run" in err


def test_bounds_from_the_launcher(monkeypatch) -> None:
    monkeypatch.setenv("EQXSHARD_HEARTBEAT_TIMEOUT", "7")
    assert joining.launcher_timeout("heartbeat_timeout_seconds", None) == 7
    assert joining.launcher_timeout("heartbeat_timeout_seconds", 3) == 3  # the argument wins
    assert joining.launcher_timeout("shutdown_timeout_seconds", None) is None
    monkeypatch.setenv("EQXSHARD_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"EQXSHARD_HEARTBEAT_TIMEOUT='soon' is not a positive"):
        joining.launcher_timeout("heartbeat_timeout_seconds", None)


def test_a_loopback_host_name_with_no_way_out_stops_before_training(monkeypatch) -> None:
    monkeypatch.setattr(addresses, "loopback_fix", lambda *a: ("node2", "127.0.1.1", None))
    monkeypatch.setattr(watch, "start", lambda info: False)
    monkeypatch.setattr(joining, "_uses_gloo", lambda: True)
    join = Join("eqxshard.launch", {"coordinator_address": "node1:1234"}, 2, {})
    with pytest.raises(RuntimeError, match=r"'node2' resolves to 127\.0\.1\.1, a loopback"):
        joining.before(join, {})


def test_loopback_detection(monkeypatch) -> None:
    monkeypatch.setattr(addresses.socket, "gethostname", lambda: "node2")
    names = {"node2": "127.0.1.1", "node1": "127.0.0.1"}
    monkeypatch.setattr(addresses, "resolve", lambda host: names.get(host, host))
    # The whole run on this machine: loopback is right, nothing to fix.
    with pytest.raises(LookupError):
        addresses.loopback_fix("node1:1234")
    names["node1"] = "127.0.0.2"
    with pytest.raises(LookupError):
        addresses.loopback_fix("127.0.0.1:1234", [])
    assert addresses.is_loopback("127.0.1.1") and not addresses.is_loopback("10.0.0.1")
    assert addresses.split_host_port("[::1]:80") == ("::1", 80)
    assert addresses.split_host_port("node1") == ("node1", None)


def test_restarts_on_this_machine(tmp_path: Path, capfd) -> None:
    """A process that fails on the first attempt only: the run is started again, with
    the restart count in `EQXSHARD_RESTART_COUNT`, and ends well."""
    script = tmp_path / "flaky.py"
    script.write_text(
        "import os, sys\n"
        "attempt = os.environ['EQXSHARD_RESTART_COUNT']\n"
        "print('attempt', attempt, 'process', os.environ['EQXSHARD_PROCESS_ID'], flush=True)\n"
        "sys.exit(3 if attempt == '0' and os.environ['EQXSHARD_PROCESS_ID'] == '1' else 0)\n"
    )
    code = launcher.launch([str(script)], num_processes=2, max_restarts=2, grace=0.5, timeout=120)
    out, err = capfd.readouterr()
    assert code == 0, err
    assert "[1] attempt 0 process 1" in out and "[1] attempt 1 process 1" in out
    assert (
        "[launch] process 1 exited with code 3; ending the 1 still running; restarting the run "
        "(restart 1 of 2)"
    ) in err or (
        "[launch] process 1 exited with code 3; none left; restarting the run (restart 1 of 2)"
    ) in err
    code = launcher.launch([str(script)], num_processes=2, max_restarts=0, grace=0.5, timeout=120)
    assert code == 3
    assert "no restarts left" not in capfd.readouterr().err


def test_cli_min_hosts_errors(capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        launcher.main(["--hosts", "a,b", "--min-hosts", "3", "--", "x.py"])
    assert stopped.value.code == 2
    assert "`min_hosts` is 3, but the run has 2 hosts: give at most 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.main(["-n", "2", "--min-hosts", "1", "--", "x.py"])
    assert "`min_hosts` (1) is for runs on hosts" in capsys.readouterr().err
