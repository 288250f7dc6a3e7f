"""`_exchange`, the bounded exchange behind every cross-process check (one process here;
two processes in `tests/multihost/test_mismatch_multihost.py`)."""

import numpy as np
import pytest

from eqxshard._placement import exchange as _exchange


def test_timeout_reads_the_variable(monkeypatch):
    monkeypatch.delenv(_exchange.TIMEOUT_VAR, raising=False)
    assert _exchange.timeout() == _exchange.DEFAULT_TIMEOUT == 600
    monkeypatch.setenv(_exchange.TIMEOUT_VAR, "2.5")
    assert _exchange.timeout() == 2.5
    monkeypatch.setenv(_exchange.TIMEOUT_VAR, "")
    assert _exchange.timeout() == 600


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "nan"])
def test_a_bad_timeout_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(_exchange.TIMEOUT_VAR, raw)
    with pytest.raises(ValueError, match=rf"EQXSHARD_SYNC_TIMEOUT='{raw}' must be a number"):
        _exchange.timeout()


def test_one_process_gathers_its_own_payload():
    assert _exchange.allgather("filter_shard", b"abc") == [b"abc"]
    values = np.array([1, 2**63 + 5], dtype=np.uint64)  # no 64-to-32-bit truncation
    gathered = _exchange.allgather_array("filter_shard", values)
    assert gathered.shape == (1, 2) and gathered.dtype == np.uint64
    np.testing.assert_array_equal(gathered[0], values)
