"""Draws docs/images/context_strategies.svg: which keys and values each device holds, step
by step, under each strategy of `eqxshard.context_attention` on a context axis of C
devices (rows, device 0 on top), and the causal ring's zig-zag layout.

- ring: device i starts with its own block of keys and values (block i) and passes it to
  device i+1 each step, so at step t it holds block (i - t) mod C;
- all_gather: one step, every device holds every block;
- all_to_all: the sequence split traded for a head split: device i holds heads i (of C
  groups) over the whole sequence;
- causal ring (zig-zag): the sequence cut into 2C chunks, device i holding chunks i and
  2C-1-i, so every device does the same work under the causal mask.

    python docs/images/context_strategies.py [OUTPUT.svg]
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from schedule_chart import cell, colours, figure, main, save


def _frame(ax: Axes, devices: int, width: float, ticks: list[str]) -> None:
    ax.set_xlim(0, width)
    ax.set_ylim(0, devices)
    ax.set_yticks(
        [devices - 1 - d + 0.5 for d in range(devices)], [f"device {d}" for d in range(devices)]
    )
    ax.set_xticks([k + 0.5 for k in range(len(ticks))], ticks, fontsize=7)
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)


def draw(out: Path, devices: int = 4) -> int:
    """Writes the picture; returns how many cells it drew."""
    c = devices
    fig, axes = figure(4, 0.9 * c + 2.4, text_as_text=True)
    drawn = 0
    ring, gather, ulysses, zigzag = axes
    for step in range(c):
        for d in range(c):
            block = (d - step) % c
            cell(ring, step, c - 1 - d, 1, colours(block), 0.8, f"KV{block}", fontsize=7)
            drawn += 1
    ring.set_title(f"ring: a block of keys and values passed on each step ({c} steps)", fontsize=9)
    _frame(ring, c, c, [f"step {s}" for s in range(c)])
    for d in range(c):
        for block in range(c):
            cell(gather, block / c, c - 1 - d, 1 / c, colours(block), 0.8, f"{block}", fontsize=7)
            drawn += 1
    gather.set_title("all_gather: every block gathered at once (1 step)", fontsize=9)
    _frame(gather, c, c, ["all keys"])
    for d in range(c):
        cell(ulysses, 0, c - 1 - d, 1, colours(d), 0.5, f"heads {d}, all T", fontsize=7)
        drawn += 1
    ulysses.set_title("all_to_all: heads split instead of the sequence (2 exchanges)", fontsize=9)
    _frame(ulysses, c, c, ["attend"])
    for d in range(c):
        for chunk in (d, 2 * c - 1 - d):
            x = chunk / 2
            cell(zigzag, x, c - 1 - d, 0.5, colours(d), 0.8, f"{chunk}", fontsize=7)
            drawn += 1
    zigzag.set_title(
        f"causal ring (zig-zag): {2 * c} chunks, device i holds chunks i and {2 * c - 1}-i",
        fontsize=9,
    )
    _frame(zigzag, c, c, ["" for _ in range(c)])
    save(fig, "ring: steps; all_gather: blocks gathered; zig-zag: the 2C chunks in order", out)
    return drawn


if __name__ == "__main__":
    main(draw, __file__)
