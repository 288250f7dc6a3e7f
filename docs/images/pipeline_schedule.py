"""Draws docs/images/pipeline_schedule.svg: which stage runs which microbatch at each tick of
a pipeline's loop, for the GPipe and the circular schedule.

The cells come from the rule the loop follows (eqxshard/_pipeline/spmd/schedule.py): at tick `t`
stage `s` works on item `k = t - s`, that is microbatch `k % M` on its pass `k // M`
through the stages, and idles (the bubble) where `k` is outside `0 .. M*R - 1`.

    python docs/images/pipeline_schedule.py [OUTPUT.svg]
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.patches import Rectangle
from schedule_chart import cell, colours, figure, frame, main, save


def schedule(stages: int, microbatches: int, repeats: int) -> list[list[tuple[int, int] | None]]:
    """`cells[s][t]`: `(microbatch, pass)` stage `s` runs at tick `t`, or `None` (idle)."""
    ticks = microbatches * repeats + stages - 1
    cells = []
    for s in range(stages):
        row = []
        for t in range(ticks):
            k = t - s
            row.append(
                (k % microbatches, k // microbatches) if 0 <= k < microbatches * repeats else None
            )
        cells.append(row)
    return cells


def draw(out: Path, stages: int = 4, microbatches: int = 4) -> int:
    """Writes the picture; returns how many busy cells it drew (for the test)."""
    panels = [(1, "GPipe (repeats=1)"), (2, "circular (repeats=2)")]
    # x is time: a tick of a stage running n/(S*R) layers lasts 1/R of a GPipe tick.
    width = max((microbatches * r + stages - 1) / r for r, _ in panels)
    fig, axes = figure(len(panels), 0.8 * width + 1.6)
    busy = 0
    for ax, (repeats, title) in zip(axes, panels, strict=True):
        cells = schedule(stages, microbatches, repeats)
        ticks = len(cells[0])
        for s, row in enumerate(cells):
            for t, item in enumerate(row):
                y, x, w = stages - 1 - s, t / repeats, 1 / repeats
                if item is None:
                    ax.add_patch(
                        Rectangle((x, y), w, 1, facecolor="white", edgecolor="0.75", hatch="///")
                    )
                    continue
                m, r = item
                busy += 1
                label = f"{m}" if repeats == 1 else f"{m}.{r}"
                cell(ax, x, y, w, colours(m), 1.0 - 0.45 * r, label, fontsize=8)
        idle = stages * ticks - stages * microbatches * repeats
        bubble = (stages - 1) / (microbatches * repeats + stages - 1)
        ax.set_title(
            f"{title}: S={stages} stages, M={microbatches} microbatches, {ticks} ticks of "
            f"n/{stages * repeats} layers, {idle} idle, bubble {bubble:.0%}",
            fontsize=9,
        )
        frame(ax, stages, width)
    save(
        fig,
        "time, in GPipe ticks (n/S layers each); the backward pass runs the loop in reverse",
        out,
    )
    return busy


if __name__ == "__main__":
    main(draw, __file__)
