"""The worker side of the multi-host tests: join the run, run scenarios, report them.

A worker script is started (by `harness.run_workers`) as

    python WORKER PORT PROCESS_ID NUM_PROCESSES [ARGS...]

`join` makes it one of `NUM_PROCESSES` processes x `LOCAL_DEVICES` CPU devices
(`jax.distributed.initialize` on 127.0.0.1, gloo collectives); `run_scenarios` runs
scenarios in order and prints one JSON line per scenario:
`{"scenario": name, "process": id, "ok": bool, "error": traceback or null, "seconds": s}`.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

NUM_PROCESSES = 2
LOCAL_DEVICES = 4


def check(condition: Any, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def raises(
    fn: Callable[[], Any],
    words: list[str],
    absent: Sequence[str] = (),
    kind: type[Exception] = ValueError,
) -> str:
    """`fn()` raises `kind` on this process, its message holding every one of `words` and
    none of `absent`; returns the message."""
    try:
        fn()
    except kind as e:
        message = str(e)
    else:
        raise AssertionError(f"no {kind.__name__}; expected one mentioning {words}")
    for word in words:
        check(word in message, f"{word!r} missing from the error:\n{message}")
    for word in absent:
        check(word not in message, f"{word!r} should not be in the error:\n{message}")
    return message


def join(argv: Sequence[str]) -> tuple[int, list[str]]:
    """Joins the run that `argv` (`sys.argv`) names; returns this process's id and the
    arguments after `NUM_PROCESSES`."""
    port, process, count, *rest = argv[1:]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=int(count),
        process_id=int(process),
    )
    if jax.device_count() != int(count) * LOCAL_DEVICES:
        raise RuntimeError(f"expected {LOCAL_DEVICES} devices per process, got {jax.devices()}")
    return int(process), rest


def run_scenarios(scenarios: Mapping[str, Callable[..., None]], process: int, *args: Any) -> None:
    """Runs `fn(process, *args)` for every scenario in order, reports each, and leaves
    the run."""
    for name, fn in scenarios.items():
        start = time.perf_counter()
        try:
            fn(process, *args)
            report: dict[str, Any] = {"ok": True, "error": None}
        except Exception:
            report = {"ok": False, "error": traceback.format_exc()}
        report["seconds"] = round(time.perf_counter() - start, 2)
        print(json.dumps({"scenario": name, "process": process, **report}), flush=True)
    jax.distributed.shutdown()
