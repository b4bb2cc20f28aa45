"""`tidal report`: the page's parts from a run directory (no browser here; the page in
headless Chromium is tests/run/test_report_browser.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.run.report_run import make_run
from tidal.cli import app
from tidal.run.report import render_report, write_report
from tidal.run.report.data import load_run, status_rates, time_split

CHARTS = ("heldout", "reward", "statuses", "throughput", "step_time", "mismatch", "time")


def _figure(page: str, key: str) -> str:
    m = re.search(rf'<figure id="chart-{key}" data-chart="{key}">(.*?)</figure>', page, re.S)
    assert m, f"no chart {key}"
    return m.group(1)


@pytest.mark.parametrize("steps", [2, 30, 400])
def test_every_chart_is_drawn_at_any_run_length(tmp_path: Path, steps: int) -> None:
    page = render_report(make_run(tmp_path / "run", steps=steps, every=max(1, steps // 4)))
    for key in CHARTS:
        fig = _figure(page, key)
        assert fig.count("<svg") == 1 and "no data in this run" not in fig, key
        assert "<path" in fig, key  # something drawn
    held = _figure(page, "heldout")
    for label in ("success", "check: equals", "check: exists", "check: finished", "RL step",
                  "held-out episodes", "100%"):
        assert label in held, label
    assert "tokens / s" in _figure(page, "throughput")
    for status in ("complete", "truncated", "timeout", "infra_error")[:3 + (steps >= 7)]:
        assert status in _figure(page, "statuses")
    if steps >= 30:
        assert "rolling mean" in _figure(page, "reward")
    # chart element ids never collide across the inline SVGs of one page
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids))


def test_summary_is_a_table_of_named_fields(tmp_path: Path) -> None:
    page = render_report(make_run(tmp_path / "run"))
    for field in ("Held-out success after the warm start", "Held-out success at the end",
                  "RL steps", "RL sessions trained", "tidal verify", "Device utilisation",
                  "Staleness of trained groups", "40 groups 0 behind, 12 groups 1 behind"):
        assert field in page, field
    assert "heldout_curve" not in page and '"schedule_policy"' not in page  # no raw JSON
    assert 'href="#chart-heldout"' in page


def test_numbers_behind_the_charts(tmp_path: Path) -> None:
    run = load_run(make_run(tmp_path / "run", steps=7, every=7))
    rates = status_rates(run.phase("rl"))
    assert list(rates) == ["complete", "infra_error", "timeout", "truncated"]
    for step in range(7):  # each step's shares add up to 1
        assert sum(s[step][1] for s in rates.values()) == pytest.approx(1.0)
    split = time_split(run)
    assert split["warm start"] == 130.0 and split["evaluation"] == 24.0
    assert sum(split.values()) == pytest.approx(run.summary["minutes"] * 60)
    assert split["other (start-up, checkpoints, verify)"] == pytest.approx(40.0)


def test_tree_links_are_relative_to_where_the_page_is_written(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run")
    assert 'href="trees/mix.html"' in render_report(run_dir)
    out = tmp_path / "elsewhere" / "r.html"
    out.parent.mkdir()
    write_report(run_dir, out)
    page = out.read_text()
    assert 'href="../run/trees/mix.html"' in page
    assert (out.parent / "../run/trees/mix.html").exists()
    assert "subagent 3" in page and "parallel 21" in page  # the tree table's edges


def test_report_command(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", steps=3, every=3)
    res = CliRunner().invoke(app, ["report", str(run_dir), "--html", str(run_dir / "r.html")])
    assert res.exit_code == 0, res.output
    assert (run_dir / "r.html").read_text().count('<figure id="chart-') == len(CHARTS)
    res = CliRunner().invoke(app, ["report", str(tmp_path), "--html", str(tmp_path / "x")])
    assert res.exit_code == 2 and "no metrics.jsonl" in res.output
