"""What `initialize` does around `jax.distributed.initialize` on a run of several
processes: the bounds the launcher set, the watcher that explains a lost peer
(`watch.py`), the gloo address on hosts whose name resolves to loopback
(`addresses.py`), and the table of every process's host and address.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

import jax

from .. import _compat
from .._checkpoint.async_save import ON_COMPLETE
from . import addresses, watch
from .clusters import (
    COORDINATOR_VAR,
    HEARTBEAT_TIMEOUT_VAR,
    HOSTS_VAR,
    INITIALIZATION_TIMEOUT_VAR,
    PROCESSES_PER_HOST_VAR,
    SLURM_RANK,
    Join,
)

# The peer table is exchanged through JAX's key-value store up to this many processes
# (every process reads every entry); above it, the launcher's host list names the peers.
_EXCHANGE_MAX = 1024
_PEER_KEY = "eqxshard/peer/"


def launcher_timeout(name: str, argument: int | None) -> int | None:
    """`argument`, or where it is `None` the launcher's variable for it (a positive int)."""
    variable = {
        "initialization_timeout": INITIALIZATION_TIMEOUT_VAR,
        "heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT_VAR,
    }.get(name)
    if argument is not None or variable is None or variable not in os.environ:
        return argument
    value = os.environ[variable]
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"The environment variable {variable}={value!r} is not a positive number of "
            "seconds. It is set by `python -m eqxshard.launch`; unset it to use JAX's default."
        )
    return int(value)


def run_hosts(env: Mapping[str, str]) -> tuple[list[str], int] | None:
    """The launcher's host list and processes per host, where it set them."""
    if HOSTS_VAR not in env:
        return None
    per_host = env.get(PROCESSES_PER_HOST_VAR, "1")
    return env[HOSTS_VAR].split(","), int(per_host) if per_host.isdigit() else 1


def _uses_gloo() -> bool:
    """Whether JAX's CPU collectives are gloo's (the launcher sets them)."""
    return getattr(jax.config, "jax_cpu_collectives_implementation", None) == "gloo"


def _process_id(join: Join) -> int:
    """This process's id as known before joining (-1 where only JAX will know it)."""
    if "process_id" in join.kwargs:
        return int(join.kwargs["process_id"])
    rank = os.environ.get(SLURM_RANK, "")  # what JAX reads under Slurm
    return int(rank) if join.how == "SlurmCluster" and rank.isdigit() else -1


def _coordinator(join: Join) -> str | None:
    return join.kwargs.get("coordinator_address") or os.environ.get(COORDINATOR_VAR)


def before(join: Join, timeouts: Mapping[str, int]) -> None:
    """Before joining: the gloo address where this host's name is loopback; the watcher
    with what is known now (a peer that never joins is reported from here)."""
    if join.expected == 1:
        return
    table = run_hosts(os.environ)
    coordinator = _coordinator(join)
    if coordinator is not None and _uses_gloo():
        others = table[0] if table else []
        try:
            name, loopback, address = addresses.loopback_fix(coordinator, others)
        except LookupError:
            pass
        else:
            if address is None or not _compat.use_gloo_address(address):
                raise RuntimeError(
                    f"This host's name {name!r} resolves to {loopback}, a loopback address "
                    "(Debian and Ubuntu write `127.0.1.1 HOSTNAME` in /etc/hosts), and no "
                    f"interface of this host reaches the coordinator {coordinator} or another "
                    "host of the run (or this JAX does not let eqxshard give gloo an "
                    "address). gloo would tell the other processes to connect here "
                    "at that loopback address, and the run would fail at its first "
                    f"collective. Map {name!r} to this node's network address in /etc/hosts "
                    "(or in DNS), and check that the coordinator's host name resolves here."
                )
            print(
                f"eqxshard: this host's name {name!r} resolves to {loopback} (loopback); "
                f"gloo uses {address}, the address that reaches the other hosts.",
                file=sys.stderr,
                flush=True,
            )
    info: dict[str, Any] = {
        "process": _process_id(join),
        "num_processes": join.expected or 0,
        "host": socket.gethostname(),
        "heartbeat_timeout": timeouts.get("heartbeat_timeout_seconds", 100),
        "initialization_timeout": timeouts.get("initialization_timeout", 300),
    }
    if table is not None:
        hosts, per_host = table
        peers = {str(k): [hosts[k // per_host], None] for k in range(len(hosts) * per_host)}
        info["peers"] = peers
    if watch.start(info) and _tell_checkpoint not in ON_COMPLETE:
        ON_COMPLETE.append(_tell_checkpoint)


def _tell_checkpoint(directory: str, step: int) -> None:
    watch.tell(checkpoint=[os.path.abspath(directory), step])


def after() -> None:
    """After joining: this process's id, and every process's host and address, to the
    watcher (through JAX's key-value store, up to `_EXCHANGE_MAX` processes)."""
    if not watch.started():
        return
    me, count = jax.process_index(), jax.process_count()
    watch.tell(process=me, num_processes=count)
    client = _compat.coordination_client()
    if client is None or count > _EXCHANGE_MAX:
        return
    coordinator = os.environ.get(COORDINATOR_VAR, "")
    table = run_hosts(os.environ)
    address = addresses.reachable_address(coordinator, table[0] if table else ())
    name = socket.gethostname()
    address = address or addresses.resolve(name) or ""
    try:
        client.key_value_set_bytes(f"{_PEER_KEY}{me}", json.dumps([name, address]).encode())
        client.wait_at_barrier("eqxshard_peers", 60_000)
        entries = client.key_value_dir_get_bytes(_PEER_KEY)
    except Exception:  # a table is a nicety: the run goes on without it
        return
    peers = {}
    for key, value in entries:
        peers[key.rsplit("/", 1)[-1]] = json.loads(value)
        if len(peers) == 64:  # control lines stay under PIPE_BUF
            watch.tell(peers=peers)
            peers = {}
    if peers:
        watch.tell(peers=peers)
