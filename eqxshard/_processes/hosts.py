"""The processes of a run on several hosts: which host each runs on, and the command that
starts it there.

Process `k` of a run on hosts `h0, h1, ...` with `K` processes per host runs on host
`h[k // K]`; process 0, which hosts JAX's coordination service, runs on the first host,
and every process reaches it at `FIRST_HOST:PORT`. Each process is started as the argv of
the remote template with `{host}` filled in (default `ssh -o BatchMode=yes {host}`),
followed by `env` with the run's variables and the command, each word quoted for the
remote shell (ssh joins its words with spaces and hands them to the remote shell, which
splits them again).
"""

from __future__ import annotations

import dataclasses
import os
import random
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

DEFAULT_REMOTE = "ssh -o BatchMode=yes {host}"
# ssh's own exit code for "could not connect / authenticate": the host was not started.
SSH_FAILED = 255
# As JAX does for Slurm: the coordinator's port, where none is given, in the top 4096.
PORT_BASE, PORT_RANGE = 65536 - 4096, 4096


@dataclasses.dataclass(frozen=True)
class Placement:
    """Process `process_id` of the run runs on `host` (None: this machine, no template)."""

    process_id: int
    host: str | None


def read_hostfile(path: str | os.PathLike[str]) -> list[str]:
    """The hosts of a host file: one name per line; blank lines and `#` comments skipped.

    Raises `ValueError` naming the file and line of anything else on a line.
    """
    hosts, problems = [], []
    text = Path(path).read_text()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 1:
            problems.append(f"  line {number}: {line.strip()!r}")
            continue
        hosts.append(words[0])
    if problems:
        raise ValueError(
            f"The host file {str(path)!r} has more than a host name on these lines:\n"
            + "\n".join(problems)
            + "\nWrite one host name per line (use --processes-per-host for several "
            "processes on each)."
        )
    if not hosts:
        raise ValueError(f"The host file {str(path)!r} names no host: write one per line.")
    return hosts


def check_hosts(hosts: Sequence[str]) -> None:
    """Raises `ValueError` on an empty list, an empty name, or a name given twice."""
    if not hosts:
        raise ValueError("`hosts` is empty: name at least one host, e.g. `--hosts node1,node2`.")
    bad = [h for h in hosts if not h or any(c.isspace() for c in h) or h.startswith("-")]
    if bad:
        raise ValueError(
            f"`hosts` has names that are not host names: {bad!r}. Give names or addresses, "
            "separated by commas and no spaces, e.g. `--hosts node1,node2`."
        )
    twice = sorted({h for h in hosts if list(hosts).count(h) > 1})
    if twice:
        raise ValueError(
            f"`hosts` names {', '.join(twice)} more than once. Name each host once and set "
            "--processes-per-host for several processes on each."
        )


def check_template(template: str) -> list[str]:
    """The words of `template`; raises `ValueError` unless one of them holds `{host}`."""
    try:
        words = shlex.split(template)
    except ValueError as e:
        raise ValueError(f"`remote` {template!r} cannot be split into words: {e}.") from None
    if not any("{host}" in w for w in words):
        raise ValueError(
            f"`remote` {template!r} has no `{{host}}`: it is the command that runs a command "
            f"on a host, with `{{host}}` where the host goes, e.g. {DEFAULT_REMOTE!r}."
        )
    return words


def placements(hosts: Sequence[str] | None, num_processes: int) -> list[Placement]:
    """Where each process runs: `hosts[k // K]` with `K = num_processes // len(hosts)`."""
    if hosts is None:
        return [Placement(k, None) for k in range(num_processes)]
    per_host = num_processes // len(hosts)
    return [Placement(k, hosts[k // per_host]) for k in range(num_processes)]


def default_port() -> int:
    """A port for a coordinator on another host: random in the top 4096 (this machine
    cannot see which ports are free there)."""
    return PORT_BASE + random.randrange(PORT_RANGE)


def script_command(command: Sequence[str]) -> list[str]:
    """`script.py args` as this Python and the script's absolute path; `-m module args`
    as this Python; anything else as given."""
    command = list(command)
    if command and command[0].endswith(".py"):
        return [sys.executable, str(Path(command[0]).resolve()), *command[1:]]
    if command and command[0] == "-m":
        return [sys.executable, *command]
    return command


def remote_argv(
    template_words: Sequence[str], host: str, variables: Mapping[str, str], argv: Sequence[str]
) -> list[str]:
    """The argv starting one process on `host`: the template's words with `{host}` filled
    in, then `env NAME=VALUE ... ARGV...`, each word quoted for the remote shell."""
    prefix = [w.replace("{host}", host) for w in template_words]
    words = ["env", *(f"{k}={v}" for k, v in variables.items()), *argv]
    return [*prefix, *(shlex.quote(w) for w in words)]
