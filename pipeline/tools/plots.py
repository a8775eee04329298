"""Inline SVG charts for the self-contained HTML report: no JavaScript, no external files."""

from __future__ import annotations

import math
from html import escape
from typing import Sequence

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"]
WIDTH, HEIGHT = 640, 320
LEFT, RIGHT, TOP, BOTTOM = 70, 170, 36, 48  # margins; the legend sits on the right, and widens the chart to fit
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

# Advance widths of DejaVu Sans (1000 units per em), the widest of the common sans-serif faces
# and what Chromium draws `sans-serif` with on Debian, for ASCII 32..126; anything else counts
# as 1 em. A label measured with it fits in any of the usual faces.
_ADVANCE = [
    318,
    401,
    460,
    838,
    636,
    950,
    780,
    275,
    390,
    390,
    500,
    838,
    318,
    361,
    318,
    337,
    636,
    636,
    636,
    636,
    636,
    636,
    636,
    636,
    636,
    636,
    337,
    337,
    838,
    838,
    838,
    531,
    1000,
    684,
    686,
    698,
    770,
    632,
    575,
    775,
    752,
    295,
    295,
    656,
    557,
    863,
    748,
    787,
    603,
    787,
    695,
    635,
    611,
    732,
    684,
    989,
    685,
    611,
    685,
    390,
    337,
    390,
    838,
    500,
    500,
    613,
    635,
    550,
    635,
    615,
    352,
    635,
    634,
    278,
    278,
    579,
    278,
    974,
    634,
    612,
    635,
    635,
    411,
    521,
    392,
    634,
    592,
    818,
    592,
    592,
    525,
    636,
    337,
    636,
    838,
]
LEGEND_FONT = 11  # px, as in STYLE
LEGEND_SWATCH = 28  # the color square and the gap after it
LEGEND_MAX_TEXT = 300  # px: a longer label wraps onto more lines
LEGEND_LINE = 14  # px between the lines of one label
LEGEND_GAP = 6  # px between two labels


def text_width(text: str, size: float = LEGEND_FONT) -> float:
    """Width in px of `text` at font size `size`, an upper bound for the usual sans-serif faces."""
    return sum(_ADVANCE[ord(c) - 32] if 32 <= ord(c) < 127 else 1000 for c in text) * size / 1000


def wrap_label(text: str, max_width: float = LEGEND_MAX_TEXT, size: float = LEGEND_FONT) -> list[str]:
    """`text` as lines of at most `max_width` px, broken after spaces, '-', '_', '/', '.' or ','
    where it can, else between any two characters. Joined, the lines are `text`."""
    lines, line = [], ""
    for piece in _pieces(text):
        if line and text_width(line + piece, size) > max_width:
            lines.append(line)
            line = ""
        while text_width(piece, size) > max_width:  # a piece wider than a line: cut it where it must
            cut = 1
            while text_width(piece[: cut + 1], size) <= max_width:
                cut += 1
            lines.append(piece[:cut])
            piece = piece[cut:]
        line += piece
    return [*lines, line] if line or not lines else lines


def _pieces(text: str) -> list[str]:
    """`text` cut after each break character."""
    pieces, start = [], 0
    for i, c in enumerate(text):
        if c in " -_/.,":
            pieces.append(text[start : i + 1])
            start = i + 1
    return [*pieces, text[start:]] if start < len(text) else pieces


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    start = math.floor(low / step) * step
    ticks, value = [], start
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 12))
    return ticks


def _label(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.3g}"


def _frame(plot_id: str, title: str, body: list[str], width: float = WIDTH, height: float = HEIGHT) -> str:
    width, height = max(width, WIDTH), max(height, HEIGHT)
    return "\n".join(
        [
            f'<svg class="plot" data-plot="{escape(plot_id)}" xmlns="http://www.w3.org/2000/svg" '
            f'viewBox="0 0 {width:g} {height:g}" width="{width:g}" height="{height:g}" role="img" '
            f'aria-label="{escape(title)}">',
            f"<title>{escape(title)}</title>",
            f'<text x="{LEFT}" y="20" class="plot-title">{escape(title)}</text>',
            *body,
            "</svg>",
        ]
    )


def _no_data(plot_id: str, title: str) -> str:
    return _frame(
        plot_id, title, [f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="no-data">no data</text>']
    )


def _axes(
    xs: list[float], ys: list[float], x_label: str, y_label: str, y_from_zero: bool = True, integer_x: bool = False
):
    if integer_x and max(xs) - min(xs) <= 10:
        x_ticks = [float(x) for x in range(int(min(xs)), int(max(xs)) + 1)] or [min(xs)]
        if len(x_ticks) == 1:
            x_ticks.append(x_ticks[0] + 1)
    else:
        x_ticks = nice_ticks(min(xs), max(xs))
    y_ticks = nice_ticks(min(0.0, min(ys)) if y_from_zero else min(ys), max(ys))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x_ticks[0]) / ((x_ticks[-1] - x_ticks[0]) or 1) * plot_w

    def sy(y: float) -> float:
        return TOP + plot_h - (y - y_ticks[0]) / ((y_ticks[-1] - y_ticks[0]) or 1) * plot_h

    body = [f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" class="plot-area"/>']
    for y in y_ticks:
        body.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" class="grid"/>')
        body.append(f'<text x="{LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" class="tick">{_label(y)}</text>')
    for x in x_ticks:
        body.append(
            f'<text x="{sx(x):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle" class="tick">{_label(x)}</text>'
        )
    body.append(
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle" '
        f'class="axis-label">{escape(x_label)}</text>'
    )
    body.append(
        f'<text transform="translate(16 {TOP + plot_h / 2}) rotate(-90)" text-anchor="middle" '
        f'class="axis-label">{escape(y_label)}</text>'
    )
    return sx, sy, body


def _legend(names: Sequence[str], x: float) -> tuple[list[str], float, float]:
    """The legend at `x` (the plot area's right edge): every label whole, wrapped when longer
    than LEGEND_MAX_TEXT. Returns (its SVG elements, the chart width and height it needs)."""
    out, y, widest = [], TOP + 8, 0.0
    for i, name in enumerate(names):
        color = PALETTE[i % len(PALETTE)]
        lines = wrap_label(name)
        widest = max(widest, *(text_width(line) for line in lines))
        spans = "".join(
            f'<tspan x="{x + 12 + LEGEND_SWATCH:g}" dy="{0 if j == 0 else LEGEND_LINE}">{escape(line)}</tspan>'
            for j, line in enumerate(lines)
        )
        out.append(
            f'<g class="legend-entry"><title>{escape(name)}</title>'
            f'<rect x="{x + 12:g}" y="{y - 8:g}" width="10" height="10" fill="{color}"/>'
            f'<text y="{y + 1:g}" class="legend">{spans}</text></g>'
        )
        y += LEGEND_LINE * (len(lines) - 1) + 18 + (LEGEND_GAP if len(lines) > 1 else 0)
    return out, x + 12 + LEGEND_SWATCH + widest + 12, y + 8


def line_chart(
    plot_id: str,
    title: str,
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    x_label: str,
    y_label: str,
    integer_x: bool = False,
) -> str:
    """One line with point markers per named series of (x, y) points."""
    series = [(name, sorted(points)) for name, points in series if points]
    if not series:
        return _no_data(plot_id, title)
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    sx, sy, body = _axes(xs, ys, x_label, y_label, integer_x=integer_x)
    for i, (name, points) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        d = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(points))
        body.append(f'<path d="{d}" class="series" stroke="{color}"><title>{escape(name)}</title></path>')
        for x, y in points:
            body.append(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}" class="point">'
                f"<title>{escape(name)}: {_label(x)}, {_label(y)}</title></circle>"
            )
    legend, width, height = _legend([name for name, _ in series], LEFT + PLOT_W)
    return _frame(plot_id, title, body + legend, width, height)


BAR_LABEL_LINE = 13  # px between the lines of a wrapped bar label


def bar_chart(plot_id: str, title: str, bars: Sequence[tuple[str, float, str]], value_label: str) -> str:
    """Horizontal bars (label, value, group); bars of one group share a color. The labels on the
    left are whole: the margin widens to the longest, up to LEGEND_MAX_TEXT, and a longer one
    wraps, the bars spreading to make room."""
    bars = [b for b in bars if b[1] is not None]
    if not bars:
        return _no_data(plot_id, title)
    groups = list(dict.fromkeys(group for _, _, group in bars))
    ticks = nice_ticks(0.0, max(v for _, v, _ in bars))
    labels = [wrap_label(label, size=LEGEND_FONT) for label, _, _ in bars]
    left = max(LEFT, 12 + max(text_width(line) for lines in labels for line in lines))
    band = max(PLOT_H / len(bars), BAR_LABEL_LINE * max(len(lines) for lines in labels) + 6)
    plot_w, plot_h = PLOT_W, band * len(bars)
    body = [f'<rect x="{left:g}" y="{TOP}" width="{plot_w}" height="{plot_h:g}" class="plot-area"/>']
    for t in ticks:
        x = left + t / ticks[-1] * plot_w
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h:.1f}" class="grid"/>')
        body.append(
            f'<text x="{x:.1f}" y="{TOP + plot_h + 16:.1f}" text-anchor="middle" class="tick">{_label(t)}</text>'
        )
    for i, ((label, value, group), lines) in enumerate(zip(bars, labels)):
        color = PALETTE[groups.index(group) % len(PALETTE)]
        y = TOP + i * band + band * 0.15
        width = max(value / ticks[-1] * plot_w, 1.0)
        body.append(
            f'<rect x="{left:g}" y="{y:.1f}" width="{width:.1f}" height="{band * 0.7:.1f}" fill="{color}" class="bar">'
            f"<title>{escape(label)}: {_label(value)}</title></rect>"
        )
        first = TOP + i * band + band / 2 + 4 - BAR_LABEL_LINE * (len(lines) - 1) / 2
        spans = "".join(
            f'<tspan x="{left - 6:g}" dy="{0 if j == 0 else BAR_LABEL_LINE}">{escape(line)}</tspan>'
            for j, line in enumerate(lines)
        )
        body.append(f'<text y="{first:.1f}" text-anchor="end" class="tick bar-label">{spans}</text>')
    bottom = TOP + plot_h + BOTTOM
    body.append(
        f'<text x="{left + plot_w / 2:g}" y="{bottom - 8:.1f}" text-anchor="middle" '
        f'class="axis-label">{escape(value_label)}</text>'
    )
    legend, width, height = _legend(groups, left + plot_w)
    return _frame(plot_id, title, body + legend, width, max(height, bottom))


STYLE = """
svg.plot { font-family: sans-serif; background: #fff; margin: 8px 0; }
svg.plot .plot-title { font-size: 14px; font-weight: bold; }
svg.plot .plot-area { fill: #fafafa; stroke: #ccc; }
svg.plot .grid { stroke: #e4e4e4; }
svg.plot .tick, svg.plot .legend { font-size: 11px; fill: #333; }
svg.plot .axis-label { font-size: 12px; fill: #111; }
svg.plot .series { fill: none; stroke-width: 2; }
svg.plot .no-data { font-size: 14px; fill: #999; }
"""
