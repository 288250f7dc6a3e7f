"""Which address this process is reached at by the others, and the table of every
process's host and address (for the lines that name a lost peer).

gloo (JAX's CPU collectives) tells the other processes to connect to the address this
host's name resolves to. Debian and Ubuntu map the host name to `127.0.1.1` in
`/etc/hosts`: on a run across nodes, the others are then told to connect to their own
loopback, and the run dies ~12 s later with `Gloo context initialization failed ...
Connection refused`. Here the address is read from the route to the coordinator (or to
another host of the run): the address of the interface that reaches them.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
from collections.abc import Sequence


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str | None:
    """`host`'s address (IPv4 first), or `None` where it does not resolve."""
    with contextlib.suppress(OSError, UnicodeError):
        return socket.gethostbyname(host)
    return None


def route_address(host: str, port: int = 9) -> str | None:
    """The address of this machine's interface that reaches `host`, or `None`.

    Read from a UDP socket `connect`ed to `host` (which only picks a route: no packet is
    sent)."""
    target = resolve(host)
    if target is None:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, port))
            return s.getsockname()[0]
    except OSError:
        return None


def split_host_port(address: str) -> tuple[str, int | None]:
    """`"node1:1234"` -> `("node1", 1234)`; `"[::1]:1234"` -> `("::1", 1234)`."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address, None
    return host.strip("[]"), int(port)


def reachable_address(coordinator: str, other_hosts: Sequence[str] = ()) -> str | None:
    """This process's address as the other processes reach it: the interface toward the
    coordinator's host, or toward another host of the run where the coordinator is this
    host; `None` where every route found is loopback."""
    host, port = split_host_port(coordinator)
    for target in (host, *other_hosts):
        address = route_address(target, port or 9)
        if address is not None and not is_loopback(address):
            return address
    return None


def loopback_fix(coordinator: str, other_hosts: Sequence[str] = ()) -> tuple[str, str, str | None]:
    """Where this host's name resolves to a loopback address but the run reaches across
    hosts: `(host name, its loopback address, the address to use instead or None)`.

    Raises `LookupError` where nothing is to be fixed (the name resolves to a network
    address, or the whole run is on this machine)."""
    name = socket.gethostname()
    resolved = resolve(name)
    if resolved is not None and not is_loopback(resolved):
        raise LookupError(name)
    coordinator_host, _ = split_host_port(coordinator)
    coordinator_address = resolve(coordinator_host)
    remote = [h for h in other_hosts if h != name]
    if (coordinator_address is None or is_loopback(coordinator_address)) and not remote:
        raise LookupError(name)  # a run on this machine: loopback is right
    return name, resolved or "(nothing)", reachable_address(coordinator, remote)


def port_taken(address: str) -> bool:
    """Whether another program listens on the port of `address` (`host:port`) here, where
    process 0 is about to start the coordinator on all interfaces, as JAX does. A port
    left in TIME_WAIT by an earlier run is free (JAX's server reuses it)."""
    _, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        return False
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here: the IPv4 one
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                return e.errno == errno.EADDRINUSE
            return False
    return False
