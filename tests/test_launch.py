"""`python -m eqxshard.launch`: environment, output, and ending the run as one.

Most children here are tiny Python scripts without JAX (fast); two tests run real JAX
processes on 127.0.0.1. Every run has a time limit that only stops a hang; processes
are ended only by the launcher under test, or by these tests for processes they started.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import without_jax_settings

import eqxshard
from eqxshard._processes import (
    children,
    exits as _exits,
    initialize as _initialize,
    launcher as _launch,
)

# Only stops a run that hangs; the runs here take seconds on an idle machine.
HANG_S = 120


def hang_s() -> float:
    """`HANG_S`, stretched by how far the machine is loaded past its cores (the launcher
    and its children start Python processes, slow when many run at once): a bound that
    stops a hang, never one a busy but working run reaches."""
    busy = os.getloadavg()[0] / (os.cpu_count() or 1)
    return HANG_S * max(1.0, busy)


def child_env() -> dict[str, str]:
    """This environment without JAX/XLA settings, importing the eqxshard under test."""
    env = without_jax_settings(os.environ)
    root = str(Path(eqxshard.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def script(tmp_path: Path, source: str, name: str = "child.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eqxshard.launch", *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=hang_s() + 30,  # past a launcher's own `--timeout` of `hang_s()`
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    return False


def wait_for_files(paths: list[Path], proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + hang_s()
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"{paths} never appeared"
        assert proc is None or proc.poll() is None, "the launcher exited early"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- pieces


def test_process_env():
    env = _launch.process_env(
        {"HOME": "/x"}, process_id=1, num_processes=3, port=1234, devices_per_process=4
    )
    assert env["HOME"] == "/x"
    assert env[_initialize.COORDINATOR_VAR] == "127.0.0.1:1234"
    assert env[_initialize.NUM_PROCESSES_VAR] == "3"
    assert env[_initialize.PROCESS_ID_VAR] == "1"
    assert env["JAX_NUM_CPU_DEVICES"] == "4"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    assert env["PYTHONUNBUFFERED"] == "1"
    plain = _launch.process_env({}, process_id=0, num_processes=1, port=1)
    assert "JAX_NUM_CPU_DEVICES" not in plain and "JAX_PLATFORMS" not in plain


def test_child_command():
    # Python 3.11 runs scripts through run_main.py (it sees `raise SystemExit(n)`).
    runner = [children.RUN_MAIN] if sys.version_info < (3, 12) else []
    assert _launch.child_command(["train.py", "--x"]) == [
        sys.executable,
        *runner,
        "train.py",
        "--x",
    ]
    assert _launch.child_command(["-m", "pkg.mod"]) == [sys.executable, *runner, "-m", "pkg.mod"]
    assert _launch.child_command(["./run.sh", "a"]) == ["./run.sh", "a"]


def test_free_port_is_bindable():
    import socket

    port = _launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"command": []}, r"`command` is empty"),
        ({"num_processes": 0}, r"`num_processes` must be at least 1, got 0"),
        ({"devices_per_process": 0}, r"`devices_per_process` must be at least 1"),
        ({"timeout": 0}, r"`timeout` must be positive"),
    ],
)
def test_bad_arguments(kwargs, match):
    arguments = {"command": ["x.py"], "num_processes": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        _launch.launch(**arguments)


def test_cli_errors(capsys):
    with pytest.raises(SystemExit) as info:
        _launch.main(["-n", "2"])
    assert info.value.code == 2
    assert "no command given: add `-- script.py [args ...]`" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        _launch.main(["-n", "0", "--", "x.py"])
    assert info.value.code == 2
    assert "`num_processes` must be at least 1, got 0" in capsys.readouterr().err
    assert _launch.main(["-n", "1", "--", "./no-such-program"]) == 127
    assert "cannot run './no-such-program'" in capsys.readouterr().err
    # A script that does not exist: one line, before any process is started (each
    # process printed a traceback of the runner before).
    assert _launch.main(["-n", "2", "--", "no-such-script.py", "--flag"]) == 127
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[Errno 2] no such script: " in err
    assert "no-such-script.py; nothing was started" in err
    with pytest.raises(FileNotFoundError, match="no such script: .*nothing was started"):
        _launch.launch(["no-such-script.py"], num_processes=2)


@pytest.mark.heavy
def test_the_runner_says_a_missing_script_as_python_does(tmp_path):
    runner = Path(_launch.__file__).with_name("run_main.py")
    done = subprocess.run(
        [sys.executable, str(runner), "gone.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=hang_s(),
    )
    plain = subprocess.run(
        [sys.executable, "gone.py"], cwd=tmp_path, capture_output=True, text=True, timeout=hang_s()
    )
    assert (done.returncode, done.stderr) == (plain.returncode, plain.stderr) == (2, plain.stderr)
    assert "can't open file" in done.stderr and "Traceback" not in done.stderr


# ----------------------------------------------------------------------------- runs


def test_environment_and_prefixed_output(tmp_path):
    child = script(
        tmp_path,
        """
        import os, sys
        get = os.environ.get
        print(f"id={get('EQXSHARD_PROCESS_ID')} n={get('EQXSHARD_NUM_PROCESSES')} "
              f"at={get('JAX_COORDINATOR_ADDRESS')} cpus={get('JAX_NUM_CPU_DEVICES')}")
        print("to stderr", file=sys.stderr)
        print("no newline at the end", end="")
        """,
    )
    result = run_cli("-n", "3", "--devices-per-process", "2", "--", str(child), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    addresses = set()
    for i in range(3):
        ours = [line for line in lines if line.startswith(f"[{i}] ")]
        assert len(ours) == 2, result.stdout
        assert ours[0].startswith(f"[{i}] id={i} n=3 at=127.0.0.1:")
        assert ours[0].endswith(" cpus=2")
        assert ours[1] == f"[{i}] no newline at the end"
        addresses.add(ours[0].split("at=")[1].split()[0])
        assert f"[{i}] to stderr" in result.stderr.splitlines()
    assert len(addresses) == 1  # one coordinator for all


def test_failure_ends_the_others(tmp_path, capfd):
    """Process 1 fails; process 0 ignores SIGTERM, so the launcher must SIGKILL it."""
    child = script(
        tmp_path,
        f"""
        import os, signal, sys, time
        from pathlib import Path
        me = int(os.environ["EQXSHARD_PROCESS_ID"])
        here = Path({str(tmp_path)!r})
        if me == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            (here / "pid0").write_text(str(os.getpid()))
            time.sleep(600)
        else:
            while not (here / "pid0").exists():
                time.sleep(0.05)
            print("failing now", flush=True)
            sys.exit(3)
        """,
    )
    code = _launch.launch(
        [str(child)], num_processes=2, grace=0.5, timeout=hang_s(), env=child_env()
    )
    out, err = capfd.readouterr()
    assert code == 3, err
    assert "[1] failing now" in out
    assert "[launch] process 1 exited with code 3; ending the 1 still running" in err
    assert gone(int((tmp_path / "pid0").read_text()))


def sleeper(tmp_path):
    """A child that writes its pid to `tmp_path/pid<i>` and sleeps until it is ended."""
    return script(
        tmp_path,
        f"""
        import os, time
        from pathlib import Path
        me = os.environ["EQXSHARD_PROCESS_ID"]
        pid = Path({str(tmp_path)!r}, "pid" + me)
        Path(str(pid) + ".part").write_text(str(os.getpid()))
        os.replace(str(pid) + ".part", pid)  # whole when it appears: the test reads it then
        time.sleep(600)
        """,
    )


def test_timeout_ends_every_process(tmp_path, capfd):
    child = sleeper(tmp_path)
    code = _launch.launch([str(child)], num_processes=2, timeout=3, grace=0.5, env=child_env())
    _, err = capfd.readouterr()
    assert code == _launch.TIMEOUT_EXIT == 124
    assert "[launch] the run took longer than --timeout 3 s; ending every process" in err
    for i in range(2):
        assert gone(int((tmp_path / f"pid{i}").read_text()))


@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [
        (signal.SIGTERM, 128 + signal.SIGTERM, "got SIGTERM"),
        (signal.SIGINT, _launch.INTERRUPT_EXIT, "interrupted"),  # Ctrl-C
    ],
)
def test_stopping_the_launcher_ends_every_process(tmp_path, sig, code, said):
    child = sleeper(tmp_path)
    pids = [tmp_path / "pid0", tmp_path / "pid1"]
    launcher = subprocess.Popen(
        # Ctrl-C as a terminal sends it: a run started in the background (`cmd &` in a
        # script, as CI may start pytest) inherits SIGINT ignored, and Python keeps it so.
        # The launcher is exec'd with it at its default (a `preexec_fn` would fork this
        # process, which holds JAX's threads).
        [sys.executable, "-c", _SIGINT_DEFAULT, "-m", "eqxshard.launch", "-n", "2", "--"]
        + [str(child)],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ended = False
    try:
        wait_for_files(pids, launcher)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=hang_s())  # reaps it, closes its pipes
        ended = True
    finally:
        if not ended:
            # A hang (or a failed wait): end what this test started, the launcher and the
            # children it started (each in a session of its own: killing the launcher
            # leaves them running), and close the launcher's pipes.
            if launcher.poll() is None:
                launcher.kill()
            launcher.communicate()
            for path in pids:
                _kill_group_of(path)
    assert launcher.returncode == code
    assert f"[launch] {said}; ending every process" in err
    for path in pids:
        assert gone(int(path.read_text()))


_SIGINT_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
)


def _kill_group_of(path: Path) -> None:
    """SIGKILL to the process group led by the child whose pid `path` holds, if it still
    runs (the launcher starts each child as the leader of its own session)."""
    try:
        os.killpg(int(path.read_text()), signal.SIGKILL)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------- real JAX


def test_two_jax_processes_check_their_setup(tmp_path):
    child = script(
        tmp_path,
        """
        import eqxshard
        print("joined by", eqxshard.initialize())
        print(eqxshard.check_setup(processes=2, devices=8, local_devices=4, platform="cpu"))
        try:
            eqxshard.check_setup(processes=3, devices=6)
        except RuntimeError as e:
            print("check failed:", str(e).replace("\\n", " | "))
        """,
    )
    result = run_cli("-n", "2", "--devices-per-process", "4", "--", str(child), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for i in range(2):
        assert f"[{i}] joined by eqxshard.launch" in result.stdout
        assert (
            f"[{i}] process {i} of 2; 4 local of 8 devices (per process: 4, 4); backend 'cpu'"
            in result.stdout
        )
        failed = [line for line in result.stdout.splitlines() if line.startswith(f"[{i}] check")]
        assert len(failed) == 1, result.stdout
        assert "- processes: expected 3, but this run has 2." in failed[0]
        assert "- devices: expected 6, but found 8." in failed[0]


def test_an_uncaught_exception_ends_the_jax_run(tmp_path):
    """Process 1 raises while process 0 enters a collective that now never completes.

    Without `initialize`'s exit hook, process 1 would wait at exit in JAX's shutdown
    barrier and process 0 in the collective: the run would hang until JAX's timeouts
    (minutes), and the launcher's time limit here would end it with 124.
    """
    child = script(
        tmp_path,
        """
        import eqxshard
        eqxshard.initialize()
        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils

        multihost_utils.process_allgather(jnp.ones(1))
        if jax.process_index() == 1:
            raise RuntimeError("boom")
        multihost_utils.process_allgather(jnp.ones(1))
        """,
    )
    result = run_cli(
        "-n",
        "2",
        "--devices-per-process",
        "1",
        "--timeout",
        str(round(hang_s())),
        "--",
        str(child),
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    assert "[1] RuntimeError: boom" in result.stderr
    assert "[1] eqxshard: process 1 ended by an uncaught RuntimeError" in result.stderr
    assert "[launch] the run took longer" not in result.stderr


# ----------------------------------------------------------------------------- sys.exit


def test_sys_exit_after_initialize_is_still_a_system_exit(monkeypatch):
    """`sys.exit` as set by `initialize` raises a `SystemExit` that code can catch and
    read as before; only one reaching the top of the program ends the process at once."""
    monkeypatch.setattr(sys, "exit", sys.exit)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    # Python 3.11's way (on 3.12+ `sys.exit` is left alone): not `sys.monitoring` here,
    # which would outlive the test and end pytest itself at its exit.
    monkeypatch.setattr(_exits, "_watch_system_exit", lambda: False)
    _exits.end_promptly_on_errors()
    for status, code in [(3, 3), (None, None), ("bye", "bye"), (0, 0)]:
        with pytest.raises(SystemExit) as info:
            sys.exit(status)
        assert info.value.code == code
    with pytest.raises(SystemExit) as info:
        sys.exit(4)
    info.value.code = 5
    assert info.value.code == 5


EXITS = [("3", 3, False), ("'bye'", 1, False), ("0", 0, True)]
NEEDS_MONITORING = pytest.mark.skipif(
    sys.version_info < (3, 12),
    reason="outside the launcher, `raise SystemExit(n)` is caught through sys.monitoring "
    "(Python 3.12+; CI runs this on 3.13); the launched cases cover it on 3.11",
)


@pytest.mark.parametrize(
    ("call", "launched", "status", "code", "atexit_ran"),
    [("sys.exit", False, *e) for e in EXITS]
    + [pytest.param("raise SystemExit", False, *e, marks=NEEDS_MONITORING) for e in EXITS]
    + [("raise SystemExit", True, *e) for e in EXITS],
)
def test_system_exit_at_the_top_ends_at_once_with_its_code(
    tmp_path, call, launched, status, code, atexit_ran
):
    """Non-zero: the process ends at once (no `atexit` handlers, where JAX's shutdown
    barrier waits), with the code it was given; zero: Python exits as usual. A
    `SystemExit` caught on the way is a `SystemExit` as before. `launched`: started as
    `python -m eqxshard.launch` starts it (`child_command`), which covers
    `raise SystemExit(n)` on every Python, 3.11 included."""
    child = script(
        tmp_path,
        f"""
        import atexit, sys
        from eqxshard._processes import initialize as _initialize
        def main():
            _initialize.end_promptly_on_errors()
            atexit.register(lambda: print("atexit ran", flush=True))
            try:
                {call}(7)
            except SystemExit as e:
                print("caught", e.code, flush=True)
            {call}({status})
        main()
        """,
    )
    command = children.child_command([str(child)]) if launched else [sys.executable, str(child)]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=hang_s(),
        env=child_env(),
    )
    assert done.returncode == code, done.stderr
    assert "caught 7" in done.stdout
    assert ("atexit ran" in done.stdout) == atexit_ran
    if code:
        assert f"ended by SystemExit({status}) (exit code {code})" in done.stderr
    if status == "'bye'":
        assert "bye\n" in done.stderr


def test_cli_grace(capsys):
    with pytest.raises(SystemExit):
        _launch.main(["--help"])
    assert "--grace" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        _launch.main(["-n", "1", "--grace", "-1", "--", "x.py"])
    assert info.value.code == 2
    assert "`grace` must be >= 0 seconds, got -1.0" in capsys.readouterr().err


def test_the_output_forwarder_closes_its_pipe_when_writing_fails():
    """A child's pipe is closed on every way out of the thread that forwards it, also
    where writing the launcher's own output fails (e.g. a closed terminal)."""
    import threading
    import types

    from eqxshard._processes import attempt

    class Closed:
        def write(self, data: bytes) -> None:
            raise BrokenPipeError("the terminal is gone")

        def flush(self) -> None:
            pass

    read, write = os.pipe()
    os.write(write, b"a line\n")
    os.close(write)
    stream = os.fdopen(read, "rb")
    process = types.SimpleNamespace(
        joined=threading.Event(), printed=threading.Event(), stderr_tail=[]
    )
    with pytest.raises(BrokenPipeError):
        attempt._forward(stream, b"[0] ", Closed(), threading.Lock(), process, False, lambda: None)  # pyright: ignore[reportArgumentType]
    assert stream.closed
