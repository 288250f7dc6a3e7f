"""Runs of `python -m eqxshard.launch` on a simulated cluster, watched line by line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import without_jax_settings
from nodes import Cluster

import eqxshard

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_multihost.py"
STEADY = Path(__file__).resolve().parent / "steady.py"
# Only stops a run that hangs: each run takes seconds to a minute on a loaded machine.
HANG_S = 240


def child_env() -> dict[str, str]:
    """This environment without JAX/XLA settings, importing the eqxshard under test."""
    env = without_jax_settings(os.environ)
    root = str(Path(eqxshard.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


class Run:
    """`python -m eqxshard.launch --hosts ... --remote cluster.template ARGS`, started now.

    `lines` collects `(seconds since start, line)` of stdout and stderr as they come.
    """

    def __init__(
        self,
        cluster: Cluster,
        *args: str,
        hosts: list[str] | None = None,
        remote: str | None = None,
    ) -> None:
        hosts = cluster.hosts if hosts is None else hosts
        command = [
            sys.executable, "-m", "eqxshard.launch", "--hosts", ",".join(hosts),
            "--remote", remote or cluster.template, *args,
        ]  # fmt: skip
        self.start = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            command,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream) -> None:
        with stream:
            for line in stream:
                with self._lock:
                    self.lines.append((time.monotonic() - self.start, line.rstrip("\n")))

    @property
    def text(self) -> str:
        with self._lock:
            return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float = HANG_S) -> float:
        """Waits until a line matches `pattern`; returns when it came (seconds)."""
        deadline = time.monotonic() + timeout
        compiled = re.compile(pattern)
        while time.monotonic() < deadline:
            with self._lock:
                for when, line in self.lines:
                    if compiled.search(line):
                        return when
            if self.proc.poll() is not None:
                time.sleep(0.5)  # the last lines
                with self._lock:
                    for when, line in self.lines:
                        if compiled.search(line):
                            return when
                pytest.fail(f"the run ended before {pattern!r}:\n{self.text[-6000:]}")
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"no {pattern!r} within {timeout} s:\n{self.text[-6000:]}")

    def finish(self, timeout: float = HANG_S) -> int:
        """Waits for the launcher to end; its exit code."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the run did not end within {timeout} s:\n{self.text[-6000:]}")
        for reader in self._readers:
            reader.join(timeout=5)
        return self.proc.returncode

    def when(self, pattern: str) -> float | None:
        compiled = re.compile(pattern)
        with self._lock:
            return next((when for when, line in self.lines if compiled.search(line)), None)

    def kill(self) -> None:
        if self.proc.poll() is None:  # only the launcher this test started
            self.proc.kill()
            self.proc.wait()
        for reader in self._readers:
            reader.join(timeout=5)


def final_parameters(text: str) -> str:
    found = re.findall(r"^\[0\] final parameters (\w+)$", text, flags=re.M)
    assert len(found) == 1, text[-4000:]
    return found[0]


def losses(text: str, prefix: str = r"\[0\] ") -> dict[int, float]:
    """step -> loss, as process 0 (or a run without prefix) logged them."""
    found = re.findall(rf"^{prefix}step (\d+) loss (\S+)$", text, flags=re.M)
    return {int(s): float(v) for s, v in found}
