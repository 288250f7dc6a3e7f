"""Which hosts each attempt of a run on hosts runs on (`--min-hosts K`), and how each of
its processes is started (`attempt_starts`).

With `min_hosts` below the number of hosts, a host that cannot be started again is left
out, and the next attempt runs on the others (its processes renumbered, the process count
smaller), as long as at least `min_hosts` remain; a host left out that can be started
again is taken in at a later restart (as torchrun's `--nnodes MIN:MAX`). A host cannot be
started again when:

- before a restart, the remote template cannot run `true` there (`probe`: ssh's 255
  "could not connect", another code, or no answer within `PROBE_S`);
- its process cannot be started in an attempt (the template exits with 255 before the
  process printed anything);
- its process failed the attempt before, and fails this one again at start-up (before it
  joined the run: `initialize` tells the launcher, see `clusters.JOINED_LINE`).

Without `min_hosts` (all hosts), nothing here runs: a host that cannot be started stops
the run, as before.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence

from .attempt import Start
from .children import child_command, run_variables
from .hosts import placements, remote_argv, script_command

# How long the probe of a host (`TEMPLATE true`) may take before the host is taken as
# unreachable: ssh without `-o ConnectTimeout` can wait minutes for a host that is down.
PROBE_S = 30.0


def _probe_one(argv: list[str], env: Mapping[str, str], timeout: float) -> str | None:
    """Why `argv` (the template running `true`) failed, or `None` where it exited with 0."""
    shown = " ".join(argv[: len(argv) - 2])  # the template's words, without `env true`
    try:
        proc = subprocess.Popen(
            argv,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as e:
        return f"`{shown}` cannot run: {e}"
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_probe(proc)
        return f"`{shown}` did not answer within {timeout:g} s"
    except BaseException:  # Ctrl-C while waiting: no probe left running, no pipe open
        _end_probe(proc)
        raise
    if proc.returncode == 0:
        return None
    said = [line.strip() for line in err.decode(errors="replace").splitlines() if line.strip()]
    return f"`{shown}` exited with {proc.returncode}: " + (" | ".join(said[-3:]) or "(no output)")


def _end_probe(proc: subprocess.Popen[bytes]) -> None:
    """Kills a probe (its own session only), reaps it and closes its pipe."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def probe(
    template: Sequence[str], hosts: Sequence[str], env: Mapping[str, str], timeout: float
) -> dict[str, str | None]:
    """Runs `TEMPLATE true` on every host at once; host -> why it failed, or `None`."""
    found: dict[str, str | None] = {}
    lock = threading.Lock()

    def one(host: str) -> None:
        why = _probe_one(remote_argv(template, host, {}, ["true"]), env, timeout)
        with lock:
            found[host] = why

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return found


@dataclasses.dataclass
class Membership:
    """The hosts of the run (`hosts`, in order), those left out (host -> why), and the
    least the run may shrink to."""

    hosts: list[str]
    min_hosts: int
    processes_per_host: int
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)
    # Left out for failing at start-up twice: its template runs, so a probe cannot tell
    # that it is well again. It stays out for the rest of the run.
    kept_out: set[str] = dataclasses.field(default_factory=set)

    @property
    def shrinks(self) -> bool:
        """Whether hosts may be left out at all (`min_hosts` below the host count)."""
        return self.min_hosts < len(self.hosts)

    def to_probe(self) -> list[str]:
        return [h for h in self.hosts if h not in self.kept_out]

    def current(self) -> list[str]:
        return [h for h in self.hosts if h not in self.left_out]

    def _size(self) -> str:
        n = len(self.current())
        k = n * self.processes_per_host
        return f"{k} process{'es' if k != 1 else ''} on {n} host{'s' if n != 1 else ''}"

    def enough(self) -> bool:
        return len(self.current()) >= self.min_hosts

    def too_few(self) -> str:
        """The line that stops the run when fewer than `min_hosts` hosts are left."""
        current = self.current()
        left = ", ".join(f"{h} ({why})" for h, why in self.left_out.items())
        return (
            f"only {len(current)} of {len(self.hosts)} hosts can be started "
            f"({', '.join(current) or 'none'}), fewer than --min-hosts {self.min_hosts}; "
            f"stopping the run. Left out: {left}"
        )

    def leave_out(self, host: str, why: str, *, for_good: bool = False) -> str:
        """Leaves `host` out (with `for_good`, for the rest of the run); the launcher's
        line saying so."""
        self.left_out[host] = why
        if for_good:
            self.kept_out.add(host)
        line = f"leaving out {host}: {why}"
        if self.enough():
            return f"{line}; the run goes on with {self._size()} (--min-hosts {self.min_hosts})"
        return line

    def refresh(self, found: Mapping[str, str | None]) -> list[str]:
        """Hosts that failed `probe` are left out, hosts left out that passed it are taken
        in again (not those kept out); the launcher's lines saying so."""
        lines = []
        for host in self.hosts:
            if host in self.kept_out or host not in found:
                continue
            why = found[host]
            if why is None and host in self.left_out:
                del self.left_out[host]
                lines.append(
                    f"taking {host} in again: it can be started again; the run goes on with "
                    f"{self._size()}"
                )
            elif why is not None and host not in self.left_out:
                lines.append(self.leave_out(host, f"it cannot be started again: {why}"))
        return lines


def attempt_starts(
    command: Sequence[str],
    *,
    num_processes: int,
    hosts: Sequence[str] | None,
    processes_per_host: int,
    template: list[str],
    port: int,
    base: Mapping[str, str],
    restart: int,
    variables: dict[str, int | None],
) -> list[Start]:
    """How to start each process of one attempt: on this machine (`hosts` is `None`) or
    on `hosts` (those of `Membership.current`), `processes_per_host` on each."""
    starts = []
    coordinator_host = "127.0.0.1" if hosts is None else hosts[0]
    for place in placements(hosts, num_processes):
        run = run_variables(
            process_id=place.process_id,
            num_processes=num_processes,
            coordinator=f"{coordinator_host}:{port}",
            hosts=hosts,
            processes_per_host=processes_per_host if hosts is not None else None,
            restart=restart,
            **variables,  # pyright: ignore[reportArgumentType]
        )
        if place.host is None:
            env = {**base, **run}
            starts.append(Start(place.process_id, child_command(command), env, None))
        else:
            argv = remote_argv(template, place.host, run, script_command(command))
            starts.append(Start(place.process_id, argv, dict(base), place.host))
    return starts
