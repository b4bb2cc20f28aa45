"""The report's charts: matplotlib figures written as inline SVG.

Why matplotlib: it is the plotting library people already read and extend, it writes a
static SVG that needs no script to display (the page opens anywhere, offline, and prints),
and its tick locators and constrained layout give readable axes at any run length. (Vega-
Lite through vl-convert would mean a 33 MB binary wheel for the same static output.)

Conventions, the same on every chart: x is the RL step with integer ticks; rates are
percentages on a fixed 0-100% axis; every axis says its unit; legends sit below the plot,
outside the data; markers are drawn while there are few points, and a noisy training
curve gets a rolling mean over the raw one once the run is long; series that coincide
(every check at 0% early on) are drawn widest first, so each stays visible. Text stays text in the
SVG (`svg.fonttype = none`), so it is sharp and searchable; each chart's element ids
carry its key, so several charts in one page never share one.
"""

from __future__ import annotations

import functools
import io
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec

from tidal.run.report.data import Series

try:
    import matplotlib

    matplotlib.use("svg")  # no display, no GUI toolkit
    from matplotlib.figure import Figure
    from matplotlib.ticker import (
        FuncFormatter,
        LogLocator,
        MaxNLocator,
        NullFormatter,
        PercentFormatter,
    )
except ImportError as e:  # pragma: no cover - the report extra is missing
    raise ImportError("tidal report draws its charts with matplotlib: pip install "
                      "'tidal[report]'") from e

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d",
           "#4b5563")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STATUS_COLOURS = {"complete": "#16a34a", "truncated": "#f59e0b", "timeout": "#ea580c",
                  "aborted": "#dc2626", "infra_error": "#6b7280"}
MARKERS_UP_TO = 40  # points per series drawn with markers
SMOOTH_FROM = 25  # points per series from which a rolling mean is drawn over the raw curve
_STYLE: Any = {  # matplotlib rc parameters
    "svg.fonttype": "none",
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Liberation Sans", "Arial", "Helvetica"],
    "font.size": 9.5,
    "axes.titlesize": 10.5,
    "axes.labelsize": 9.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e5e7eb",
    "grid.linewidth": 0.8,
    "axes.edgecolor": "#6b7280",
    "xtick.color": "#374151",
    "ytick.color": "#374151",
    "legend.frameon": False,
    "legend.fontsize": 9,
}
WIDTH_IN, HEIGHT_IN = 6.4, 3.3
P = ParamSpec("P")


@dataclass(frozen=True)
class Chart:
    """One figure of the page: `key` is its HTML id (chart-KEY), `svg` the drawing."""

    key: str
    title: str
    svg: str
    note: str = ""


def _styled(draw: Callable[P, Chart]) -> Callable[P, Chart]:
    """Draws under the report's style (rc parameters are read both when artists are made
    and when the SVG is written, so both happen inside)."""

    @functools.wraps(draw)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Chart:
        with matplotlib.rc_context(_STYLE):
            return draw(*args, **kwargs)

    return wrapper


def _svg(fig: Figure, key: str) -> str:
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "tidal"}):  # the same chart, the same SVG
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    # element ids prefixed with the chart's key: matplotlib numbers groups per figure
    # ("figure_1", "axes_1"), and one page holds several figures
    text = re.sub(r'(\bid="|url\(#|href="#)([^")]+)', rf"\1{key}-\2", text)
    # sized by the page (viewBox kept), so a chart fills its card at any width
    return re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"',
                  rf'<svg\1 class="chart" role="img" aria-label="{key}"', text, count=1)


def _figure(height: float = HEIGHT_IN, rows: int = 1) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(WIDTH_IN, height), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0].tolist()
    return fig, axes


def _steps_axis(ax: Any, xs: Sequence[float], label: str = "RL step") -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins="auto", min_n_ticks=3))
    if xs:
        lo, hi = min(xs), max(xs)
        pad = max((hi - lo) * 0.03, 0.5)
        ax.set_xlim(lo - pad, hi + pad)
    ax.set_xlabel(label)


def _percent_axis(ax: Any) -> None:
    ax.set_ylim(-0.03, 1.03)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=0))


def _legend(fig: Figure, ax: Any, n: int) -> None:
    if n > 1:
        handles, labels = ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=min(n, 4))


def _rolling(ys: Sequence[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= w:
            acc -= ys[i - w]
        out.append(acc / min(i + 1, w))
    return out


@_styled
def _empty(key: str, title: str, why: str) -> Chart:
    fig, (ax,) = _figure(height=1.6)
    ax.set_axis_off()
    ax.text(0.5, 0.5, why, ha="center", va="center", color="#6b7280", transform=ax.transAxes)
    return Chart(key, title, _svg(fig, key))


@_styled
def line_chart(key: str, title: str, lines: dict[str, Series], *, y_label: str,
               percent: bool = False, log_if_spread: bool = False, smooth: bool = False,
               note: str = "", steps: Sequence[float] = ()) -> Chart:
    """Lines over RL steps; `percent`: a 0-100% axis; `log_if_spread`: a log axis when
    the series differ by more than 10x; `smooth`: a rolling mean over long raw curves;
    `steps`: the x range to show (every step of the run, where a series skips some)."""
    lines = {k: v for k, v in lines.items() if v}
    if not lines:
        return _empty(key, title, "no data in this run")
    fig, (ax,) = _figure()
    xs = [x for s in lines.values() for x, _ in s] + list(steps)
    notes = [note] if note else []
    for i, (label, s) in enumerate(lines.items()):
        colour, marker = PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]
        x, y = [p[0] for p in s], [p[1] for p in s]
        few = len(s) <= MARKERS_UP_TO
        if smooth and len(s) >= SMOOTH_FROM:
            w = max(3, len(s) // 12)
            ax.plot(x, y, color=colour, linewidth=0.8, alpha=0.3)
            ax.plot(x, _rolling(y, w), color=colour, linewidth=1.8, label=label)
            if not any("rolling mean" in n for n in notes):
                notes.append(f"bold: rolling mean over {w} steps; faint: each step")
        else:  # earlier series drawn wider, so lines that coincide all stay visible
            under = len(lines) - 1 - i
            ax.plot(x, y, color=colour, linewidth=1.5 + 0.9 * under, label=label,
                    marker=marker if few else None, markersize=4 + 2.2 * under,
                    markerfacecolor="white", markeredgewidth=1.4, zorder=2 + i,
                    linestyle="-" if i < 4 else "--")
    _steps_axis(ax, xs)
    ax.set_ylabel(y_label)
    if percent:
        _percent_axis(ax)
    elif log_if_spread:
        ys = [y for s in lines.values() for _, y in s if y > 0]
        if ys and max(ys) / min(ys) > 10:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_ylabel(f"{y_label} (log scale)")
        else:
            ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(FuncFormatter(_si))
    _legend(fig, ax, len(lines))
    return Chart(key, title, _svg(fig, key), "; ".join(notes))


@_styled
def panels_chart(key: str, title: str, panels: dict[str, Series], note: str = "",
                 steps: Sequence[float] = ()) -> Chart:
    """One small panel per series, sharing the step axis: for quantities on different
    scales (no second y axis to misread)."""
    panels = {k: v for k, v in panels.items() if v}
    if not panels:
        return _empty(key, title, "no data in this run")
    fig, axes = _figure(height=1.25 + 1.15 * len(panels), rows=len(panels))
    xs = [x for s in panels.values() for x, _ in s] + list(steps)
    for i, (ax, (label, s)) in enumerate(zip(axes, panels.items(), strict=True)):
        few = len(s) <= MARKERS_UP_TO
        ax.plot([p[0] for p in s], [p[1] for p in s], color=PALETTE[i % len(PALETTE)],
                linewidth=1.6, marker="o" if few else None, markersize=4)
        ax.set_ylabel(label)
        ax.yaxis.set_major_locator(MaxNLocator(nbins=4))
        ax.yaxis.set_major_formatter(FuncFormatter(_si))
    _steps_axis(axes[-1], xs)
    return Chart(key, title, _svg(fig, key), note)


@_styled
def stacked_bars(key: str, title: str, parts: dict[str, Series], *, y_label: str,
                 percent: bool = False, colours: dict[str, str] | None = None,
                 note: str = "") -> Chart:
    """Per RL step, bars stacked from `parts` (each a series over the same steps); a
    stacked area once there are too many steps for bars."""
    parts = {k: v for k, v in parts.items() if v}
    if not parts:
        return _empty(key, title, "no data in this run")
    steps = sorted({x for s in parts.values() for x, _ in s})
    fig, (ax,) = _figure()
    bottom = dict.fromkeys(steps, 0.0)
    colours = colours or {}
    stack: list[list[float]] = []
    names = list(parts)
    for i, name in enumerate(names):
        ys = dict(parts[name])
        colour = colours.get(name, PALETTE[i % len(PALETTE)])
        heights = [ys.get(x, 0.0) for x in steps]
        if len(steps) <= 60:
            ax.bar(steps, heights, bottom=[bottom[x] for x in steps], width=0.75,
                   color=colour, label=name, linewidth=0)
        stack.append(heights)
        for x, h in zip(steps, heights, strict=True):
            bottom[x] += h
    if len(steps) > 60:
        ax.stackplot(steps, stack, labels=names, linewidth=0,
                     colors=[colours.get(n, PALETTE[i % len(PALETTE)])
                             for i, n in enumerate(names)])
    _steps_axis(ax, steps)
    ax.set_ylabel(y_label)
    ax.grid(axis="x", visible=False)
    if percent:
        _percent_axis(ax)
    else:
        ax.yaxis.set_major_formatter(FuncFormatter(_si))
    _legend(fig, ax, max(len(parts), 2))
    return Chart(key, title, _svg(fig, key), note)


@_styled
def split_bar(key: str, title: str, parts: dict[str, float], note: str = "") -> Chart:
    """One horizontal bar split by share of the total; the legend below names each
    part with its seconds and share, so no label has to fit inside its segment."""
    total = sum(parts.values())
    if total <= 0:
        return _empty(key, title, "no timings in this run")
    fig = Figure(figsize=(WIDTH_IN, 1.7), layout="constrained")
    ax = fig.subplots()
    left = 0.0
    for i, (name, secs) in enumerate(parts.items()):
        share = secs / total
        ax.barh([0], [share], left=left, height=0.6, color=PALETTE[i % len(PALETTE)],
                label=f"{name}: {_duration(secs)} ({share:.0%})", linewidth=0)
        if share >= 0.08:
            ax.text(left + share / 2, 0, f"{share:.0%}", ha="center", va="center",
                    color="white", fontsize=9, fontweight="bold")
        left += share
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ax.grid(False)
    ax.xaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=0))
    ax.set_xlabel(f"share of {_duration(total)} of wall clock")
    for side in ("left", "top", "right"):
        ax.spines[side].set_visible(False)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2)
    return Chart(key, title, _svg(fig, key), note)


def _si(v: float, _pos: object = None) -> str:
    """Tick text: 1.2k, 35, 0.05, 2e-05."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e3:
        return f"{v / 1e3:.3g}k"
    if a == 0 or a >= 1e-3:
        return f"{v:.3g}"
    return f"{v:.0e}"


def _duration(secs: float) -> str:
    if secs < 120:
        return f"{secs:.0f} s"
    if secs < 7200:
        return f"{secs / 60:.1f} min"
    return f"{secs / 3600:.1f} h"

