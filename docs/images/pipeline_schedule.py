"""Draws docs/images/pipeline_schedule.svg: which stage runs which microbatch at each tick of
a pipeline's loop, for the GPipe and the circular schedule.

The cells come from the rule the loop follows (eqxshard/_pipeline/schedule.py): at tick `t`
stage `s` works on item `k = t - s`, that is microbatch `k % M` on its pass `k // M`
through the stages, and idles (the bubble) where `k` is outside `0 .. M*R - 1`.

    python docs/images/pipeline_schedule.py [OUTPUT.svg]
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402


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
    plt.rcParams["svg.hashsalt"] = "eqxshard"
    colours = plt.get_cmap("tab10")
    panels = [(1, "GPipe (repeats=1)"), (2, "circular (repeats=2)")]
    # x is time: a tick of a stage running n/(S*R) layers lasts 1/R of a GPipe tick.
    width = max((microbatches * r + stages - 1) / r for r, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(0.8 * width + 1.6, 1.9 * len(panels) + 0.4))
    busy = 0
    for ax, (repeats, title) in zip(axes, panels, strict=True):
        cells = schedule(stages, microbatches, repeats)
        ticks = len(cells[0])
        for s, row in enumerate(cells):
            for t, cell in enumerate(row):
                y, x, w = stages - 1 - s, t / repeats, 1 / repeats
                if cell is None:
                    ax.add_patch(
                        Rectangle((x, y), w, 1, facecolor="white", edgecolor="0.75", hatch="///")
                    )
                    continue
                m, r = cell
                busy += 1
                ax.add_patch(
                    Rectangle(
                        (x, y), w, 1, facecolor=colours(m), alpha=1.0 - 0.45 * r, edgecolor="white"
                    )
                )
                ax.text(
                    x + w / 2,
                    y + 0.5,
                    f"{m}" if repeats == 1 else f"{m}.{r}",
                    ha="center",
                    va="center",
                    fontsize=8,
                )
        idle = stages * ticks - stages * microbatches * repeats
        bubble = (stages - 1) / (microbatches * repeats + stages - 1)
        ax.set_title(
            f"{title}: S={stages} stages, M={microbatches} microbatches, {ticks} ticks of "
            f"n/{stages * repeats} layers, {idle} idle, bubble {bubble:.0%}",
            fontsize=9,
        )
        ax.set_xlim(0, width)
        ax.set_ylim(0, stages)
        ax.set_yticks(
            [stages - 1 - s + 0.5 for s in range(stages)], [f"stage {s}" for s in range(stages)]
        )
        ax.set_xticks(range(int(width) + 1), [str(t) for t in range(int(width) + 1)], fontsize=7)
        ax.tick_params(length=0)
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel(
        "time, in GPipe ticks (n/S layers each); the backward pass runs the loop in reverse",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return busy


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_suffix(".svg")
    print(f"{draw(target)} busy cells -> {target}")
