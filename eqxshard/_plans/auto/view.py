"""How a `Plan` shows itself: a text table for `print`, and for a notebook an HTML table
under an SVG chart of each candidate's bytes per device against the budget (drawn here,
no plotting library needed). Each function reads the plan's table (its `Candidate` rows),
its budget and its summary line, as `Plan` passes them."""

from __future__ import annotations

import html
from collections.abc import Sequence

from ..._tree import format_bytes
from .candidate import Candidate

PARTS = ("parameters", "gradients", "optimizer state", "batch", "activations")
_COLOURS = ("#4878d0", "#6acc64", "#ee854a", "#956cb4", "#d65f5f")
_SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}


def mesh_str(shape: dict[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in shape.items())


def seconds_str(t: float | None) -> str:
    """`t` seconds in the unit that shows it with three significant figures or more: a
    tiny model's step is nanoseconds, never "0.0 us"."""
    if t is None:
        return "-"
    if t == 0:
        return "0 s"
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    if t >= 1e-6:
        return f"{t * 1e6:.2f} us"
    return f"{t * 1e9:.3g} ns"


def _bytes(c: Candidate, part: str) -> str:
    if part not in c.bytes:
        return "-"
    return ("~" if c.estimated and part == "activations" else "") + format_bytes(c.bytes[part])


def collectives_str(c: Candidate) -> str:
    moved = [(k, v) for k, v in c.collectives.items() if v]
    if not moved:
        return "none" if c.total_bytes is not None else "-"
    mark = "~" if c.estimated else ""
    return ", ".join(f"{_SHORT[k]} {mark}{format_bytes(v)}" for k, v in moved)


def rows(table: Sequence[Candidate]) -> tuple[list[str], list[list[str]]]:
    """The table's header and each row's cells, as text."""
    parts = [p for p in PARTS if any(p in c.bytes for c in table)]
    header = ["#", "layout", "mesh", *parts, "total", "sent per device", "time", "verdict"]
    body = []
    for c in table:
        total = "-" if c.total_bytes is None else format_bytes(c.total_bytes)
        body.append(
            [
                str(c.rank),
                c.name,
                mesh_str(c.mesh_shape),
                *[_bytes(c, p) for p in parts],
                ("~" if c.estimated and c.total_bytes is not None else "") + total,
                collectives_str(c),
                seconds_str(c.time),
                c.reason,
            ]
        )
    return header, body


def text(table: Sequence[Candidate], summary: str) -> str:
    """`summary`, then the table in columns (the verdict last, unpadded)."""
    header, body = rows(table)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header) - 1)]
    lines = [summary, ""]
    for r in [header, *body]:
        cells = [r[i].ljust(widths[i]) for i in range(len(widths))]
        lines.append("  ".join(cells) + "  " + r[-1])
    if any(c.estimated for c in table):
        lines.append("~ estimated from a compile on fewer devices (see `Candidate.measured_on`).")
    return "\n".join(lines)


def svg(table: Sequence[Candidate], budget: int, width: int = 640) -> str:
    """Stacked bars of bytes per device by part, one per measured candidate, and the budget
    as a red line; under a bar, a thin one for what the candidate holds in host memory (its
    optimiser state, when offloaded; the activations remat `"offload"` saves), on the same
    scale."""
    shown = [c for c in table if c.total_bytes is not None]
    if not shown:
        return ""
    labels = [f"{c.rank}. {c.name} ({mesh_str(c.mesh_shape)})" for c in shown]
    label_w = max(190, int(6.2 * max(len(t) for t in labels)) + 10)  # ~6 px a character
    width = max(width, label_w + 560)
    bar_h, host_h, gap, top = 14, 5, 6, 22
    scale_max = max([budget, *(c.total_bytes or 0 for c in shown)]) * 1.05
    span = width - label_w - 10
    height = top + len(shown) * (bar_h + host_h + gap) + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">'
    ]
    x = label_w
    for part, colour in zip(PARTS, _COLOURS, strict=True):
        out.append(f'<rect x="{x}" y="4" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{x + 13}" y="13">{part}</text>')
        x += 16 + 6 * len(part) + 8
    out.append(f'<rect x="{x}" y="9" width="10" height="{host_h}" fill="{_COLOURS[2]}"/>')
    out.append(f'<text x="{x + 13}" y="13">in host memory</text>')
    for k, c in enumerate(shown):
        y = top + k * (bar_h + host_h + gap)
        label = html.escape(labels[k])
        out.append(f'<text x="0" y="{y + bar_h - 3}">{label}</text>')
        x0 = float(label_w)
        for part, colour in zip(PARTS, _COLOURS, strict=True):
            w = c.bytes.get(part, 0) / scale_max * span
            if w > 0:
                tip = html.escape(f"{part}: {format_bytes(c.bytes[part])}")
                out.append(
                    f'<rect x="{x0:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                    f'fill="{colour}" opacity="{1.0 if c.fits else 0.45}">'
                    f"<title>{tip}</title></rect>"
                )
                x0 += w
        if c.host_bytes:
            w = c.host_bytes / scale_max * span
            held = ["optimizer state"] * bool(c.offload)
            held += ["activations"] * ("offload" in c.remat.values())
            what = " and ".join(held) or "temporaries"
            tip = html.escape(f"{what} in host memory: {format_bytes(c.host_bytes)}")
            out.append(
                f'<rect x="{label_w}" y="{y + bar_h}" width="{w:.1f}" height="{host_h}" '
                f'fill="{_COLOURS[2]}" opacity="{1.0 if c.fits else 0.45}">'
                f"<title>{tip}</title></rect>"
            )
    bx = label_w + budget / scale_max * span
    out.append(
        f'<line x1="{bx:.1f}" y1="{top - 4}" x2="{bx:.1f}" y2="{height - 4}" stroke="red" '
        'stroke-dasharray="4 2"/>'
    )
    out.append(
        f'<text x="{bx - 4:.1f}" y="{height - 1}" fill="red" text-anchor="end">budget '
        f"{html.escape(format_bytes(budget))}</text>"
    )
    out.append("</svg>")
    return "".join(out)


def to_html(table: Sequence[Candidate], budget: int, summary: str) -> str:
    """`summary`, the chart (`svg`) and the table, in HTML."""
    header, body = rows(table)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    trs = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in r) + "</tr>" for r in body
    )
    return (
        f"<div><p>{html.escape(summary)}</p>{svg(table, budget)}"
        f"<table><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table></div>"
    )
