"""Draws docs/images/moe_dispatch.svg: where `eqxshard.moe` sends each token, on an expert
axis of A = 4 devices holding E = 8 experts (2 each), 2 tokens per device, top-2 routing.
Each cell is one (token, choice) assignment, coloured by the device its token lives on.

- top: each device's assignments, in order of tokens then choices, and the device of
  their expert (`dest = expert // (E/A)`); hatched: the ones capacity 1.0 drops;
- middle, dropless: the rows each device receives from the first `all_to_all`: from each
  source a buffer of `n_local * k` = 4 rows (the most one source could send it), filled in
  order, the rest padding; each local expert runs on all 16 rows;
- bottom, capacity 1.0: `C = ceil(1.0 * n_local * k / E)` = 1 row per expert and source,
  so from each source one block of C rows per local expert; an expert's second assignment
  from the same source is dropped.

    python docs/images/moe_dispatch.py [OUTPUT.svg]
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.patches import Rectangle
from schedule_chart import cell, colours, figure, main, save

A, E, LOCAL, K = 4, 8, 2, 2
PER = E // A
# Each token's two experts (token t lives on device t // LOCAL).
CHOICES = [(0, 5), (0, 3), (2, 7), (6, 3), (1, 4), (4, 6), (7, 2), (5, 0)]


def assignments(device: int) -> list[tuple[int, int]]:
    """The device's (token, expert) assignments, in order of tokens then choices."""
    tokens = range(device * LOCAL, (device + 1) * LOCAL)
    return [(t, e) for t in tokens for e in CHOICES[t]]


def kept(device: int, capacity: int) -> set[tuple[int, int]]:
    """The assignments a capacity of `capacity` rows per expert keeps."""
    seen: dict[int, int] = {}
    out = set()
    for t, e in assignments(device):
        seen[e] = seen.get(e, 0) + 1
        if seen[e] <= capacity:
            out.add((t, e))
    return out


def _frame(ax: Axes, width: float, ticks: list[tuple[float, str]]) -> None:
    ax.set_xlim(0, width)
    ax.set_ylim(0, A)
    ax.set_yticks([A - 1 - d + 0.5 for d in range(A)], [f"device {d}" for d in range(A)])
    ax.set_xticks([x for x, _ in ticks], [label for _, label in ticks], fontsize=7)
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)


def _empty(ax: Axes, x: float, y: float, w: float) -> None:
    ax.add_patch(Rectangle((x, y), w, 1, facecolor="#eeeeee", edgecolor="white"))


def _slots(ax: Axes, x: int, y: int, taken: list, n: int, colour: tuple) -> int:
    """`n` slots from `x` on row `y`: the (token, expert) pairs of `taken` in the first,
    the rest empty (padding); how many were drawn."""
    for slot in range(n):
        if slot < len(taken):
            t, e = taken[slot]
            cell(ax, x + slot, y, 1, colour, 0.8, f"t{t} e{e}", fontsize=6)
        else:
            _empty(ax, x + slot, y, 1)
    return min(len(taken), n)


def draw(out: Path) -> int:
    """Writes the picture; returns how many assignment cells it drew."""
    capacity = math.ceil(1.0 * LOCAL * K / E)
    fig, (sent, dropless, capped) = figure(3, 8.5, text_as_text=True)
    drawn = 0
    for d in range(A):
        keep = kept(d, capacity)
        for slot, (t, e) in enumerate(assignments(d)):
            label = f"t{t}: e{e} -> dev {e // PER}"
            cell(sent, slot, A - 1 - d, 1, colours(d), 0.8, label, fontsize=7)
            if (t, e) not in keep:
                sent.add_patch(
                    Rectangle((slot, A - 1 - d), 1, 1, fill=False, hatch="///", edgecolor="black")
                )
            drawn += 1
    sent.set_title(
        "each device's assignments (token t: expert e -> its device); hatched: dropped at "
        "capacity 1.0",
        fontsize=9,
    )
    _frame(sent, LOCAL * K, [(s + 0.5, f"choice {s}") for s in range(LOCAL * K)])
    rows = LOCAL * K  # per source, dropless
    for d in range(A):
        for source in range(A):
            mine = [(t, e) for t, e in assignments(source) if e // PER == d]
            drawn += _slots(dropless, source * rows, A - 1 - d, mine, rows, colours(source))
    dropless.set_title(
        f"dropless: received, {rows} rows from each source (grey: padding); "
        f"each of the {PER} local experts runs on all {A * rows}",
        fontsize=9,
    )
    _frame(dropless, A * rows, [(s * rows + rows / 2, f"from device {s}") for s in range(A)])
    block = PER * capacity
    for d in range(A):
        for source in range(A):
            keep = kept(source, capacity)
            for local in range(PER):
                e = d * PER + local
                mine = [(t, x) for t, x in assignments(source) if x == e and (t, x) in keep]
                x = source * block + local * capacity
                drawn += _slots(capped, x, A - 1 - d, mine, capacity, colours(source))
    capped.set_title(
        f"capacity 1.0: C = {capacity} row per expert from each source; each expert runs on "
        f"its own {A * capacity}",
        fontsize=9,
    )
    _frame(capped, A * block, [(s * block + block / 2, f"from device {s}") for s in range(A)])
    save(fig, "received rows, by source device and slot (then sent back the same way)", out)
    return drawn


if __name__ == "__main__":
    main(draw, __file__)
