"""Writes tests/once.txt: the tests that run once, in CI's tests part (the README's test
command, the newest JAX on Python 3.11), and not again on the lowest and the newest JAX.

    python .ci/once.py REPORT.jsonl [REPORT.jsonl ...]

Each REPORT is a `pytest --report-log` of the non-heavy tests (`-m "not heavy"`), e.g. of
CI's lowest and newest-py parts, or a log of such a run whose `--durations` lines
(`12.34s call tests/...`) it reads. A test goes on the list when it took `SECONDS` or more in
any of them (set-up, call and tear-down together), unless it checks eqxshard against JAX
and Equinox themselves (`KEEP`): those run on every JAX, whatever they cost. What is listed
still runs in the tests part; the per-JAX parts (`-m "not heavy and not once"`) leave it out.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

SECONDS = 3.0
# Parity with the real thing (the promise), and the multi-process basics, on every JAX: the
# parity files; context attention and MoE against their plain-JAX references and Equinox's
# attention; a published model converted; layers nested in a pipeline (a JAX bug's
# workaround, version-sensitive).
KEEP = re.compile(
    r"^tests/(test_parity_[^/]*|multihost/test_multihost|test_nested_shard_map"
    r"|test_context_parallel_esm2quinox)\.py::"
    r"|^tests/test_context_attention\.py::test_matches_attention"
    r"|^tests/test_moe\.py::test_values_and_gradients_equal_the_dense_sum"
    r"|^tests/test_context_parallel\.py::test_one_layer_matches_the_original"
)
DURATION = re.compile(r"^([0-9.]+)s (?:setup|call|teardown) +(tests/\S+)$")
OUT = Path(__file__).resolve().parent.parent / "tests" / "once.txt"
HEADER = """\
# The tests that run once: in CI's tests part, not again on the lowest and the newest JAX
# (conftest.py marks them `once`; those parts run -m "not heavy and not once"). Each took
# 3 s or more there, and is not a parity test. Written by `python .ci/once.py REPORT...`
# from `pytest --report-log` runs of those parts; regenerate it when tests change.
"""


def slow(reports: list[str]) -> list[str]:
    spent: dict[str, float] = collections.defaultdict(float)
    for report in reports:
        per_run: dict[str, float] = collections.defaultdict(float)
        for line in Path(report).read_text().splitlines():
            if report.endswith(".jsonl"):
                entry = json.loads(line)
                if entry.get("$report_type") == "TestReport":
                    per_run[entry["nodeid"]] += entry["duration"]
            elif found := DURATION.match(line):
                per_run[found.group(2)] += float(found.group(1))
        for nodeid, seconds in per_run.items():
            spent[nodeid] = max(spent[nodeid], seconds)
    return sorted(k for k, v in spent.items() if v >= SECONDS and not KEEP.match(k))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    listed = slow(sys.argv[1:])
    OUT.write_text(HEADER + "".join(f"{nodeid}\n" for nodeid in listed))
    print(f"{len(listed)} tests in {OUT}")
