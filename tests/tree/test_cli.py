"""`tidal trees` and `tidal inspect` on a real ledger file."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

from typer.testing import CliRunner

from tests.tree.synth import (
    SynthWriter,
    write_compaction,
    write_fanout,
    write_linear,
    write_subagents,
)
from tidal.cli import app
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Status

runner = CliRunner()


def _ledger(tmp_path: Path) -> Path:
    path = tmp_path / "l.db"
    with LedgerStore(path) as st:
        w = SynthWriter(st, seed=3)
        write_subagents(w, "sub", width=2, depth=1)
        w.outcome("sub", Status.COMPLETE, 1.0)
        write_fanout(w, "fan", width=2)
        w.outcome("fan", Status.TIMEOUT, 0.0, 0.3)
        write_compaction(w, "cmp", n_compactions=1, calls_per_context=2)
        w.outcome("cmp", Status.INFRA_ERROR, 0.0)
    return path


def test_trees_json(tmp_path: Path) -> None:
    res = runner.invoke(app, ["trees", str(_ledger(tmp_path)), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert sorted(data) == ["cmp", "fan", "sub"]
    for ep in data.values():
        for k in ("nodes", "leaves", "unique_tokens", "path_tokens", "dedup_ratio", "edges",
                  "sampled_paths", "status", "reward"):
            assert k in ep
    assert data["sub"]["edges"] == {"continuation": 3, "subagent": 2}
    assert data["sub"]["sampled_paths"] == 3 and data["sub"]["sessions"] == 3
    assert (data["fan"]["status"], data["fan"]["reward"]) == ("timeout", 0.3)
    assert data["fan"]["edges"] == {"continuation": 2, "parallel": 2}
    assert data["fan"]["dedup_ratio"] == round(data["fan"]["path_tokens"]
                                               / data["fan"]["unique_tokens"], 4)
    assert (data["cmp"]["status"], data["cmp"]["reward"], data["cmp"]["masked"]) == (
        "infra_error", None, True)
    assert data["cmp"]["edges"] == {"continuation": 3, "compaction": 1}
    zero = json.loads(runner.invoke(app, ["trees", str(tmp_path / "l.db"), "--json",
                                          "--incomplete", "zero"]).output)
    assert zero["fan"]["reward"] == 0.0
    table = runner.invoke(app, ["trees", str(tmp_path / "l.db")])
    assert table.exit_code == 0 and "fan" in table.output


def test_trees_errors(tmp_path: Path) -> None:
    res = runner.invoke(app, ["trees", str(tmp_path / "missing.db"), "--json"])
    assert res.exit_code == 2 and "no ledger store" in res.output
    res = runner.invoke(app, ["trees", str(_ledger(tmp_path)), "--order", "best"])
    assert res.exit_code == 2 and "order must be one of" in res.output


class _Checker(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.rows = 0
        self.bad: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("div", "details", "summary", "table", "tr", "td", "span"):
            self.stack.append(tag)
        if tag == "div" and (("class", "row") in attrs or ("class", "row model") in attrs):
            self.rows += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("div", "details", "summary", "table", "tr", "td", "span") and (
            not self.stack or self.stack.pop() != tag
        ):
            self.bad.append(tag)


def test_inspect_html(tmp_path: Path) -> None:
    path = _ledger(tmp_path)
    out = tmp_path / "sub.html"
    res = runner.invoke(app, ["inspect", str(path), "--session", "sub/s1", "--html", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    chk = _Checker()
    chk.feed(page)
    assert chk.bad == [] and chk.stack == []
    assert chk.rows == 12  # 3 sessions x 2 calls x (prompt node + output node)
    assert page.count("subagent session sub/s") == 2
    assert page.count("&#9733;") == 3  # the sampled paths
    data = json.loads(re.search(r"id='nodes'>(.*?)</script>", page, re.S).group(1))  # type: ignore[union-attr]
    texts = [body for n in data.values() for _label, body in n["parts"]]
    assert "main output of sub-c0" in texts and "subagent output of sub.s1-c1" in texts
    assert "<script src" not in page and "http" not in page  # self-contained
    res = runner.invoke(app, ["inspect", str(path), "--session", "nope", "--html", str(out)])
    assert res.exit_code == 2 and "'nope'" in res.output


def test_inspect_shows_output_text_and_raw_tool_calls(tmp_path: Path) -> None:
    path = tmp_path / "lin.db"
    with LedgerStore(path) as st:
        w = SynthWriter(st)
        write_linear(w, "lin", n_calls=2)
        w.outcome("lin", Status.COMPLETE, 1.0)
    out = tmp_path / "lin.html"
    assert runner.invoke(app, ["inspect", str(path), "--session", "lin", "--html",
                               str(out)]).exit_code == 0
    page = out.read_text()
    data = json.loads(re.search(r"id='nodes'>(.*?)</script>", page, re.S).group(1))  # type: ignore[union-attr]
    parts = {label: body for n in data.values() for label, body in n["parts"]}
    assert parts["raw_tool_calls"] == '{"name": "run"}'
    assert parts["output tokens [0:4] of the call; output_text"] in (
        "main output of lin-c0", "main output of lin-c1")
    assert "reward 1 adv +0" in page


def test_trees_skips_a_session_with_no_calls(tmp_path: Path) -> None:
    path = _ledger(tmp_path)
    with LedgerStore(path) as st:  # an outcome for a session that never called
        from tidal.ledger.types import Outcome

        st.append_outcome(Outcome("ghost", Status.COMPLETE, 1.0))
    res = runner.invoke(app, ["trees", str(path), "--json"])
    assert res.exit_code == 0, res.output  # readers tolerate it (issue 27, item 2)
    assert "outcome of session 'ghost'" in res.stderr and "has no calls" in res.stderr
    assert set(json.loads(res.stdout)) == {"sub", "fan", "cmp"}
