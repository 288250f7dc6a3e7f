"""A simulated cluster on this machine: each node a Linux network namespace with its own
address, host name and `/etc/hosts`, all joined by one bridge.

    with Cluster(2, workdir) as cluster:
        cluster.run("node2", "hostname")          # -> "node2"
        template = cluster.template               # "sh WORKDIR/enter {host}"

`cluster.template` is a stand-in for `ssh -o BatchMode=yes {host}`: `enter HOST WORDS...`
joins WORDS with spaces and runs them with `sh -c` inside node HOST, as ssh runs a command
through the remote shell; an unknown host exits 255, as ssh does. Each command entering a
node is bounded by `timeout -s KILL` (`ENTER_LIMIT_S`).
`cluster.fragile(host)` makes a node die with its process: once a command in it fails,
`enter` refuses it with ssh's 255 ("No route to host"), as for a node that is down.

Names are unique per cluster (`eqxs` + 6 hex digits, so that interface names fit Linux's
15 characters). Everything made is removed on leaving, also after a failed test: the
processes inside each namespace (SIGKILL, found with `ip netns pids`: only those this
cluster's commands started), the namespaces, the bridge (and with the namespaces their
veth links). Mounts (`/etc/hosts` bound over per node) live in the mount namespaces of the
commands that entered the node, which end with them. `sweep()` removes what a killed test
session left behind: every cluster whose owner process is gone, as recorded in
`REGISTRY`. The machine's own files are never touched: no `/etc/netns`, no `/etc/hosts`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

PREFIX = "eqxs"
# Owner pid of each cluster made here, by cluster id, so that a later sweep can remove
# the clusters of a session that was killed before its finalizers ran.
REGISTRY = Path(tempfile.gettempdir()) / "eqxshard-test-clusters"
# Any single command entering a node ends within this (SIGKILL), whatever it does.
ENTER_LIMIT_S = 300
SUBNET = "10.23.0"

ENTER = """#!/bin/sh
# enter HOST WORDS...: run WORDS (joined by spaces, through `sh -c`, as ssh does) in the
# simulated node HOST: its network namespace, its host name, its /etc/hosts.
# A node that is down (a file `down`: how many more tries it refuses, empty for all)
# refuses with ssh's 255; a fragile node (a file `fragile`) goes down when a command in
# it fails, refusing as many tries as `fragile` says.
host=$1
shift
dir=$(dirname "$0")/nodes/$host
if [ ! -f "$dir/netns" ]; then
  echo "enter: ssh: Could not resolve hostname $host: Name or service not known" >&2
  exit 255
fi
if [ -f "$dir/down" ]; then
  left=$(cat "$dir/down")
  if [ -z "$left" ] || [ "$left" -gt 0 ]; then
    [ -n "$left" ] && echo $((left - 1)) > "$dir/down"
    echo "enter: ssh: connect to host $host port 22: No route to host" >&2
    exit 255
  fi
  rm -f "$dir/down"
fi
if [ ! -f "$dir/fragile" ]; then
  exec timeout -s KILL {limit} ip netns exec "$(cat "$dir/netns")" unshare -m -u sh -c \\
    'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec sh -c "$*"' \\
    enter "$dir/hosts" "$host" "$@"
fi
# (--foreground: the command stays in this process group, which the launcher ends.)
timeout --foreground -s KILL {limit} ip netns exec "$(cat "$dir/netns")" unshare -m -u \\
  sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec sh -c "$*"' \\
  enter "$dir/hosts" "$host" "$@"
code=$?
if [ "$code" -ne 0 ] && [ -f "$dir/fragile" ]; then
  mv "$dir/fragile" "$dir/down"
fi
exit $code
"""


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or `None` where they can."""
    if os.geteuid() != 0:
        return "simulated nodes need root (network namespaces, a bridge, mounts)"
    for tool in ("ip", "unshare", "timeout", "mount"):
        if shutil.which(tool) is None:
            return f"simulated nodes need `{tool}` (apt-get install -y iproute2 util-linux)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(netns: str) -> None:
    """SIGKILL to every process inside `netns` (all were started by this cluster)."""
    found = _ip("netns", "pids", netns, check=False)
    for word in found.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(word), signal.SIGKILL)


def _remove(cluster_id: str) -> None:
    """Removes everything of cluster `cluster_id` that is still there."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.startswith(f"{PREFIX}n{cluster_id}")]
    for netns in names:
        _kill_inside(netns)
    for netns in names:
        _ip("netns", "del", netns, check=False)
    links = _ip("-o", "link", "show", check=False).stdout.split("\n")
    for line in links:
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith((f"{PREFIX}b{cluster_id}", f"{PREFIX}v{cluster_id}")):
                _ip("link", "del", name, check=False)
    (REGISTRY / cluster_id).unlink(missing_ok=True)


def sweep() -> list[str]:
    """Removes the clusters whose owner process is gone; returns their ids."""
    if not REGISTRY.is_dir():
        return []
    swept = []
    for entry in REGISTRY.iterdir():
        try:
            owner = int(entry.read_text())
        except (OSError, ValueError):
            owner = 0
        if owner and _alive(owner):
            continue
        _remove(entry.name)
        swept.append(entry.name)
    return swept


class Cluster:
    """`num_nodes` simulated nodes `node1` ... `nodeN` at 10.23.0.1 ... (see the module).

    - `loopback_hostnames`: nodes whose own name maps to 127.0.1.1 in their `/etc/hosts`
      (as Debian and Ubuntu write it), the others' names to their real addresses.
    """

    def __init__(
        self, num_nodes: int, workdir: Path, *, loopback_hostnames: Sequence[str] = ()
    ) -> None:
        if not 1 <= num_nodes <= 9:
            raise ValueError(f"1 to 9 nodes, got {num_nodes}")
        self.id = secrets.token_hex(3)
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.hosts = [f"node{i}" for i in range(1, num_nodes + 1)]
        self.addresses = {h: f"{SUBNET}.{i}" for i, h in enumerate(self.hosts, 1)}
        self.loopback_hostnames = set(loopback_hostnames)
        self.bridge = f"{PREFIX}b{self.id}"
        self.enter = workdir / "enter"
        self.template = f"sh {self.enter} {{host}}"

    def netns(self, host: str) -> str:
        return f"{PREFIX}n{self.id}{host.removeprefix('node')}"

    def veth(self, host: str) -> str:
        """The host-side end of `host`'s link to the bridge."""
        return f"{PREFIX}v{self.id}{host.removeprefix('node')}"

    def __enter__(self) -> Cluster:
        REGISTRY.mkdir(exist_ok=True)
        (REGISTRY / self.id).write_text(str(os.getpid()))
        try:
            self._make()
        except BaseException:
            _remove(self.id)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        _remove(self.id)

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            netns, veth = self.netns(host), self.veth(host)
            _ip("netns", "add", netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", netns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            node = self.workdir / "nodes" / host
            node.mkdir(parents=True)
            (node / "netns").write_text(netns)
            lines = ["127.0.0.1 localhost"]
            for other, address in self.addresses.items():
                own_loopback = other == host and host in self.loopback_hostnames
                lines.append(f"{'127.0.1.1' if own_loopback else address} {other}")
            (node / "hosts").write_text("\n".join(lines) + "\n")
        self.enter.write_text(ENTER.replace("{limit}", str(ENTER_LIMIT_S)))

    def run(self, host: str, command: str, timeout: float = 60) -> str:
        """`command` (a shell line) on `host`; its stdout. Raises if it fails."""
        done = subprocess.run(
            ["sh", str(self.enter), host, command],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode:
            raise RuntimeError(f"{command!r} on {host}: exit {done.returncode}: {done.stderr}")
        return done.stdout

    # ------------------------------------------------------------------ faults

    def cut(self, host: str) -> None:
        """Cuts `host`'s link: packets to and from it are dropped, no reset is sent."""
        _ip("link", "set", self.veth(host), "down")

    def mend(self, host: str) -> None:
        _ip("link", "set", self.veth(host), "up")

    def fragile(self, host: str, refuse: int | None = None) -> None:
        """When a command run in `host` next fails (e.g. its process dies), `host` goes
        down: it refuses the next `refuse` tries to enter it (`None`: every try) with
        ssh's 255 "No route to host", as a node that died would."""
        (self.workdir / "nodes" / host / "fragile").write_text(
            "" if refuse is None else str(refuse)
        )

    def is_down(self, host: str) -> bool:
        return (self.workdir / "nodes" / host / "down").exists()

    def python_pids(self, host: str, *, main_only: bool = False) -> list[int]:
        """The Python processes running inside `host`; with `main_only`, not the stderr
        watchers `eqxshard.initialize` starts (`failures.py`)."""
        found = _ip("netns", "pids", self.netns(host), check=False).stdout.split()
        pids = []
        for word in found:
            with contextlib.suppress(OSError):
                if not Path(f"/proc/{word}/comm").read_text().strip().startswith("python"):
                    continue
                if main_only and b"failures.py" in Path(f"/proc/{word}/cmdline").read_bytes():
                    continue
                pids.append(int(word))
        return pids

    def signal(self, host: str, sig: int, *, main_only: bool = False) -> list[int]:
        """Sends `sig` to the Python processes inside `host` (see `python_pids`); returns
        their ids."""
        pids = self.python_pids(host, main_only=main_only)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids


@contextlib.contextmanager
def cluster(num_nodes: int, workdir: Path, **kwargs: object) -> Iterator[Cluster]:
    with Cluster(num_nodes, workdir, **kwargs) as made:  # type: ignore[arg-type]
        yield made
