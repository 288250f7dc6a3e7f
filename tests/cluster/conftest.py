"""Fixtures of the simulated-cluster tests (see `nodes.py`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nodes import Cluster, sweep, unavailable

# `.ci/run` sets it (it runs as root): there, a test that cannot make nodes fails.
REQUIRE_VAR = "EQXSHARD_TEST_REQUIRE_NODES"


@pytest.fixture(scope="session", autouse=True)
def _sweep_leftovers() -> Iterator[None]:
    """Removes clusters of earlier sessions that were killed before cleaning up."""
    if unavailable() is None:
        sweep()
    yield


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """`make_cluster(n, **options)`: a `Cluster` of `n` nodes, removed after the test
    (also when it fails); skips (fails under `.ci/run`) where nodes cannot be made."""
    why = unavailable()
    if why is not None:
        if os.environ.get(REQUIRE_VAR) == "1":
            pytest.fail(f"{why}; {REQUIRE_VAR}=1 says these tests must run here")
        pytest.skip(why)
    made: list[Cluster] = []

    def make(num_nodes: int, **options: object) -> Cluster:
        cluster = Cluster(num_nodes, tmp_path / f"cluster{len(made)}", **options)  # type: ignore[arg-type]
        made.append(cluster)
        return cluster.__enter__()

    try:
        yield make
    finally:
        for cluster in made:
            cluster.__exit__(None, None, None)
