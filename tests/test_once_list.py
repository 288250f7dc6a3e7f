"""tests/once.txt (the tests CI runs once, not again on the lowest and the newest JAX) names
tests that exist, and `.ci/once.py` lists the slow ones that are not parity tests."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _once_script():
    spec = importlib.util.spec_from_file_location("once", ROOT / ".ci" / "once.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_listed_test_exists():
    listed = [
        line
        for line in (ROOT / "tests" / "once.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert listed == sorted(set(listed))
    for nodeid in listed:
        path, name = nodeid.split("::")[:2]
        function = re.sub(r"\[.*", "", name)
        assert re.search(rf"^\s*(async )?def {function}\(", (ROOT / path).read_text(), re.M), nodeid


def test_slow_tests_are_listed_unless_parity(tmp_path: Path):
    once = _once_script()
    report = tmp_path / "run.jsonl"
    entries = [
        ("tests/test_a.py::test_slow[x]", "setup", 2.0),
        ("tests/test_a.py::test_slow[x]", "call", 1.5),  # 3.5 s in all
        ("tests/test_a.py::test_quick", "call", 0.5),
        ("tests/test_parity_map.py::test_slow", "call", 9.0),  # parity: every JAX
    ]
    lines = [
        {"$report_type": "TestReport", "nodeid": n, "when": w, "duration": d} for n, w, d in entries
    ]
    report.write_text("\n".join(json.dumps(x) for x in [{"$report_type": "SessionStart"}, *lines]))
    log = tmp_path / "ci.log"  # another run's `--durations` lines: its slowest is listed too
    log.write_text(
        "== slowest ==\n"
        "4.10s call     tests/test_b.py::test_other\n"
        "0.20s setup    tests/test_a.py::test_quick\n"
    )
    assert once.slow([str(report), str(log)]) == [
        "tests/test_a.py::test_slow[x]",
        "tests/test_b.py::test_other",
    ]
