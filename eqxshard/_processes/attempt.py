"""One attempt of a launched run: start every process, forward their output, and wait
until they all end well or the first one ends badly (then end the others).

`launch` (in `launcher.py`) makes one attempt, and with `max_restarts` another after each
failure. Only processes started here (and whatever they started: each leads its own
session) are ever signalled.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from .children import POLL_S, Stopped, end_all, exit_code
from .clusters import JOINED_LINE
from .gloo_chatter import GlooChatter
from .hosts import SSH_FAILED

_JOINED = JOINED_LINE.encode()
TIMEOUT_EXIT = 124
INTERRUPT_EXIT = 130
# Lines of each process's stderr kept, to quote when its host could not be started.
_KEPT_LINES = 5


@dataclasses.dataclass(frozen=True)
class Start:
    """How to start one process: its argv and environment, and where it runs."""

    process_id: int
    argv: list[str]
    env: dict[str, str]
    host: str | None  # None: this machine


@dataclasses.dataclass
class Outcome:
    """How an attempt ended.

    - `code`: the launcher's exit code for it (0: every process ended well).
    - `kind`: `"done"`, `"failed"` (a process ended badly: a restart may help),
      `"unstarted"` (a host could not be started: the run stops), `"timeout"`,
      `"interrupted"` or `"stopped"` (the launcher got a signal).
    - `message`: what happened, for the launcher's `[launch]` line.
    - `host`: where the process that ended it ran (`None`: this machine, or none).
    - `joined`: whether that process had joined the run (`initialize` said so).
    - `since`: when the launcher saw the first process end badly (`time.monotonic()`).
    - `why`: for `"failed"` and `"unstarted"`, the message's first part alone.
    """

    code: int
    kind: str
    message: str = ""
    host: str | None = None
    joined: bool = False
    since: float = 0.0
    why: str = ""


class _Process:
    def __init__(self, start: Start, popen: subprocess.Popen[bytes]) -> None:
        self.start = start
        self.popen = popen
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_KEPT_LINES)
        self.printed = threading.Event()  # a line came on its stdout
        self.joined = threading.Event()  # `initialize` said it joined the run

    def where(self) -> str:
        host = f" on {self.start.host}" if self.start.host is not None else ""
        return f"process {self.start.process_id}{host}"


# How long the launcher waits, after a process ended badly, for others ending with it.
SETTLE_S = 0.5


def _killed(returncode: int) -> bool:
    """Whether a process was ended by a signal (directly, or under a shell: 128 + N) other
    than SIGABRT, which is how JAX ends a process that lost a peer: a cause, not an effect."""
    sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else None
    return sig is not None and sig != signal.SIGABRT


def how_it_ended(returncode: int) -> str:
    """`code 1`, `code -9 (killed by SIGKILL)`, `code 137 (128 + SIGKILL: killed by it)`."""
    if returncode < 0:
        try:
            return f"code {returncode} (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            return f"code {returncode} (killed by signal {-returncode})"
    if returncode > 128:
        try:
            name = signal.Signals(returncode - 128).name
            return f"code {returncode} (128 + {name}: killed by it)"
        except ValueError:
            pass
    return f"code {returncode}"


def _forward(
    stream: IO[bytes],
    prefix: bytes,
    out: IO[bytes],
    lock: threading.Lock,
    process: _Process,
    is_stderr: bool,
    on_joined: Callable[[], None],
) -> None:
    chatter = GlooChatter()  # one per process: its messages can be split over two lines
    with stream:  # closed on every way out, also where writing to `out` fails
        for line in iter(stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            if is_stderr and _JOINED in line:  # for the launcher, not shown
                process.joined.set()
                on_joined()
                line = line.replace(_JOINED, b"")
                if not line.strip():
                    continue
            if is_stderr:
                process.stderr_tail.append(line.decode(errors="replace").rstrip())
            else:
                process.printed.set()
            with lock:
                for kept in chatter.filter(line):
                    out.write(prefix + kept)
                out.flush()
        with lock:
            for kept in chatter.flush():
                out.write(prefix + kept)
            out.flush()


def run_attempt(
    starts: Sequence[Start],
    *,
    out: IO[bytes],
    err: IO[bytes],
    lock: threading.Lock,
    note: Callable[[str], None],
    deadline: float | None,
    timeout: float | None,
    grace: float,
    remote: bool,
    on_joined: Callable[[], None] | None = None,
) -> Outcome:
    """Starts `starts`, waits for them; see the module. Raises `OSError` with the host in
    its message when a process cannot be started at all (e.g. the template is missing).
    `on_joined` is called once, when every process has said that it joined the run."""
    procs: list[_Process] = []
    told, all_joined = threading.Lock(), threading.Event()

    def one_joined() -> None:
        with told:
            if all_joined.is_set() or len(procs) < len(starts):
                return
            if all(p.joined.is_set() for p in procs):
                all_joined.set()
                if on_joined is not None:
                    on_joined()

    exits: queue.Queue[tuple[int, int]] = queue.Queue()  # (index, return code), in exit order
    threads: list[threading.Thread] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _raise_stopped)
    try:
        for index, start in enumerate(starts):
            try:
                popen = subprocess.Popen(
                    start.argv,
                    env=start.env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as e:
                where = f" on host {start.host}" if start.host is not None else ""
                raise OSError(
                    f"cannot start process {start.process_id}{where}: `{start.argv[0]}`: {e}"
                ) from e
            process = _Process(start, popen)
            procs.append(process)
            waiter = threading.Thread(
                target=lambda i=index, p=popen: exits.put((i, p.wait())), daemon=True
            )
            waiter.start()
            prefix = f"[{start.process_id}] ".encode()
            for stream, sink, is_err in ((popen.stdout, out, False), (popen.stderr, err, True)):
                assert stream is not None
                t = threading.Thread(
                    target=_forward,
                    args=(stream, prefix, sink, lock, process, is_err, one_joined),
                    daemon=True,
                )
                t.start()
                threads.append(t)
        remaining = len(procs)
        while remaining:
            try:
                # Short waits: a blocking `get` would hold off Ctrl-C and the timeout.
                index, returncode = exits.get(timeout=POLL_S)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    note(f"the run took longer than --timeout {timeout:g} s; ending every process")
                    return Outcome(TIMEOUT_EXIT, "timeout")
                continue
            remaining -= 1
            if returncode == 0:
                continue
            # A peer of a process that was killed ends as soon as it sees the loss, maybe
            # before the launcher heard of the kill: wait a moment for exits arriving at the
            # same time and report the root cause (a process killed by a signal) first.
            since = time.monotonic()
            ended, settle = [(index, returncode)], since + SETTLE_S
            while remaining and (left := settle - time.monotonic()) > 0:
                try:
                    other = exits.get(timeout=left)
                except queue.Empty:
                    break
                remaining -= 1
                if other[1] != 0:
                    ended.append(other)
            index, returncode = min(ended, key=lambda e: not _killed(e[1]))
            process = procs[index]
            others = f"ending the {remaining} still running" if remaining else "none left"
            # Let its last stderr lines arrive before quoting them.
            for t in threads[2 * index : 2 * index + 2]:
                t.join(timeout=1.0)
            if remote and returncode == SSH_FAILED and not process.printed.is_set():
                said = " | ".join(process.stderr_tail) or "(it printed nothing)"
                template = " ".join(process.start.argv[: _template_length(process.start)])
                why = f"`{template}` exited with {returncode}: {said}"
                return Outcome(
                    exit_code(returncode),
                    "unstarted",
                    f"cannot start {process.where()}: {why}; stopping the run ({others})",
                    host=process.start.host,
                    since=since,
                    why=why,
                )
            return Outcome(
                exit_code(returncode),
                "failed",
                f"{process.where()} exited with {how_it_ended(returncode)}; {others}",
                host=process.start.host,
                joined=process.joined.is_set(),
                since=since,
                why=f"{process.where()} exited with {how_it_ended(returncode)}",
            )
        return Outcome(0, "done")
    except KeyboardInterrupt:
        note("interrupted; ending every process")
        return Outcome(INTERRUPT_EXIT, "interrupted")
    except Stopped as e:
        note(f"got {e}; ending every process")
        return Outcome(128 + e.signum, "stopped")
    finally:
        end_all([p.popen for p in procs], grace)
        for t in threads:
            t.join(timeout=grace)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _template_length(start: Start) -> int:
    """How many leading words of `start.argv` are the remote template's (before `env`)."""
    for i, word in enumerate(start.argv):
        if word == "env":
            return i
    return len(start.argv)


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)
