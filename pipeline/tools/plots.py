"""Inline SVG charts for the self-contained HTML report: no JavaScript, no external files."""

from __future__ import annotations

import math
from html import escape
from typing import Sequence

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"]
WIDTH, HEIGHT = 640, 320
LEFT, RIGHT, TOP, BOTTOM = 70, 170, 36, 48  # margins; the legend sits on the right


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


def _frame(plot_id: str, title: str, body: list[str]) -> str:
    return "\n".join(
        [
            f'<svg class="plot" data-plot="{escape(plot_id)}" xmlns="http://www.w3.org/2000/svg" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}">',
            f"<title>{escape(title)}</title>",
            f'<text x="{LEFT}" y="20" class="plot-title">{escape(title)}</text>',
            *body,
            "</svg>",
        ]
    )


def _no_data(plot_id: str, title: str) -> str:
    return _frame(plot_id, title, [f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="no-data">no data</text>'])


def _axes(xs: list[float], ys: list[float], x_label: str, y_label: str, y_from_zero: bool = True, integer_x: bool = False):
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
        body.append(f'<text x="{sx(x):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle" class="tick">{_label(x)}</text>')
    body.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle" class="axis-label">{escape(x_label)}</text>')
    body.append(
        f'<text transform="translate(16 {TOP + plot_h / 2}) rotate(-90)" text-anchor="middle" class="axis-label">{escape(y_label)}</text>'
    )
    return sx, sy, body


def _legend(names: Sequence[str]) -> list[str]:
    out = []
    for i, name in enumerate(names):
        y = TOP + 8 + 18 * i
        color = PALETTE[i % len(PALETTE)]
        out.append(f'<rect x="{WIDTH - RIGHT + 12}" y="{y - 8}" width="10" height="10" fill="{color}"/>')
        short = name if len(name) <= 24 else name[:11] + "…" + name[-11:]
        out.append(f'<text x="{WIDTH - RIGHT + 28}" y="{y + 1}" class="legend">{escape(short)}</text>')
    return out


def line_chart(
    plot_id: str, title: str, series: Sequence[tuple[str, Sequence[tuple[float, float]]]], x_label: str, y_label: str, integer_x: bool = False
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
    return _frame(plot_id, title, body + _legend([name for name, _ in series]))


def bar_chart(plot_id: str, title: str, bars: Sequence[tuple[str, float, str]], value_label: str) -> str:
    """Horizontal bars (label, value, group); bars of one group share a color."""
    bars = [b for b in bars if b[1] is not None]
    if not bars:
        return _no_data(plot_id, title)
    groups = list(dict.fromkeys(group for _, _, group in bars))
    ticks = nice_ticks(0.0, max(v for _, v, _ in bars))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    band = plot_h / len(bars)
    body = [f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" class="plot-area"/>']
    for t in ticks:
        x = LEFT + t / ticks[-1] * plot_w
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h}" class="grid"/>')
        body.append(f'<text x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle" class="tick">{_label(t)}</text>')
    for i, (label, value, group) in enumerate(bars):
        color = PALETTE[groups.index(group) % len(PALETTE)]
        y = TOP + i * band + band * 0.15
        width = max(value / ticks[-1] * plot_w, 1.0)
        body.append(
            f'<rect x="{LEFT}" y="{y:.1f}" width="{width:.1f}" height="{band * 0.7:.1f}" fill="{color}" class="bar">'
            f"<title>{escape(label)}: {_label(value)}</title></rect>"
        )
        short = label if len(label) <= 10 else "…" + label[-9:]
        body.append(f'<text x="{LEFT - 6}" y="{y + band * 0.35 + 4:.1f}" text-anchor="end" class="tick">{escape(short)}</text>')
    body.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle" class="axis-label">{escape(value_label)}</text>')
    return _frame(plot_id, title, body + _legend(groups))


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
