"""The plain-text tables the benchmarks print: a header, a rule, then the rows."""

from __future__ import annotations

import contextlib
import datetime
import io
import sys
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path


def print_table(rows: list[tuple[str, ...]], right: set[int]) -> None:
    """Prints `rows` (the first is the header) in aligned columns; the columns in `right`
    (numbers) are right-aligned, the others left-aligned."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for k, r in enumerate(rows):
        cells = [
            cell.rjust(w) if c in right else cell.ljust(w)
            for c, (cell, w) in enumerate(zip(r, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))


@contextlib.contextmanager
def recorded(out: Path) -> Iterator[None]:
    """What the block prints, headed by the benchmark's command line and today's date,
    printed and written to the results file `out` as well."""
    text = io.StringIO()
    with redirect_stdout(text):
        command = " ".join([f"python benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
        print(f"# {command}, {datetime.date.today().isoformat()}")
        yield
    print(text.getvalue(), end="")
    out.write_text(text.getvalue())
    print(f"-> {out}")
