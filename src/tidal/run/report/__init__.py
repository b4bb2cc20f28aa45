"""`tidal report RUN_DIR --html FILE`: one self-contained HTML page for a run.

What it shows: the summary as named fields (and the schedule's as a table of its own),
held-out success and the share of each kind of check passed, training reward, how RL
episodes ended (per status), tokens per second of rollout and training, seconds per
step, the train/inference mismatch, and where the wall clock went; then links to the
sample session trees (`RUN_DIR/trees/*.html`, drawn by `tidal.tree.html`).

Split so each part reads alone: `data` pulls series out of the run directory (no
drawing), `charts` draws them with matplotlib as inline SVG, `page` lays out the HTML.
"""

from tidal.run.report.data import read_metrics
from tidal.run.report.page import render_report, write_report

__all__ = ["read_metrics", "render_report", "write_report"]
