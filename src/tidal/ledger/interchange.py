"""JSON Lines and Parquet interchange for the ledger (format: docs/ledger.md).

- `import_jsonl` is all-or-nothing per file: every line is parsed and validated first,
  then all records go into the store in one transaction. A bad line is refused with its
  line number and reason, and the store is left unchanged.
- `export_jsonl` writes full prompts (not deltas), session by session in commit order, so
  a parent call always precedes the calls that reference it: `import(export(x)) == x`.
- `export_parquet` writes `calls.parquet` and `outcomes.parquet` with the same fields, for
  analytics tools; it is an export only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.ledger.store import LedgerStore
from tidal.ledger.types import (
    Call,
    LedgerError,
    Outcome,
    call_to_dict,
    make_call,
    make_outcome,
    outcome_to_dict,
)


@dataclass(frozen=True)
class ImportReport:
    calls: int
    outcomes: int


def parse_jsonl(path: Path) -> tuple[list[Call], list[Outcome]]:
    """Parse and validate every line; raise `LedgerError` naming the first bad line."""
    calls: list[Call] = []
    outcomes: list[Outcome] = []
    seen_calls: set[tuple[str, str]] = set()
    seen_outcomes: set[str] = set()
    try:
        fh = path.open(encoding="utf-8")
    except OSError as e:
        raise LedgerError(f"cannot read {path}: {e.strerror}") from e
    with fh:
        for lineno, line in enumerate(fh, start=1):
            where = f"{path} line {lineno}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise LedgerError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(obj, dict):
                raise LedgerError(f"{where}: each line must be a JSON object")
            kind = obj.get("type")
            try:
                if kind == "call":
                    call = make_call(obj)
                    key = (call.session_id, call.call_id)
                    if key in seen_calls:
                        raise LedgerError(f"call {call.call_id!r} of session "
                                          f"{call.session_id!r} appears twice in the file")
                    seen_calls.add(key)
                    calls.append(call)
                elif kind == "outcome":
                    outcome = make_outcome(obj)
                    if outcome.session_id in seen_outcomes:
                        raise LedgerError(f"session {outcome.session_id!r} has two outcomes")
                    seen_outcomes.add(outcome.session_id)
                    outcomes.append(outcome)
                else:
                    raise LedgerError(f'"type" must be "call" or "outcome", got {kind!r}')
            except LedgerError as e:
                raise LedgerError(f"{where}: {e}") from None
    return calls, outcomes


def import_jsonl(path: str | Path, store: LedgerStore) -> ImportReport:
    """Import a JSONL file into `store`: every record or none."""
    path = Path(path)
    calls, outcomes = parse_jsonl(path)
    try:
        store.append_records(calls, outcomes)
    except LedgerError as e:
        raise LedgerError(f"{path}: {e} (nothing was imported)") from None
    return ImportReport(calls=len(calls), outcomes=len(outcomes))


def iter_records(store: LedgerStore) -> Iterator[dict[str, Any]]:
    """Every call (full prompt) then every outcome, as JSONL-contract dicts."""
    for call in store.iter_full_calls():
        yield call_to_dict(call)
    for outcome in store.outcomes().values():
        yield outcome_to_dict(outcome)


def export_jsonl(store: LedgerStore, path: str | Path) -> int:
    """Write the whole store as JSONL; returns the number of lines written."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    n = 0
    with tmp.open("w", encoding="utf-8") as fh:
        for rec in iter_records(store):
            fh.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")))
            fh.write("\n")
            n += 1
    tmp.replace(path)
    return n


def export_parquet(store: LedgerStore, directory: str | Path) -> dict[str, int]:
    """Write calls.parquet and outcomes.parquet into `directory`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[Any]] = {}
    json_cols = ("tool_calls", "sampling", "metadata")
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
        ]
    )
    table = pa.table({f.name: rows.get(f.name, []) for f in schema}, schema=schema)
    pq.write_table(table, directory / "calls.parquet")
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
    pq.write_table(otable, directory / "outcomes.parquet")
    return {"calls": table.num_rows, "outcomes": otable.num_rows}
