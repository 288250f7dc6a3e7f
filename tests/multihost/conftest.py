"""Fixtures of the multi-host tests."""

from pathlib import Path

import pytest
from harness import shared_dir


@pytest.fixture(scope="session")
def multihost_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that every pytest-xdist worker of this session shares."""
    return shared_dir(tmp_path_factory, "multihost")
