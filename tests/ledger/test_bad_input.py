"""Bad input to the ledger's commands (issue 27): a clear message naming the file and line
(imports), the path (exports) or the option, never a traceback, and the store unchanged
after every refusal. Through the real `tidal` app (typer's CliRunner), real SQLite; the
read-only stores through real processes whose directory permissions bind, even as root."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import typer
from click.testing import CliRunner, Result

from tidal.cli import app
from tidal.ledger import LedgerStore, Outcome, Status

from .helpers import call_dict, fill, fingerprint

runner = CliRunner()
CLI = typer.main.get_command(app)  # the `tidal` command, built once


def tidal(*args: str | Path) -> Result:
    res = runner.invoke(CLI, [str(a) for a in args])
    # never a traceback: a refusal is a typer.Exit (SystemExit), success is None
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    return res


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "l.db"
    with LedgerStore(path) as s:
        fill(s)
    return path


def _jsonl(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n"
                              for ln in lines))
    return path


def _line(**over: Any) -> str:
    over = {"session_id": "new-1", "call_id": "c0", **over}
    return json.dumps(call_dict(**over))


# ----------------------------------------------------------------- item 2: orphan outcome

ORPHAN = '{"type":"outcome","session_id":"zz","status":"complete","reward":1,"partial_score":1}'


def test_import_refuses_an_outcome_for_a_session_with_no_calls(
    tmp_path: Path, store: Path
) -> None:
    before = fingerprint(store)
    f = _jsonl(tmp_path / "o.jsonl", _line(), ORPHAN)
    res = tidal("ledger", "import", f, "--store", store)
    assert res.exit_code == 2
    assert f"{f} line 2: outcome of session 'zz': the session has no calls" in res.output
    assert fingerprint(store) == before


def test_an_infra_error_outcome_without_calls_round_trips(tmp_path: Path, store: Path) -> None:
    """What a run records when an episode's sandbox fails before its first call: a
    store's own export must import back."""
    with LedgerStore(store) as s:
        s.append_outcome(Outcome("gone", Status.INFRA_ERROR, 0.0, 0.0, {"error": "sandbox"}))
    out = tmp_path / "x.jsonl"
    assert tidal("ledger", "export", store, "--jsonl", out).exit_code == 0
    res = tidal("ledger", "import", out, "--store", tmp_path / "copy.db")
    assert res.exit_code == 0, res.output
    assert "imported 5 calls and 3 outcomes" in res.output


def test_readers_tolerate_an_orphan_outcome_already_stored(tmp_path: Path, store: Path) -> None:
    with LedgerStore(store) as s:  # the lowest-level API, as an older import wrote it
        s.append_outcome(Outcome("zz", Status.COMPLETE, 1.0, 1.0))
    note = "outcome of session 'zz' (seq 3, complete) has no calls"
    res = tidal("ledger", "check", store)
    assert res.exit_code == 0 and note in res.stderr and "ok: 5 calls verified" in res.stdout
    for strict in ("--strict", "--no-strict"):
        res = tidal("trees", store, "--json", strict)
        assert res.exit_code == 0, res.output
        assert "skipped the outcome of session 'zz'" in res.stderr
        assert set(json.loads(res.stdout)) == {"main-1"}
    page = tmp_path / "p.html"
    res = tidal("inspect", store, "--session", "sub-1", "--html", page)
    assert res.exit_code == 0 and page.exists()
    res = tidal("inspect", store, "--session", "zz", "--html", tmp_path / "zz.html")
    assert res.exit_code == 2 and "session 'zz' has an outcome but no calls" in res.output
    assert not (tmp_path / "zz.html").exists()
    res = tidal("verify", store)
    assert res.exit_code == 0, res.output


# ------------------------------------------------- item 7: imports that used to crash

BAD_IMPORTS: list[tuple[str, list[str | bytes], str]] = [
    ("binary", [b"\x00\x95\xff\xfe binary \x81"], "line 1: not UTF-8 text (byte 0x95"),
    ("binary-2nd-line", [_line(), bytes(range(128, 256))], "line 2: not UTF-8 text"),
    ("token-id-1e30", [_line(output_ids=[4, 10**30])],
     "line 1: call 'c0' of session 'new-1': output_ids[1] = 1" + "0" * 30 + " is not a token id"),
    ("prompt-id-negative-huge", [_line(prompt_ids=[-(10**30)])], "prompt_ids[0] = -1000"),
    ("policy-version-huge", [_line(policy_version=10**30)], "policy_version must be a non-neg"),
    ("started-at-huge-int", [_line(started_at=10**400, ended_at=10**400)],
     "started_at must be a finite number (unix seconds), got an integer of"),
    ("reward-huge-int", ['{"type":"outcome","session_id":"main-1","status":"complete",'
                         '"reward":' + "9" * 400 + "}"], "reward must be a finite number"),
    ("int-over-4300-digits", [_line(policy_version=0).replace('"policy_version": 0',
                                                              '"policy_version": ' + "1" * 5000)],
     "line 1: not valid JSON (Exceeds the limit"),
    ("surrogate-output_text", [_line(output_text="ok \ud800")],
     "output_text holds a lone surrogate ('\\ud800' at character 3)"),
    ("surrogate-raw_tool_calls", [_line(raw_tool_calls="\udfff")],
     "raw_tool_calls holds a lone surrogate"),
    ("surrogate-metadata-value", [_line(metadata={"a": ["x", "\ud800"]})],
     "metadata['a'][1] holds a lone surrogate"),
    ("surrogate-metadata-key", [_line(metadata={"\ud800": 1})],
     "a key of metadata holds a lone surrogate"),
    ("surrogate-tool_calls", [_line(tool_calls=[{"function": {"name": "\ud83d"}}])],
     "tool_calls[0]['function']['name'] holds a lone surrogate"),
    ("surrogate-details", ['{"type":"outcome","session_id":"main-1","status":"complete",'
                           '"reward":1,"details":{"why":"\\ud800"}}'],
     "details['why'] holds a lone surrogate"),
    ("deep-100k", ["[" * 100_000 + "]" * 100_000], "line 1: JSON nested too deeply to parse"),
    ("deep-in-metadata", [_line()[:-1] + ', "metadata": {"x": ' + "[" * 100_000
                          + "]" * 100_000 + "}}"], "line 1: JSON nested too deeply"),
    ("deep-500-metadata", [_line(metadata={"x": json.loads("[" * 500 + "]" * 500)})],
     "metadata is nested more than 128 levels deep"),
    ("nan", [_line().replace('"output_logprobs": [-0.5, -0.25]',
                             '"output_logprobs": [-0.5, NaN]')],
     "line 1: not valid JSON (NaN is not a JSON number)"),
    ("infinity-in-metadata", [_line()[:-1] + ', "metadata": {"x": -Infinity}}'],
     "-Infinity is not a JSON number"),
    ("unknown-call-field", [_line(), _line(call_id="c1", temprature=0.7)],
     "line 2: call 'c1' of session 'new-1': unknown field(s) 'temprature'"),
    ("unknown-outcome-field", ['{"type":"outcome","session_id":"main-1","status":"complete",'
                               '"reward":1,"score":1}'], "unknown field(s) 'score'"),
    ("long-session-id", [_line(session_id="s" * 10_000)], "... (10002 characters)"),
]


@pytest.mark.parametrize(("lines", "message"), [b[1:] for b in BAD_IMPORTS],
                         ids=[b[0] for b in BAD_IMPORTS])
def test_import_refuses_bad_input_naming_file_and_line(
    tmp_path: Path, store: Path, lines: list[str | bytes], message: str
) -> None:
    before = fingerprint(store)
    f = _jsonl(tmp_path / "in.jsonl", *lines)
    res = tidal("ledger", "import", f, "--store", store)
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: {f} line "), res.output
    assert message in res.output
    assert len(res.output) < 600  # a 10k-character id is not echoed whole
    assert fingerprint(store) == before


def test_import_of_a_directory_or_missing_file(tmp_path: Path, store: Path) -> None:
    before = fingerprint(store)
    res = tidal("ledger", "import", tmp_path, "--store", store)
    assert res.exit_code == 2 and f"cannot read {tmp_path}: it is a directory" in res.output
    res = tidal("ledger", "import", tmp_path / "nope.jsonl", "--store", store)
    assert res.exit_code == 2 and "cannot read" in res.output and "nope.jsonl" in res.output
    assert fingerprint(store) == before


# --------------------------------------------- item 7: exports to a directory or nowhere

def test_export_to_a_directory_or_missing_dir(tmp_path: Path, store: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    res = tidal("ledger", "export", store, "--jsonl", out)
    assert res.exit_code == 2 and f"cannot write {out}: it is a directory" in res.output
    missing = tmp_path / "nope" / "x.jsonl"
    res = tidal("ledger", "export", store, "--jsonl", missing)
    assert res.exit_code == 2
    assert f"cannot write {missing}: directory {tmp_path / 'nope'} does not exist" in res.output
    res = tidal("ledger", "export", store, "--parquet", tmp_path / "nope" / "pq")
    assert res.exit_code == 2 and "does not exist" in res.output
    res = tidal("ledger", "export", store, "--parquet", store)  # a file, not a directory
    assert res.exit_code == 2 and f"cannot write into {store}: it is a file" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.db", "out"]  # no .partial
    assert list(out.iterdir()) == []


FULL_DISK = r"""
import resource, signal, sys
from tidal.ledger import LedgerError, LedgerStore
from tidal.ledger.interchange import export_jsonl
store = LedgerStore(sys.argv[1], readonly=True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))
try:
    export_jsonl(store, sys.argv[2])
except LedgerError as e:
    print(e)
"""


def test_export_leaves_no_partial_file_when_the_write_fails(tmp_path: Path, store: Path) -> None:
    """A write that fails midway (a file-size limit standing in for a full disk)."""
    target = tmp_path / "x.jsonl"
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(store), str(target)],
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"cannot write {target} (via x.jsonl.partial): File too large" in r.stdout
    assert not target.exists() and not (tmp_path / "x.jsonl.partial").exists()


def test_inspect_to_a_directory_or_missing_dir(tmp_path: Path, store: Path) -> None:
    res = tidal("inspect", store, "--session", "main-1", "--html", tmp_path)
    assert res.exit_code == 2 and f"cannot write {tmp_path}: it is a directory" in res.output
    page = tmp_path / "nope" / "p.html"
    res = tidal("inspect", store, "--session", "main-1", "--html", page)
    assert res.exit_code == 2 and f"directory {tmp_path / 'nope'} does not exist" in res.output
    assert not (tmp_path / "nope").exists()


# ------------------------------------------------------------------ item 9: options

def test_trees_refuses_a_negative_max_paths(store: Path) -> None:
    for flag in ("-j", "--max-paths"):
        res = tidal("trees", store, flag, "-1")
        assert res.exit_code == 2 and "'--max-paths' / '-j'" in res.output
    res = tidal("inspect", store, "--session", "main-1", "--html", "x.html", "-j", "-1")
    assert res.exit_code == 2 and "'--max-paths' / '-j'" in res.output


def test_trees_max_paths_zero_means_all(store: Path) -> None:
    """`-j 0` is documented as "all paths" (docs/trees.md), not zero paths."""
    all_paths = json.loads(tidal("trees", store, "--json", "-j", "0").stdout)["main-1"]
    one = json.loads(tidal("trees", store, "--json", "-j", "1").stdout)["main-1"]
    assert all_paths["sampled_paths"] == all_paths["leaves"] > one["sampled_paths"] == 1


# ------------------------------------------------------- item 10: store paths, corruption

def test_a_store_path_that_is_a_directory(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "in.jsonl", _line())
    for args in (("ledger", "check", tmp_path), ("ledger", "import", f, "--store", tmp_path),
                 ("ledger", "export", tmp_path, "--jsonl", tmp_path / "x.jsonl"),
                 ("ledger", "stats", tmp_path), ("trees", tmp_path), ("verify", tmp_path),
                 ("inspect", tmp_path, "--session", "s", "--html", tmp_path / "p.html")):
        res = tidal(*args)
        assert res.exit_code == 2, (args, res.output)
        assert f"{tmp_path} is a directory, not a ledger store" in res.output, args


def test_a_new_store_under_a_file(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "in.jsonl", _line())
    res = tidal("ledger", "import", f, "--store", f / "sub" / "l.db")
    assert res.exit_code == 2
    assert f"cannot create store {f / 'sub' / 'l.db'}" in res.output
    assert f"({f} is a file)" in res.output


def test_a_foreign_sqlite_file_is_refused_untouched(tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE notes (x)")
    db.commit()
    db.close()
    before = other.read_bytes()
    f = _jsonl(tmp_path / "in.jsonl", _line())
    res = tidal("ledger", "import", f, "--store", other)
    assert res.exit_code == 2 and "is not a readable tidal ledger store" in res.output
    assert other.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "other.db"]


@pytest.mark.parametrize("why", ["bad-line", "orphan", "dangling-parent"])
def test_a_refused_import_creates_no_store(tmp_path: Path, why: str) -> None:
    line = {"bad-line": _line(role=5), "orphan": ORPHAN,
            "dangling-parent": _line(parent_call_id="ghost")}[why]
    f = _jsonl(tmp_path / "in.jsonl", line)
    new = tmp_path / "a" / "b" / "new.db"
    res = tidal("ledger", "import", f, "--store", new)
    assert res.exit_code == 2, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no a/b/, no new.db


def test_export_of_a_corrupt_store_is_refused(tmp_path: Path, store: Path) -> None:
    db = sqlite3.connect(store)
    db.execute("DROP TRIGGER calls_no_update")
    db.execute("UPDATE calls SET output_ids = zeroblob(length(output_ids)) WHERE call_id='c1'")
    db.commit()
    db.close()
    out = tmp_path / "x.jsonl"
    res = tidal("ledger", "export", store, "--jsonl", out, "--parquet", tmp_path / "pq")
    assert res.exit_code == 1
    assert "CORRUPT call 'c1' of session 'main-1'" in res.output
    assert f"{store} is corrupt" in res.output and "nothing was exported" in res.output
    assert not out.exists() and not (tmp_path / "pq").exists()


# ------------------------------------------------------ item 5: read-only stores

READ_ALL = r"""
import json, sys
from typer.testing import CliRunner
from tidal.cli import app
store, out, jsonl = sys.argv[1:4]
runs = {
    "check": ["ledger", "check", store],
    "stats": ["ledger", "stats", store, "--json"],
    "export": ["ledger", "export", store, "--jsonl", f"{out}/x.jsonl"],
    "trees": ["trees", store, "--json"],
    "inspect": ["inspect", store, "--session", "main-1", "--html", f"{out}/p.html"],
    "verify": ["verify", store],
    "import": ["ledger", "import", jsonl, "--store", store],
    "import-new": ["ledger", "import", jsonl, "--store", store + ".new"],
}
res = {}
for name, args in runs.items():
    r = CliRunner().invoke(app, args)
    res[name] = [r.exit_code, r.output, repr(r.exception)]
print(json.dumps(res))
"""


def _bwrap_ok() -> bool:
    if shutil.which("bwrap") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        probe = ["bwrap", "--dev-bind", "/", "/", "--ro-bind", d, d, "touch", f"{d}/x"]
        r = subprocess.run(probe, capture_output=True, check=False)
        return r.returncode != 0 and b"Read-only" in r.stderr


def _as_nobody() -> list[str] | None:
    """argv prefix running a command where a 0555 directory cannot be written: as is for a
    normal user; as `nobody` (setpriv) for root, who ignores permission bits."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    r = subprocess.run([*prefix, sys.executable, "-c", "import tidal.cli"],
                       capture_output=True, check=False)
    return prefix if r.returncode == 0 else None


@pytest.fixture
def shared_dirs() -> Iterator[tuple[Path, Path]]:
    """A store dir and an output dir that an unprivileged user can reach (pytest's
    tmp_path is private to its owner)."""
    top = Path(tempfile.mkdtemp(prefix="tidal-ro-"))
    try:
        top.chmod(0o755)
        (top / "ro").mkdir()
        (top / "out").mkdir()
        (top / "out").chmod(0o777)
        yield top / "ro", top / "out"
    finally:
        (top / "ro").chmod(0o755)
        shutil.rmtree(top)


def _read_all(prefix: list[str], store: Path, out: Path) -> dict[str, list[Any]]:
    jsonl = out / "in.jsonl"
    _jsonl(jsonl, _line())
    jsonl.chmod(0o644)
    r = subprocess.run([*prefix, sys.executable, "-c", READ_ALL, str(store), str(out),
                        str(jsonl)], capture_output=True, text=True, check=False, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def _assert_read_only_ok(res: dict[str, list[Any]], store: Path, out: Path) -> None:
    for name in ("check", "stats", "export", "trees", "inspect", "verify"):
        code, output, exc = res[name]
        assert code == 0, (name, output, exc)
    assert "ok: 5 calls verified" in res["check"][1]
    assert json.loads(res["stats"][1])["calls"] == 5
    assert (out / "x.jsonl").read_text().count("\n") == 7 and (out / "p.html").exists()
    code, output, _ = res["import"]
    assert code == 2 and f"cannot write to {store}" in output
    assert "needs write access to the file and to its directory" in output
    code, output, _ = res["import-new"]
    assert code == 2 and f"cannot create store {store}.new: directory" in output
    assert "is not writable" in output


def test_read_commands_read_a_store_on_a_read_only_mount(
    shared_dirs: tuple[Path, Path]
) -> None:
    """A read-only mount binds root too: SQLite cannot create the WAL index (-shm)."""
    if not _bwrap_ok():
        pytest.skip("needs bubblewrap able to make a read-only bind mount")
    ro, out = shared_dirs
    store = ro / "l.db"
    with LedgerStore(store) as s:
        fill(s)
    before = store.read_bytes()
    prefix = ["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(ro), str(ro)]
    _assert_read_only_ok(_read_all(prefix, store, out), store, out)
    assert sorted(p.name for p in ro.iterdir()) == ["l.db"]  # no -wal, no -shm
    assert store.read_bytes() == before


def test_read_commands_read_a_store_in_a_read_only_directory(
    shared_dirs: tuple[Path, Path]
) -> None:
    """A 0555 directory holding a 0444 store, read by a user who may not write either."""
    prefix = _as_nobody()
    if prefix is None:
        pytest.skip("running as root without setpriv: permissions cannot bind")
    ro, out = shared_dirs
    store = ro / "l.db"
    with LedgerStore(store) as s:
        fill(s)
    before = store.read_bytes()
    store.chmod(0o444)
    ro.chmod(0o555)
    _assert_read_only_ok(_read_all(prefix, store, out), store, out)
    assert sorted(p.name for p in ro.iterdir()) == ["l.db"]  # no -wal, no -shm
    assert store.read_bytes() == before


def test_a_read_only_store_whose_wal_holds_records(shared_dirs: tuple[Path, Path]) -> None:
    """With -wal and -shm beside it, a read-only mount reads every committed record; with
    -wal alone (no -shm, none can be made) the message says what reading needs, rather
    than an immutable read that would miss the WAL's records."""
    if not _bwrap_ok():
        pytest.skip("needs bubblewrap able to make a read-only bind mount")
    ro, out = shared_dirs
    live = out / "live.db"
    with LedgerStore(live) as s:  # open: its newest records are still in live.db-wal
        fill(s)
        s._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        s.append_outcome(Outcome("main-2", Status.INFRA_ERROR, 0.0))
        assert Path(f"{live}-wal").stat().st_size > 0
        for suffix in ("", "-wal", "-shm"):
            shutil.copy(f"{live}{suffix}", f"{ro}/l.db{suffix}")
    prefix = ["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(ro), str(ro)]
    cmd = [*prefix, sys.executable, "-m", "tidal.cli", "ledger", "stats", f"{ro}/l.db", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["outcomes"] == 3  # the one only in the WAL included
    Path(f"{ro}/l.db-shm").unlink()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "its write-ahead log l.db-wal holds records" in r.stderr
    assert "l.db-shm, which cannot be created in" in r.stderr


def test_code_built_calls_get_the_same_refusals(store: Path) -> None:
    """The gateway's path (`append_call`, `validate_call`): a lone surrogate or a deep
    metadata object is a `LedgerError` naming the field, not a UnicodeEncodeError from
    deep in the store, and nothing is written."""
    from tidal.ledger import LedgerError

    from .helpers import mk_call

    before = fingerprint(store)
    good = mk_call("new-1", "c0")
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(200):
        node["d"] = node = {}
    cases = [
        (replace(good, output_text="\ud800"), "output_text holds a lone surrogate"),
        (replace(good, metadata={"turn": {"content": "\udc80"}}),
         r"metadata\['turn'\]\['content'\] holds a lone surrogate"),
        (replace(good, metadata=deep), "metadata is nested more than 128 levels deep"),
        (replace(good, policy_version=2**64), "policy_version must be a non-negative integer"),
    ]
    with LedgerStore(store) as s:
        for call, message in cases:
            with pytest.raises(LedgerError, match=message):
                s.append_call(call)
    assert fingerprint(store) == before
