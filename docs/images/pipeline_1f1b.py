"""Draws docs/images/pipeline_1f1b.svg: which stage runs the forward (F) or the backward (B) of
which microbatch at each tick of `eqxshard.pipeline_value_and_grad`, in its GPipe and 1F1B
orders, and how many microbatches' residuals each stage holds at most.

The cells are the driver's own ticks (`eqxshard/_pipeline/mpmd/ticks.py`): each stage
runs its own order (1F1B: `S-s-1` forwards, then a forward and a backward in turn, then the
backwards left), each item as soon as its input came in an earlier tick.

    python docs/images/pipeline_1f1b.py [OUTPUT.svg]
"""

from __future__ import annotations

from pathlib import Path

from schedule_chart import cell, colours, figure, frame, main, save

from eqxshard._pipeline.mpmd.ticks import held, ticks


def draw(out: Path, stages: int = 4, microbatches: int = 8) -> int:
    """Writes the picture; returns how many busy cells it drew."""
    panels = [("gpipe", "GPipe order"), ("1f1b", "1F1B")]
    width = max(len(ticks(schedule, stages, microbatches)) for schedule, _ in panels)
    fig, axes = figure(len(panels), 0.42 * width + 1.8, text_as_text=True)  # a small file
    busy = 0
    for ax, (schedule, title) in zip(axes, panels, strict=True):
        order = ticks(schedule, stages, microbatches)
        for t, tick in enumerate(order):
            for s, kind, m in tick:
                busy += 1
                forward = kind == "F"
                cell(
                    ax,
                    t,
                    stages - 1 - s,
                    1,
                    colours(m % 10),
                    1.0 if forward else 0.45,
                    f"{kind}{m}",
                    fontsize=7,
                    fontweight="bold" if forward else "normal",
                )
        peaks = held(schedule, stages, microbatches)
        ax.set_title(
            f"{title}: S={stages} stages, M={microbatches} microbatches, {len(order)} ticks; "
            f"residuals held at most {peaks} microbatches per stage",
            fontsize=9,
        )
        frame(ax, stages, width)
    save(
        fig,
        "tick (a forward or a backward of n/S layers on one microbatch; F forward, B backward)",
        out,
    )
    return busy


if __name__ == "__main__":
    main(draw, __file__)
