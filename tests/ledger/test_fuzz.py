"""Fuzzing `tidal ledger import` (hypothesis): the lines of a real export, given fresh
session ids, then mutated (keys dropped, renamed or added; values of the wrong type; huge
ints, NaN and infinities, lone surrogates, deep nesting; random bytes, truncated,
duplicated, dropped or swapped lines), and random lines, imported through the real CLI
(CliRunner, in process) into one store that already holds data.

Properties, for every case: the exit code is 0 (imported) or 2 (refused, the
documented code); never an uncaught exception (the runner's exception is None or
SystemExit); a refusal names the file, stays short, and leaves every table's row count
and max rowid as they were; an import adds exactly the records it reports. At the end
the store passes `tidal ledger check` and `tidal trees --no-strict` reads it.

Budget: `TIDAL_FUZZ_EXAMPLES` cases per test (default 40); the cases are derandomized
unless `TIDAL_FUZZ_SEED` is set; each test appends its count of cases to
`TIDAL_FUZZ_COUNTS` when set (`tests.fuzzing.record_cases`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from click.testing import CliRunner
from hypothesis import strategies as st

from tests import fuzzing
from tidal.cli import app
from tidal.ledger import LedgerStore
from tidal.ledger.interchange import export_jsonl

from .helpers import fill, table_counts

DOOR = "jsonl"
runner = CliRunner()
CLI = typer.main.get_command(app)  # built once: typer's runner rebuilds it per call (~0.1 s)

# Raw JSON text put where a value goes (json.dumps cannot write most of these).
SPECIALS = [
    "1" * 5000, "-" + "9" * 400, str(10**30), str(-(10**30)), str(2**31), str(2**63), "-1",
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "-0.0", "1.5",
    '"\\ud800"', '"x\\udfff"', '"\\ud83d\\ude00"', '"\\u0000"', '""',
    "[" * 129 + "]" * 129, "[" * 1500 + "]" * 1500, "[" * 100_000 + "]" * 100_000,
    '{"a":' * 200 + "1" + "}" * 200, "null", "true", "false", "{}", "[]", '"call"', '"main"',
]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                               max_size=3),
    max_leaves=8,
)
KEYS = st.sampled_from([
    "type", "session_id", "call_id", "role", "task_id", "parent_call_id",
    "parent_session_id", "prompt_ids", "output_ids", "output_logprobs", "output_text",
    "raw_tool_calls", "tool_calls", "policy_version", "finish_reason", "started_at",
    "ended_at", "sampling", "metadata", "status", "reward", "partial_score", "details",
    "recorded_at", "extra", "Type", "",
]) | st.text(max_size=6)
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


class Raw:
    """A placeholder for raw JSON text in a record (see `encode`)."""

    def __init__(self, text: str) -> None:
        self.text = text


def encode(record: Any) -> bytes:
    """The record as one JSON line, each `Raw` replaced by its text."""
    raws: list[str] = []

    def walk(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    text = json.dumps(walk(record))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), raw, 1)
    return text.encode("utf-8", "surrogatepass")


def value(data: st.DataObject) -> Any:
    """A replacement value: raw specials, wrong types, surrogate strings."""
    kind = data.draw(st.sampled_from(["special", "json", "surrogate"]), label="value kind")
    if kind == "special":
        return Raw(data.draw(st.sampled_from(SPECIALS), label="special"))
    if kind == "surrogate":
        s = data.draw(st.text(max_size=4), label="text")
        i = data.draw(st.integers(0, len(s)), label="at")
        return s[:i] + data.draw(SURROGATE, label="surrogate") + s[i:]
    return data.draw(JSON, label="json")


def containers(v: Any) -> Iterator[dict[Any, Any] | list[Any]]:
    """Every dict and list inside `v` (itself included)."""
    if isinstance(v, dict | list):
        yield v
        for x in v.values() if isinstance(v, dict) else v:
            yield from containers(x)


def mutate(data: st.DataObject, rec: dict[str, Any]) -> None:
    """One structural change somewhere in a record."""
    op = data.draw(st.sampled_from(["drop", "add", "set", "deep-set"]), label="op")
    keys = sorted(rec)
    if op == "drop" and keys:
        del rec[data.draw(st.sampled_from(keys), label="drop key")]
    elif op == "add":
        key = data.draw(KEYS | SURROGATE, label="key")
        rec[key] = value(data)
    elif op == "set" and keys:
        rec[data.draw(st.sampled_from(keys), label="set key")] = value(data)
    else:  # inside a token list, a logprob list or a free-form object
        boxes = [c for k in keys if k != "type" for c in containers(rec[k])]
        if not boxes:
            return
        box = data.draw(st.sampled_from(boxes), label="container")
        if isinstance(box, list):
            i = data.draw(st.integers(0, len(box)), label="index")
            if i < len(box) and data.draw(st.booleans(), label="replace"):
                box[i] = value(data)
            else:
                box.insert(i, value(data))
        else:
            box[data.draw(KEYS | SURROGATE, label="inner key")] = value(data)


def mutate_lines(data: st.DataObject, lines: list[bytes]) -> None:
    """One change to the file's bytes."""
    op = data.draw(st.sampled_from(["truncate", "insert", "replace", "dup", "drop", "swap"]),
                   label="line op")
    if not lines:
        lines.append(data.draw(st.binary(max_size=40), label="bytes"))
        return
    i = data.draw(st.integers(0, len(lines) - 1), label="line")
    line = lines[i]
    if op == "truncate":
        lines[i] = line[: data.draw(st.integers(0, len(line)), label="cut")]
    elif op == "insert":
        at = data.draw(st.integers(0, len(line)), label="at")
        lines[i] = line[:at] + data.draw(st.binary(min_size=1, max_size=8), label="bytes") + \
            line[at:]
    elif op == "replace":
        lines[i] = data.draw(st.binary(max_size=60), label="bytes")
    elif op == "dup":
        lines.insert(i, line)
    elif op == "drop":
        del lines[i]
    else:
        j = data.draw(st.integers(0, len(lines) - 1), label="other line")
        lines[i], lines[j] = lines[j], line


class Fuzz:
    """One store that already holds data, the lines of its export, and the check that
    every import case runs through."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.store = tmp / "l.db"
        with LedgerStore(self.store) as s:
            fill(s)
            export_jsonl(s, tmp / "base.jsonl")
        self.base = [json.loads(ln) for ln in (tmp / "base.jsonl").read_text().splitlines()]
        self.fresh = itertools.count()
        self.imported = 0

    def records(self) -> list[dict[str, Any]]:
        """The export's records with fresh session ids, so that unmutated they import."""
        n = next(self.fresh)
        recs = json.loads(json.dumps(self.base))
        for r in recs:
            for k in ("session_id", "parent_session_id"):
                if r.get(k) is not None:
                    r[k] = f"f{n:07d}-{r[k]}"  # fixed width: same draws per case
        return recs

    def check(self, lines: list[bytes]) -> None:
        f = self.tmp / "case.jsonl"
        f.write_bytes(b"".join(ln + b"\n" for ln in lines))
        before = table_counts(self.store)
        res = runner.invoke(CLI, ["ledger", "import", str(f), "--store", str(self.store)])
        assert res.exception is None or isinstance(res.exception, SystemExit), (
            f"uncaught {res.exception!r}"
        )
        assert "Traceback" not in res.output
        after = table_counts(self.store)
        if res.exit_code == 2:
            assert after == before, f"a refused import changed the store: {res.output}"
            assert res.output.startswith("error: ") and str(f) in res.output, res.output
            assert len(res.output) < 1500, f"the message echoes too much: {res.output[:300]}"
            return
        assert res.exit_code == 0, res.output
        words = res.output.split()  # "imported N calls and M outcomes into STORE"
        calls, outcomes = int(words[1]), int(words[4])
        assert after["calls"][0] - before["calls"][0] == calls
        assert after["outcomes"][0] - before["outcomes"][0] == outcomes
        self.imported += 1

    def still_readable(self) -> None:
        res = runner.invoke(CLI, ["ledger", "check", str(self.store)])
        assert res.exit_code == 0, res.output
        res = runner.invoke(CLI, ["trees", str(self.store), "--json", "--no-strict"])
        assert res.exit_code == 0 and res.exception is None, res.output
        assert "main-1" in json.loads(res.stdout)


@pytest.fixture
def fuzz(tmp_path: Path) -> Fuzz:
    return Fuzz(tmp_path)


def run_cases(name: str, case: Callable[[st.DataObject], None]) -> None:
    fuzzing.run_cases(DOOR, name, case)


def test_mutated_export_lines(fuzz: Fuzz) -> None:
    def case(data: st.DataObject) -> None:
        recs = fuzz.records()
        for _ in range(data.draw(st.integers(0, 3), label="mutations")):
            mutate(data, data.draw(st.sampled_from(recs), label="record"))
        lines = [encode(r) for r in recs]
        for _ in range(data.draw(st.integers(0, 2), label="line mutations")):
            mutate_lines(data, lines)
        fuzz.check(lines)

    # the unmutated case first: the file imports (so the store really grows)
    fuzz.check([encode(r) for r in fuzz.records()])
    assert fuzz.imported == 1
    run_cases("test_mutated_export_lines", case)
    fuzz.still_readable()


def test_random_lines(fuzz: Fuzz) -> None:
    def case(data: st.DataObject) -> None:
        line = data.draw(st.one_of(
            st.binary(max_size=80).map(lambda b: b.replace(b"\n", b" ")),
            JSON.map(lambda v: json.dumps(v).encode()),
            st.fixed_dictionaries(
                {"type": st.sampled_from(["call", "outcome"])},
                optional=dict.fromkeys(("session_id", "call_id", "status", "reward",
                                        "prompt_ids", "output_ids", "output_logprobs"), JSON),
            ).map(lambda v: json.dumps(v).encode()),
            st.sampled_from(SPECIALS).map(str.encode),
        ), label="line")
        fuzz.check([*(encode(r) for r in fuzz.records()[:2]), line])

    run_cases("test_random_lines", case)
    fuzz.still_readable()
