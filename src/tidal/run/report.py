"""`tidal report RUN_DIR --html FILE`: one self-contained HTML page for a finished run.

Plots are inline SVG drawn here (no plotting library, no JavaScript needed to read
them): held-out success and the fraction of each kind of check passed, mean reward over
steps, train/inference mismatch over steps, and the wall-clock split between rollout
and training. Links point at tree pages (`RUN_DIR/trees/*.html`, made by `tidal
inspect`) for a few sample sessions.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: is it a tidal run directory?")
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def line_chart(
    title: str, series: dict[str, Sequence[tuple[float, float]]], *, y_label: str = ""
) -> str:
    """An SVG line chart; `series` maps a label to (x, y) points."""
    w, h, pad = 560, 240, 44
    pts = [p for s in series.values() for p in s]
    if not pts:
        return f"<figure><figcaption>{html.escape(title)}: no data</figcaption></figure>"
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0 = min(0.0, *ys)
    y1 = max(ys) if max(ys) > y0 else y0 + 1.0

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (w - 2 * pad)

    def sy(y: float) -> float:
        return h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad)

    parts = [
        f'<svg viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img">',
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#999"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#999"/>',
        f'<text x="{pad - 4}" y="{sy(y1) + 4:.1f}" text-anchor="end" font-size="10">'
        f"{y1:.3g}</text>",
        f'<text x="{pad - 4}" y="{sy(y0) + 4:.1f}" text-anchor="end" font-size="10">'
        f"{y0:.3g}</text>",
        f'<text x="{sx(x0):.1f}" y="{h - pad + 14}" font-size="10">{x0:g}</text>',
        f'<text x="{sx(x1):.1f}" y="{h - pad + 14}" font-size="10" text-anchor="end">'
        f"{x1:g}</text>",
        f'<text x="{w / 2}" y="{h - 6}" font-size="11" text-anchor="middle">step</text>',
        f'<text x="12" y="{h / 2}" font-size="11" transform="rotate(-90 12 {h / 2})" '
        f'text-anchor="middle">{html.escape(y_label)}</text>',
    ]
    for i, (label, s) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        if s:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                         f'points="{path}"/>')
            parts.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}">'
                         f"<title>{html.escape(label)} step {x:g}: {y:.4g}</title></circle>"
                         for x, y in s)
        parts.append(f'<text x="{w - pad}" y="{pad + 14 * i}" font-size="11" fill="{color}" '
                     f'text-anchor="end">{html.escape(label)}</text>')
    parts.append("</svg>")
    return f"<figure><figcaption>{html.escape(title)}</figcaption>{''.join(parts)}</figure>"


def _series(rows: list[dict[str, Any]], phase: str, key: str) -> list[tuple[float, float]]:
    return [
        (float(r["step"]), float(r[key]))
        for r in rows
        if r.get("phase") == phase and isinstance(r.get(key), int | float)
    ]


def _check_series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per kind of check, the fraction the held-out episodes passed at each evaluation."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("phase") == "eval":
            for kind, rate in (r.get("checks") or {}).items():
                out.setdefault(f"check: {kind}", []).append((float(r["step"]), float(rate)))
    return out


def time_split_bar(rows: list[dict[str, Any]]) -> str:
    parts = {
        "warm start": sum(r.get("seconds", 0.0) for r in rows if r.get("phase") == "warmstart"),
        # elastic/async: rollouts overlap training; "rollout" is the trainer's wait
        "rollout (not overlapped)": sum(
            r.get("rollout_s", 0.0) for r in rows if r.get("phase") == "rl"
        ),
        "train": sum(r.get("train_s", 0.0) for r in rows if r.get("phase") == "rl"),
        "evaluation": sum(r.get("seconds", 0.0) for r in rows if r.get("phase") == "eval"),
    }
    total = sum(parts.values()) or 1.0
    x, out = 0.0, ['<svg viewBox="0 0 560 60" width="560" height="60">']
    for i, (name, secs) in enumerate(parts.items()):
        wdt = 560 * secs / total
        out.append(f'<rect x="{x:.1f}" y="0" width="{wdt:.1f}" height="30" '
                   f'fill="{_COLORS[i]}"><title>{name}: {secs:.1f} s</title></rect>')
        out.append(f'<text x="{x + 2:.1f}" y="46" font-size="11">{name} {secs:.0f}s</text>')
        x += wdt
    out.append("</svg>")
    return f"<figure><figcaption>Wall-clock split</figcaption>{''.join(out)}</figure>"


def render_report(run_dir: Path) -> str:
    rows = read_metrics(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    charts = [
        line_chart("Held-out success rate, and the checks passed",
                   {"success": _series(rows, "eval", "success_rate"), **_check_series(rows)},
                   y_label="fraction"),
        line_chart("Training reward", {
            "mean reward": _series(rows, "rl", "reward_mean"),
            "success rate": _series(rows, "rl", "success_rate"),
        }, y_label="reward"),
        line_chart("Train/inference mismatch", {
            "k3 KL": _series(rows, "rl", "k3_kl"),
            "mean |dlogp|": _series(rows, "rl", "mean_abs_logprob_diff"),
        }, y_label="mismatch"),
        time_split_bar(rows),
    ]
    trees = sorted((run_dir / "trees").glob("*.html")) if (run_dir / "trees").exists() else []
    links = "".join(
        f'<li><a href="trees/{html.escape(p.name)}">{html.escape(p.stem)}</a></li>' for p in trees
    ) or "<li>none</li>"
    summary_rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v))}</td></tr>"
        for k, v in summary.items()
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tidal run {html.escape(run_dir.name)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}
figure{{display:inline-block;margin:1em;vertical-align:top}}
table{{border-collapse:collapse}}th,td{{border:1px solid #ddd;padding:2px 8px;text-align:left}}
</style></head><body>
<h1>tidal run: {html.escape(str(run_dir))}</h1>
<h2>Summary</h2><table>{summary_rows}</table>
<h2>Curves</h2>{"".join(charts)}
<h2>Sample session trees</h2><ul>{links}</ul>
</body></html>
"""


def write_report(run_dir: Path, out: Path) -> Path:
    out.write_text(render_report(run_dir), encoding="utf-8")
    return out
