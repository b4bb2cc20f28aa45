"""JSON Lines and Parquet interchange for the ledger (format: docs/ledger.md).

- `import_jsonl` is all-or-nothing per file: every line is parsed and validated first,
  then all records go into the store in one transaction. A bad line is refused with its
  line number and reason, and the store is left unchanged. The format is strict: bytes
  that are not UTF-8, NaN/Infinity, fields the format does not have, and an outcome for
  a session with no calls (except `infra_error`, what a run records for an episode that
  failed before its first call) are refused too.
- `export_jsonl` writes full prompts (not deltas), session by session in commit order, so
  a parent call always precedes the calls that reference it: `import(export(x)) == x`.
  The file appears whole or not at all.
- `export_parquet` writes `calls.parquet` and `outcomes.parquet` with the same fields, for
  analytics tools; it is an export only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tidal.ledger.store import LedgerStore
from tidal.ledger.types import (
    MAX_DEPTH,
    Call,
    LedgerError,
    Outcome,
    Status,
    call_to_dict,
    make_call,
    make_outcome,
    outcome_to_dict,
    short_repr,
)


@dataclass(frozen=True)
class ImportReport:
    calls: int
    outcomes: int


@dataclass(frozen=True)
class JsonlRecords:
    """A parsed, validated JSONL file: its calls and outcomes in file order, and the line
    of each outcome (for messages about it once the store is known)."""

    path: Path
    calls: list[Call]
    outcomes: list[Outcome]
    outcome_lines: list[int]


CALL_FIELDS = frozenset(f.name for f in fields(Call)) | {"type"}
OUTCOME_FIELDS = frozenset(f.name for f in fields(Outcome)) | {"type"}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_line(raw: bytes, where: str) -> Any:
    """One line's JSON value; `LedgerError` for bytes that are not UTF-8, text that is not
    JSON (NaN and Infinity included: Python's extension, not JSON), or nesting too deep
    for the parser."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LedgerError(
            f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1}); "
            "a JSONL file is UTF-8 text"
        ) from None
    try:
        return json.loads(line, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise LedgerError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise LedgerError(
            f"{where}: JSON nested too deeply to parse (a record nests at most {MAX_DEPTH} "
            "levels)"
        ) from None
    except ValueError as e:  # NaN/Infinity, an integer of more than 4300 digits
        raise LedgerError(f"{where}: not valid JSON ({e})") from None


def _unknown_fields(obj: dict[str, Any], known: frozenset[str], record: str) -> None:
    extra = [k for k in obj if k not in known]
    if extra:
        names = ", ".join(short_repr(k, 40) for k in extra)
        raise LedgerError(
            f"{record}: unknown field(s) {names}; the JSONL format has no such field "
            "(docs/ledger.md lists them: keep extra data under \"metadata\")"
        )


def parse_jsonl(path: Path) -> JsonlRecords:
    """Parse and validate every line; raise `LedgerError` naming the first bad line."""
    calls: list[Call] = []
    outcomes: list[Outcome] = []
    outcome_lines: list[int] = []
    seen_calls: set[tuple[str, str]] = set()
    seen_outcomes: set[str] = set()
    if path.is_dir():
        raise LedgerError(f"cannot read {path}: it is a directory, not a JSONL file")
    try:
        fh = path.open("rb")
    except OSError as e:
        raise LedgerError(f"cannot read {path}: {e.strerror}") from e
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path} line {lineno}"
            if not raw.strip():
                continue
            obj = _json_line(raw, where)
            if not isinstance(obj, dict):
                raise LedgerError(f"{where}: each line must be a JSON object")
            kind = obj.get("type")
            try:
                if kind == "call":
                    call = make_call(obj)
                    _unknown_fields(obj, CALL_FIELDS, f"call {call.call_id!r} of session "
                                                     f"{call.session_id!r}")
                    key = (call.session_id, call.call_id)
                    if key in seen_calls:
                        raise LedgerError(f"call {call.call_id!r} of session "
                                          f"{call.session_id!r} appears twice in the file")
                    seen_calls.add(key)
                    calls.append(call)
                elif kind == "outcome":
                    outcome = make_outcome(obj)
                    _unknown_fields(obj, OUTCOME_FIELDS,
                                    f"outcome of session {outcome.session_id!r}")
                    if outcome.session_id in seen_outcomes:
                        raise LedgerError(f"session {outcome.session_id!r} has two outcomes")
                    seen_outcomes.add(outcome.session_id)
                    outcomes.append(outcome)
                    outcome_lines.append(lineno)
                else:
                    raise LedgerError(
                        f'"type" must be "call" or "outcome", got {short_repr(kind)}'
                    )
            except LedgerError as e:
                raise LedgerError(f"{where}: {e}") from None
    return JsonlRecords(path, calls, outcomes, outcome_lines)


def check_orphans(records: JsonlRecords, store: LedgerStore) -> None:
    """Refuse an outcome for a session with no calls, in the file or the store: readers
    would have nothing to pair it with. Only `infra_error` may close such a session: it
    is what a run records when an episode's sandbox fails before its first call, so a
    store's own export imports back."""
    with_calls = {c.session_id for c in records.calls}
    for o, lineno in zip(records.outcomes, records.outcome_lines, strict=True):
        if (
            o.status is not Status.INFRA_ERROR
            and o.session_id not in with_calls
            and not store.has_session(o.session_id)
        ):
            raise LedgerError(
                f"{records.path} line {lineno}: outcome of session {o.session_id!r}: the "
                "session has no calls, neither in the file nor in the store (an outcome "
                f"follows its session's calls; only {Status.INFRA_ERROR.value!r} may close a "
                "session that never called)"
            )


def import_records(records: JsonlRecords, store: LedgerStore) -> ImportReport:
    """Append parsed records to `store` in one transaction: every record or none."""
    check_orphans(records, store)
    try:
        store.append_records(records.calls, records.outcomes)
    except LedgerError as e:
        raise LedgerError(f"{records.path}: {e} (nothing was imported)") from None
    return ImportReport(calls=len(records.calls), outcomes=len(records.outcomes))


def import_jsonl(path: str | Path, store: LedgerStore) -> ImportReport:
    """Import a JSONL file into `store`: every record or none."""
    return import_records(parse_jsonl(Path(path)), store)


def iter_records(store: LedgerStore) -> Iterator[dict[str, Any]]:
    """Every call (full prompt) then every outcome, as JSONL-contract dicts."""
    for call in store.iter_full_calls():
        yield call_to_dict(call)
    for outcome in store.outcomes().values():
        yield outcome_to_dict(outcome)


def writable_target(path: Path, *, directory: bool = False) -> None:
    """Refuse an output path that cannot be written before any work is done: a directory
    where a file is wanted (or a file where a directory is), or a missing parent."""
    if not directory and path.is_dir():
        raise LedgerError(f"cannot write {path}: it is a directory (give a file path)")
    if directory and path.exists() and not path.is_dir():
        raise LedgerError(f"cannot write into {path}: it is a file, not a directory")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise LedgerError(f"cannot write {path}: directory {parent} does not exist")


def export_jsonl(store: LedgerStore, path: str | Path) -> int:
    """Write the whole store as JSONL; returns the number of lines written. The file
    appears whole or not at all (written as `PATH.partial`, then renamed)."""
    path = Path(path)
    writable_target(path)
    tmp = path.with_name(path.name + ".partial")
    n = 0
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            for rec in iter_records(store):
                fh.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")))
                fh.write("\n")
                n += 1
        tmp.replace(path)
    except OSError as e:
        raise LedgerError(f"cannot write {path} (via {tmp.name}): {e.strerror or e}") from e
    finally:
        if not tmp.is_dir():
            tmp.unlink(missing_ok=True)
    return n


def export_parquet(store: LedgerStore, directory: str | Path) -> dict[str, int]:
    """Write calls.parquet and outcomes.parquet into `directory`."""
    import pyarrow as pa

    directory = Path(directory)
    writable_target(directory, directory=True)
    try:
        directory.mkdir(exist_ok=True)
    except OSError as e:
        raise LedgerError(f"cannot create {directory}: {e.strerror}") from e
    rows: dict[str, list[Any]] = {}
    json_cols = ("tool_calls", "sampling", "metadata", "messages", "tools")
    for call in store.iter_full_calls():
        d = call_to_dict(call)
        d.pop("type")
        for k in json_cols:  # free-form objects as JSON text: Parquet needs fixed schemas
            d[k] = None if d[k] is None else json.dumps(d[k], sort_keys=True)
        for k, v in d.items():
            rows.setdefault(k, []).append(v)
    schema = pa.schema(
        [
            ("session_id", pa.string()), ("call_id", pa.string()), ("role", pa.string()),
            ("task_id", pa.string()), ("parent_call_id", pa.string()),
            ("parent_session_id", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
            ("output_ids", pa.list_(pa.int32())), ("output_logprobs", pa.list_(pa.float32())),
            ("output_text", pa.string()), ("raw_tool_calls", pa.string()),
            ("tool_calls", pa.string()), ("policy_version", pa.int64()),
            ("finish_reason", pa.string()), ("started_at", pa.float64()),
            ("ended_at", pa.float64()), ("sampling", pa.string()), ("metadata", pa.string()),
            ("messages", pa.string()), ("tools", pa.string()),
        ]
    )
    table = pa.table({f.name: rows.get(f.name, []) for f in schema}, schema=schema)
    _write_parquet(table, directory / "calls.parquet")
    outs = [outcome_to_dict(o) for o in store.outcomes().values()]
    otable = pa.table(
        {
            "session_id": [o["session_id"] for o in outs],
            "status": [o["status"] for o in outs],
            "reward": pa.array([o["reward"] for o in outs], pa.float64()),
            "partial_score": pa.array([o["partial_score"] for o in outs], pa.float64()),
            "details": [json.dumps(o["details"], sort_keys=True) for o in outs],
            "recorded_at": pa.array([o["recorded_at"] for o in outs], pa.float64()),
        }
    )
    _write_parquet(otable, directory / "outcomes.parquet")
    return {"calls": table.num_rows, "outcomes": otable.num_rows}


def _write_parquet(table: Any, path: Path) -> None:
    import pyarrow.parquet as pq

    try:
        pq.write_table(table, path)
    except OSError as e:
        raise LedgerError(f"cannot write {path}: {e}") from e
