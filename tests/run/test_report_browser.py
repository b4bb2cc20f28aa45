"""The report and a tree page in a real headless Chromium (Debian's `chromium`, installed
by .ci/chromium-deps.sh): each loads without an error in the console, every chart is
there with a visible size, and the tree page draws the episode's shape (a dot per call,
in lanes for its parallel branches and subagents). Screenshots go to $TIDAL_SCREENSHOTS
when it is set, to be looked at."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.run.chromium import Chromium, find_chromium
from tests.run.report_run import make_run
from tidal.run.report import write_report

CHARTS = ["heldout", "reward", "statuses", "throughput", "step_time", "mismatch", "time"]

if find_chromium() is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI needs chromium: .ci/chromium-deps.sh installs it")
    pytest.skip("no chromium (bash .ci/chromium-deps.sh installs it)", allow_module_level=True)

CHART_SIZES = """[...document.querySelectorAll('figure[data-chart]')].map(f => {
  const svg = f.querySelector('svg.chart'); const r = svg ? svg.getBoundingClientRect() : null;
  return [f.dataset.chart, r ? Math.round(r.width) : 0, r ? Math.round(r.height) : 0,
          svg ? svg.querySelectorAll('text').length : 0];
})"""
SHAPE = """(() => { const s = document.querySelector('svg.shape');
  if (!s) return null; const r = s.getBoundingClientRect();
  return {dots: s.querySelectorAll('circle[fill]:not([fill="none"])').length,
          lanes: [...s.querySelectorAll('text')].filter(t => t.getAttribute('text-anchor')
                  === 'end').map(t => t.textContent),
          width: Math.round(r.width), rows: document.querySelectorAll('.row').length}; })()"""


def _keep(name: str, png: bytes) -> None:
    where = os.environ.get("TIDAL_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / name).write_bytes(png)


def test_report_and_tree_page_in_chromium(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", steps=30, every=10)
    report = write_report(run_dir, run_dir / "report.html")
    with Chromium() as browser:
        page = browser.open_page(report, script=CHART_SIZES)
        assert page.errors == []
        assert [c[0] for c in page.value] == CHARTS
        for key, width, height, texts in page.value:
            assert width > 300 and height > 60 and texts > 5, (key, width, height, texts)
        _keep("report.png", page.png)
        link = browser.open_page(report, screenshot=False, script=(
            "document.querySelector('a[href$=\"mix.html\"]').href"))
        assert link.value == (run_dir / "trees" / "mix.html").resolve().as_uri()
        tree = browser.open_page(run_dir / "trees" / "mix.html", script=SHAPE)
        assert tree.errors == []
        shape = tree.value
        assert shape["dots"] == 60  # one per call
        assert shape["lanes"][0] == "main" and "3 subagents" in shape["lanes"]
        assert len(shape["lanes"]) >= 3 and shape["width"] > 400 and shape["rows"] > 60
        _keep("tree.png", tree.png)
    assert page.png[:8] == b"\x89PNG\r\n\x1a\n" and len(page.png) > 50_000
