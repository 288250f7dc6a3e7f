"""Equinox's runtime errors (`eqx.error_if`, `eqx.branched_error_if`) as `eqx.filter_jit`
reports them: the one place that reads Equinox's private error state."""

from __future__ import annotations

from typing import Any


def equinox_runtime_error(e: BaseException, jit_id: bytes) -> BaseException | None:
    """The `eqx.EquinoxRuntimeError` that `eqx.filter_jit` raises for `e`, or `None` if
    `e` is not an error of `eqx.error_if` (or this Equinox keeps its state elsewhere)."""
    try:
        from equinox import _jit
    except ImportError:  # pragma: no cover
        return None
    info: Any = getattr(_jit, "last_error_info", None)
    template = getattr(_jit, "_on_error_msg", None)
    if info is None or template is None or "_EquinoxRuntimeError: " not in str(e):
        return None
    msg, stack = info
    pieces: list[str] = []
    for item in stack:
        if isinstance(item, str):
            pieces.append(item)
        elif item == jit_id:
            break
    return _jit.EquinoxRuntimeError(template.format(msg=msg, stack="".join(reversed(pieces))))
