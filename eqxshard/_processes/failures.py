"""What happened when a run of several processes lost one: `eqxshard: ...` lines from
JAX's own failure text.

When a process of a multi-process run is lost (its node cut off, killed, stopped), JAX
ends every other process with a native abort (SIGABRT, exit code 134) and a C++ log line
(`Terminating process because the JAX distributed service detected fatal errors ...
absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending
heartbeats): 1 ...`), or a collective raises (`Gloo AllGather failed ... Connection
closed by peer [10.0.0.2]:41235`). Nothing in the process can run after the abort:
JAX's hook for it (`missed_heartbeat_callback`) fails to pass the status to Python in
jaxlib 0.10 (`std::bad_cast`, itself an abort). So `initialize` routes the process's
stderr through a small watcher process (this file, run as a script by path: stdlib only,
it never imports JAX): it forwards every byte unchanged, and when the process ends after
such text, it adds one line naming the lost process (id, host, address), what was seen,
the newest checkpoint this process completed, and what to do.

The process tells the watcher what it knows through control lines on the same stream
(never forwarded): `CONTROL + json + "\\n"`, written in one `os.write` (atomic on a pipe).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
from typing import Any

CONTROL = b"\x1b[eqxshard-watch]"
# What is kept of the stream for reading JAX's text at the end (its failure text is the
# last few kilobytes; a stack trace follows it).
TAIL_BYTES = 1 << 16

UNHEALTHY = re.compile(
    r"tasks are unhealthy \(stopped sending heartbeats\):\s*\n((?:\s*\d+\s*\n)+)"
)
# A barrier (or any call) of the coordination service failing on a task it took as lost.
TASK_TIMEOUT = re.compile(r"Task (\d+) heartbeat timeout")
FATAL = "Terminating process because the JAX distributed service detected fatal errors"
# JAX's barrier at the end of the script, which some processes did not reach in time.
SHUTDOWN = re.compile(
    r"Barrier timed out\. Id: Shutdown::.*?Some timed out task names:\s*\n((?:\s*\d+\s*\n)+)",
    re.S,
)
GLOO_PEER = re.compile(
    r"Gloo ([\w-]+) failed: .*?(Connection (?:closed|reset) by peer|Connection refused|"
    r"Timed out|Socket closed)[^\[\n]*(?:\[([0-9a-fA-F.:]+)\]:\d+)?"
)
GLOO_INIT = re.compile(r"Gloo context initialization failed.*?remote=\[([0-9a-fA-F.:]+)\]")
LOOPBACK = re.compile(r"^(127\.|::1$|0:0:0:0:0:0:0:1$)")


def _peer(info: dict[str, Any], process: int) -> str:
    """`process 1 (host node2, address 10.0.0.2)`, with what is known of it."""
    peers = info.get("peers") or {}
    known = list(peers.get(str(process)) or [])
    if len(known) > 1 and known[0] and not known[1]:  # only the launcher's host name
        try:
            known[1] = socket.gethostbyname(known[0])
        except (OSError, UnicodeError):
            pass
    parts = []
    if known and known[0]:
        parts.append(f"host {known[0]}")
    if len(known) > 1 and known[1]:
        parts.append(f"address {known[1]}")
    where = f" ({', '.join(parts)})" if parts else ""
    return f"process {process}{where}"


def _by_address(info: dict[str, Any], address: str) -> int | None:
    for process, known in (info.get("peers") or {}).items():
        if len(known) > 1 and known[1] == address:
            return int(process)
    return None


def _checkpoint(info: dict[str, Any]) -> str:
    saved = info.get("checkpoint")
    if not saved:
        return "No checkpoint was completed by this process in this run."
    directory, step = saved
    return f"The newest complete checkpoint is step {step} in {directory}."


def _todo(info: dict[str, Any], lost: str) -> str:
    resume = (
        "Resume from it (e.g. `--resume`), or let `python -m eqxshard.launch --max-restarts R` "
        "restart the run by itself"
        if info.get("checkpoint")
        else "Start the run again (`python -m eqxshard.launch --max-restarts R` does it by itself)"
    )
    return f"{resume}; if it happens again, look at the log of {lost} and at its node and network."


def explain(text: str, info: dict[str, Any]) -> str | None:
    """The `eqxshard: ...` line for JAX's failure `text` (the end of a process's stderr),
    or `None` where the text shows no lost peer.

    `info`: `process` (this process's id), `num_processes`, `host`, `peers` (process id
    as a string -> `[host, address]`, as far as known), `heartbeat_timeout` and
    `initialization_timeout` (seconds), `checkpoint` (`[directory, step]` or absent).
    """
    me = int(info.get("process", -1))
    count = int(info.get("num_processes", 0))
    here = (f"process {me}" if me >= 0 else "this process") + (
        f" on {info['host']}" if info.get("host") else ""
    )
    heartbeat = info.get("heartbeat_timeout")
    within = f" for {heartbeat} s (the heartbeat timeout)" if heartbeat else ""
    checkpoint = _checkpoint(info)

    gloo_init = GLOO_INIT.search(text)
    if gloo_init and LOOPBACK.match(gloo_init.group(1)):
        return (
            f"eqxshard: {here} cannot reach a peer at {gloo_init.group(1)}, a loopback "
            "address: that peer's host name resolves to a loopback address (Debian and "
            "Ubuntu write `127.0.1.1 HOSTNAME` in /etc/hosts), so gloo told the others to "
            "connect to it there. Map each node's name to its network address in its "
            "/etc/hosts, or start it with `eqxshard.initialize()` (which picks the address "
            "that reaches the coordinator)."
        )
    unhealthy = UNHEALTHY.search(text)
    timed_out = sorted({int(t) for t in TASK_TIMEOUT.findall(text)})
    if unhealthy or timed_out:
        tasks = [int(t) for t in unhealthy.group(1).split()] if unhealthy else timed_out
        if tasks == [me]:
            return (
                f"eqxshard: {here} was itself taken as lost: it sent no heartbeat{within} "
                "(it was stopped, starved of CPU, or cut off), and the other processes have "
                f"ended. {checkpoint} {_todo(info, 'this process')}"
            )
        others = [t for t in tasks if t != me]
        lost = ", ".join(_peer(info, t) for t in others)
        return (
            f"eqxshard: {here} lost {lost}: it stopped sending heartbeats{within} "
            "(crashed, killed, stopped, or its link cut), as JAX's coordination service "
            f"reported. This process ends too. {checkpoint} {_todo(info, lost)}"
        )
    shutdown = SHUTDOWN.search(text)
    if shutdown:
        late = [int(t) for t in shutdown.group(1).split()]
        bounds = (
            "`initialize(shutdown_timeout_seconds=...)` sets how long the others wait "
            "(JAX's default: 300 s), the launcher's `--timeout` bounds the whole run."
        )
        if me in late:
            return (
                f"eqxshard: {here} did not reach the end of the script within the shutdown "
                "timeout, while other processes of the run had and waited for it: it was "
                f"still working, or hung. This process ends too. {checkpoint} Look at what "
                f"it was doing (its log above). {bounds}"
            )
        lagging = ", ".join(_peer(info, t) for t in late)
        return (
            f"eqxshard: {here} reached the end of the script, but {lagging} did not within "
            "the shutdown timeout: it is still working, or hung (the processes of a run end "
            f"together). This process ends too. {checkpoint} Look at the log of {lagging}. "
            f"{bounds}"
        )
    if FATAL in text or "CoordinationService/" in text:
        coordinator = _peer(info, 0)
        if me == 0:
            coordinator = "its own coordination service"
        if "RegisterTask" in text:
            timeout = info.get("initialization_timeout")
            waited = f" within {timeout} s (the initialization timeout)" if timeout else ""
            missing = [p for p in range(count) if p != me]
            if len(missing) == 1:
                who = _peer(info, missing[0])
            else:
                who = "one or more of " + ", ".join(_peer(info, p) for p in missing)
            return (
                f"eqxshard: {here} gave up at start-up: {who} never joined the run{waited} "
                "(not started, stuck before `initialize`, or unable to reach the "
                f"coordinator {_peer(info, 0)}). Nothing was trained. Check that every "
                "host started its process (the launcher's output says which did) and that "
                "the coordinator's port is open between the hosts."
            )
        if "DEADLINE_EXCEEDED" in text and "Heartbeat" in text:
            seen = f"no answer to its heartbeats{within}: the link to it is cut or its node is down"
        elif "Socket closed" in text or "Connection refused" in text or "UNAVAILABLE" in text:
            seen = "the connection to it closed: its process ended or its node went away"
        else:
            seen = "the coordination service reported a fatal error"
        lost_name = _peer(info, 0) if me != 0 else coordinator
        return (
            f"eqxshard: {here} lost the coordinator, {lost_name}: {seen}. This process ends "
            f"too. {checkpoint} {_todo(info, _peer(info, 0))}"
        )
    gloo = GLOO_PEER.search(text)
    if gloo:
        address = gloo.group(3)
        process = _by_address(info, address) if address else None
        if process is not None:
            lost = _peer(info, process)
        elif address:
            lost = f"the process at {address}"
        else:
            lost = "a peer"
        return (
            f"eqxshard: {here} lost {lost}: its connection failed in a collective (gloo "
            f"{gloo.group(1)}: {gloo.group(2).lower()}): it crashed, was killed, or its link "
            f"was cut. This process ends too. {checkpoint} {_todo(info, lost)}"
        )
    return None


# ----------------------------------------------------------------------------- the watcher


def _control(line: bytes, info: dict[str, Any]) -> None:
    try:
        update = json.loads(line[len(CONTROL) :])
    except ValueError:
        return
    if not isinstance(update, dict):
        return
    peers = update.pop("peers", None)
    if isinstance(peers, dict):  # sent in parts: merged
        info.setdefault("peers", {}).update(peers)
    info.update(update)


def watch(source: int, sink: int, info: dict[str, Any]) -> None:
    """Forwards `source` to `sink` unchanged but for control lines, until end of file;
    then writes the `eqxshard:` line, if the text calls for one."""
    tail = bytearray()
    pending = b""  # the start of a line that may be a control line
    while True:
        try:
            chunk = os.read(source, 1 << 16)
        except InterruptedError:
            continue
        if not chunk:
            break
        data = pending + chunk
        pending = b""
        out = bytearray()
        while data:
            newline = data.find(b"\n")
            line, data = (data, b"") if newline < 0 else (data[: newline + 1], data[newline + 1 :])
            if line.startswith(CONTROL):
                if line.endswith(b"\n"):
                    _control(line.rstrip(b"\n"), info)
                else:
                    pending = line
            elif newline < 0 and CONTROL.startswith(line):
                pending = line
            else:
                out += line
        if out:
            tail += out
            del tail[:-TAIL_BYTES]
            _write(sink, bytes(out))
    if pending and not pending.startswith(CONTROL):
        _write(sink, pending)
    line = explain(tail.decode(errors="replace"), info)
    if line is not None:
        _write(sink, b"\n" + line.encode() + b"\n")


def _write(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data) :]
        except InterruptedError:
            continue
        except OSError:  # the reader is gone: nothing more can be shown
            return


def main() -> None:
    # Ended by the end of the stream only: the signals a launcher sends to the whole
    # process group are for the process it watches, whose last words it must still pass on.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    info = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    watch(0, 1, info)


if __name__ == "__main__":
    main()
