"""Merges what bench/gpu_check.sh's sections left in its work folder into one JSON.

Each section NAME leaves `NAME.status.json` (written by the shell: status, exit code,
seconds, its time limit, the end of its stderr), its stdout (`NAME.stdout`) and, for
benches that keep their own file, `NAME.json`. A section's result is `NAME.json` when
it exists, else `NAME.partial.json` (what a killed bench had kept), else the last JSON
object its stdout printed, else the `{"partial": ...}` lines it had printed on stderr.
pytest's JUnit XML becomes one row per test (passed / failed / error / skipped, seconds,
message). Runs in well under a second and imports no torch, so the shell calls it after
every section: a run killed at any point still leaves everything measured until then.

    python3 bench/gpu_merge.py WORK_DIR OUT_JSON [--junit FILE]
"""

from __future__ import annotations

import argparse
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def last_json(text: str) -> Any:
    """The last top-level JSON object printed in `text` (pretty-printed or on one line)."""
    text = text.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    starts = [i for i, ch in enumerate(text) if ch == "{" and (i == 0 or text[i - 1] == "\n")]
    for i in reversed(starts):
        try:
            return json.loads(text[i:])
        except json.JSONDecodeError:
            continue
    return None


def partials(text: str) -> list[Any]:
    rows = []
    for line in text.splitlines():
        if line.startswith('{"partial"'):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def junit(path: Path) -> dict[str, Any]:
    """Per-test outcomes of a JUnit XML file, and their counts."""
    root = ET.parse(path).getroot()
    tests, modules_skipped = [], []
    for case in root.iter("testcase"):
        if not case.get("classname") and case.find("skipped") is not None:
            modules_skipped.append(case.get("name"))  # a module skipped whole (no ray, ...)
            continue
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:600]
                if tag != "skipped" and el.text:
                    message = (message + "\n" + el.text[-2500:]).strip()
                break
        tests.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0), 2), "message": message})
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"counts": counts, "tests": tests, "modules_skipped": modules_skipped}


def merge(work: Path, junit_path: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {"schema": 1, "merged_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "sections": {}, "results": {}}
    meta = work / "meta.json"
    if meta.exists():
        out.update(json.loads(meta.read_text()))
    for status in sorted(work.glob("*.status.json"), key=lambda p: p.stat().st_mtime):
        name = status.name.removesuffix(".status.json")
        try:
            out["sections"][name] = json.loads(status.read_text())
        except json.JSONDecodeError:
            out["sections"][name] = {"status": "unreadable"}
        result = None
        own = work / f"{name}.json"
        if own.exists():
            try:
                result = json.loads(own.read_text())
            except json.JSONDecodeError:
                result = None
        if result is None and (work / f"{name}.partial.json").exists():
            try:
                result = json.loads((work / f"{name}.partial.json").read_text())
            except json.JSONDecodeError:
                result = None
        if result is None and (work / f"{name}.stdout").exists():
            result = last_json((work / f"{name}.stdout").read_text(errors="replace"))
        if result is None and (work / f"{name}.stderr").exists():
            rows = partials((work / f"{name}.stderr").read_text(errors="replace"))
            if rows:
                result = {"partial": rows}
        if result is not None:
            out["results"][name] = result
    if junit_path is not None and junit_path.exists():
        try:
            out["results"]["pytest"] = {**out["results"].get("pytest", {}), **junit(junit_path)}
        except ET.ParseError as e:
            out["results"]["pytest"] = {"error": f"junit unreadable: {e}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--junit", type=Path, default=None)
    args = ap.parse_args()
    merged = merge(args.work, args.junit)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1, default=str))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
