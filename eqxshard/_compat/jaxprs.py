"""Reading a `scan` equation of a jaxpr: how many of its inputs are constants and carries.

jax before 0.12 gives them as the `num_consts` and `num_carry` parameters; jax 0.12 gives
the inputs' and outputs' trees instead (`ft_in`: constants, carries, scanned inputs).
"""

from __future__ import annotations

from typing import Any


def scan_counts(eqn: Any) -> tuple[int, int] | None:
    """`(constants, carries)` of a `scan` equation's inputs (its outputs are the carries,
    then the stacked outputs), or `None` where this JAX names them otherwise."""
    params = eqn.params
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    tree = params.get("ft_in")
    parts = getattr(tree, "elts", None)
    if parts is None or len(parts) != 3:
        return None
    return len(parts[0]), len(parts[1])
