"""Draws docs/images/pipeline_1f1b.svg: which stage runs the forward (F) or the backward (B) of
which microbatch at each tick of `eqxshard.pipeline_value_and_grad`, in its GPipe and 1F1B
orders, and how many microbatches' residuals each stage holds at most.

The cells are the driver's own ticks (`eqxshard/_pipeline/ticks.py`): each stage runs its
own list (1F1B: `S-s-1` forwards, then a forward and a backward in turn, then the
backwards left), each item as soon as its input came in an earlier tick.

    python docs/images/pipeline_1f1b.py [OUTPUT.svg]
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from eqxshard._pipeline.ticks import held, ticks  # noqa: E402


def draw(out: Path, stages: int = 4, microbatches: int = 8) -> int:
    """Writes the picture; returns how many busy cells it drew."""
    plt.rcParams["svg.hashsalt"] = "eqxshard"
    plt.rcParams["svg.fonttype"] = "none"  # text as text: a small file
    colours = plt.get_cmap("tab10")
    panels = [("gpipe", "GPipe order"), ("1f1b", "1F1B")]
    width = max(len(ticks(schedule, stages, microbatches)) for schedule, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(0.42 * width + 1.8, 1.9 * len(panels) + 0.4))
    busy = 0
    for ax, (schedule, title) in zip(axes, panels, strict=True):
        order = ticks(schedule, stages, microbatches)
        for t, tick in enumerate(order):
            for s, kind, m in tick:
                busy += 1
                y = stages - 1 - s
                ax.add_patch(
                    Rectangle(
                        (t, y),
                        1,
                        1,
                        facecolor=colours(m % 10),
                        alpha=1.0 if kind == "F" else 0.45,
                        edgecolor="white",
                    )
                )
                ax.text(
                    t + 0.5,
                    y + 0.5,
                    f"{kind}{m}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    fontweight="bold" if kind == "F" else "normal",
                )
        peaks = held(schedule, stages, microbatches)
        ax.set_title(
            f"{title}: S={stages} stages, M={microbatches} microbatches, {len(order)} ticks; "
            f"residuals held at most {peaks} microbatches per stage",
            fontsize=9,
        )
        ax.set_xlim(0, width)
        ax.set_ylim(0, stages)
        ax.set_yticks(
            [stages - 1 - s + 0.5 for s in range(stages)], [f"stage {s}" for s in range(stages)]
        )
        ax.set_xticks(range(width + 1), [str(t) for t in range(width + 1)], fontsize=7)
        ax.tick_params(length=0)
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel(
        "tick (a forward or a backward of n/S layers on one microbatch; F forward, B backward)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return busy


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_suffix(".svg")
    print(f"{draw(target)} busy cells -> {target}")
