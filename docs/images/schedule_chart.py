"""The drawing shared by docs/images/pipeline_schedule.py and docs/images/pipeline_1f1b.py:
panels of stages (rows, stage 0 on top) over time (columns), one coloured cell per piece
of work, written as an SVG that gives the same bytes each time.

Not a script: the two pictures' scripts import it (run as `python docs/images/NAME.py`,
their folder is on the import path).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

colours = plt.get_cmap("tab10")


def figure(panels: int, width: float, *, text_as_text: bool = False) -> tuple[Figure, list[Axes]]:
    """A figure `width` inches wide with `panels` panels one above the other. SVG ids come
    from a fixed salt; `text_as_text` writes text as text (a small file) instead of paths."""
    plt.rcParams["svg.hashsalt"] = "eqxshard"
    plt.rcParams["svg.fonttype"] = "none" if text_as_text else "path"
    fig, axes = plt.subplots(panels, 1, figsize=(width, 1.9 * panels + 0.4))
    return fig, list(axes)


def cell(ax: Axes, x: float, y: float, w: float, colour, alpha: float, label: str, **text) -> None:
    """One busy cell `w` wide at `(x, y)`, filled with `colour`, `label` in its middle."""
    ax.add_patch(Rectangle((x, y), w, 1, facecolor=colour, alpha=alpha, edgecolor="white"))
    ax.text(x + w / 2, y + 0.5, label, ha="center", va="center", **text)


def frame(ax: Axes, stages: int, width: float) -> None:
    """The panel's limits, a label per stage and per whole tick, and no box around it."""
    ax.set_xlim(0, width)
    ax.set_ylim(0, stages)
    ax.set_yticks(
        [stages - 1 - s + 0.5 for s in range(stages)], [f"stage {s}" for s in range(stages)]
    )
    ax.set_xticks(range(int(width) + 1), [str(t) for t in range(int(width) + 1)], fontsize=7)
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)


def save(fig: Figure, xlabel: str, out: Path) -> None:
    """Labels the time axis under the last panel, writes `out` with no date in it and
    closes the figure."""
    fig.axes[-1].set_xlabel(xlabel, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)


def main(draw: Callable[[Path], int], script: str) -> None:
    """A picture script's command line, `python SCRIPT [OUTPUT.svg]` (by default the
    `.svg` next to the script): draws it and says how many busy cells it has."""
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(script).with_suffix(".svg")
    print(f"{draw(target)} busy cells -> {target}")
