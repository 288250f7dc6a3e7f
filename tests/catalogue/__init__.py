r"""The bad-input catalogue: one `Case` per bad input, gathered by `tests/test_bad_inputs.py`.

Each module in this package holds a list `CASES` for one family of verbs. Adding a case is
one line: `Case("id", lambda: eqxshard.verb(...), ValueError, r"`argument`|\.leaf\.path")`.
`match` must name the argument in backticks or the failing leaf by its path, so a case
checks both the exception type and that the message says where.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Case:
    """One bad input: calling `call()` raises `exc` with a message matching `match`."""

    id: str
    call: Callable[[], object]
    exc: type[BaseException]
    match: str
    marks: tuple[Any, ...] = ()  # pytest marks for this case only
