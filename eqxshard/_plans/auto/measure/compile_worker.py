"""Run as `python -m eqxshard._plans.auto.measure.compile_worker IN OUT` by `compile_remote`:
compiles each StableHLO module of IN (JSON: a device count, the modules, and optionally
each module's own count, at most that, and whether to constant-fold it) on that many CPU
devices and writes each one's memory figures, flops and compiled HLO text to OUT
(JSON)."""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    with open(src) as f:
        work = json.load(f)
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(work["devices"]))
    from .... import _compat

    results = []
    counts = work.get("counts") or [work["devices"]] * len(work["modules"])
    folds = work.get("folds") or [False] * len(work["modules"])
    for text, count, fold in zip(work["modules"], counts, folds, strict=True):
        memory, flops, hlo = _compat.compile_stablehlo(text, int(count), fold=bool(fold))
        results.append({"memory": memory, "flops": flops, "hlo": hlo})
    with open(dst, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
