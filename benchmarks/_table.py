"""The plain-text tables the benchmarks print: a header, a rule, then the rows."""

from __future__ import annotations


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
