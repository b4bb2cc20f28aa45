"""Harbor's Agent Trajectory Interchange Format (ATIF v1.8) from the ledger.

`tidal ledger export --atif DIR` writes one trajectory file per episode: a root session
(one with no parent session) as `DIR/<session>.json`. What the ledger holds maps so:

- a call's request (`Call.messages`, stored as deltas) gives the input steps: a system
  message a `system` step, a user message a `user` step, and each tool result an
  observation result on the agent step that made the call (`source_call_id`). The
  assistant message a client sends back is the previous call's output, already a step.
- each call is one `agent` step: its content (the text shown to the client), its parsed
  tool calls, and in `metrics` the prompt and completion token ids and the completion's
  logprobs, exactly as sampled. `extra` holds the call's ledger fields that ATIF has no
  place for: always its id, role, policy version, finish reason, raw tool-call text and
  start and end times (unix seconds); where set, its task, parent call and session,
  sampling parameters and metadata; and where ATIF's own fields do not give them back,
  its output text (`message` is the content shown), its tool calls as recorded, its
  tools (the trajectory's `tool_definitions` are its first call's) and
  `messages_recorded: false`. So `tidal ledger import --atif` (`atif_import.py`) gives
  back the calls exactly, their request messages rebuilt from the steps.
- a session whose history was rewritten (a compaction: a call whose request does not
  extend the previous call's) continues in another file, `<session>.cont-<k>.json`,
  named by `continued_trajectory_ref`; messages the new context repeats from the last
  one are steps with `is_copied_context`.
- a subagent's session is embedded in `subagent_trajectories` (its `trajectory_id` is the
  session id) of the segment that holds the call that spawned it, and that agent step's
  observation names it (`subagent_trajectory_ref`).
- the outcome (reward, status, partial score, task, details, time recorded) is in the
  root's `extra`, a subagent's in its own.

Calls recorded before the ledger kept requests (or on the completions endpoint) have no
messages: their trajectories hold the agent steps only, and `notes` says so. Pure: reads
`CallLog`s and outcomes, returns dicts; `write_atif` writes the files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tidal import __version__
from tidal.ledger.store import CallLog, LedgerStore
from tidal.ledger.types import Call, LedgerError, Outcome

SCHEMA = "ATIF-v1.8"


@dataclass
class _Segment:
    """One trajectory document under construction: a session's calls between rewrites."""

    session_id: str
    index: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    subagents: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    reason: str | None = None  # why this segment began (None: the session's first)
    missing_messages: int = 0
    seen: list[Mapping[str, Any]] = field(default_factory=list)  # the last request's
    agent_steps: dict[str, dict[str, Any]] = field(default_factory=dict)  # by tool-call id
    by_call: dict[str, dict[str, Any]] = field(default_factory=dict)  # agent step by call
    call_tools: list[tuple[dict[str, Any], list[dict[str, Any]] | None]] = field(
        default_factory=list)  # (agent step, its call's tools) of the calls with messages

    @property
    def file_name(self) -> str:
        return f"{self.session_id}.json" if self.index == 0 else \
            f"{self.session_id}.cont-{self.index}.json"


def _time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _arguments(text: Any) -> dict[str, Any]:
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        value = None
    return dict(value) if isinstance(value, dict) else {"_raw": text}


def arguments_text(arguments: Mapping[str, Any]) -> str:
    """An ATIF tool call's arguments as the JSON text a model writes (`{"_raw": text}`,
    what the export makes of text that is not a JSON object, gives the text back)."""
    raw = arguments.get("_raw") if len(arguments) == 1 else None
    return raw if isinstance(raw, str) else json.dumps(arguments, ensure_ascii=False)


def recorded_tool_call(tool_call_id: str, name: str, arguments: Mapping[str, Any],
                       ) -> dict[str, Any]:
    """An ATIF tool call in the form the gateway records a call's tool calls: what the
    import gives a call whose step's `extra` holds no `tool_calls`."""
    return {"id": tool_call_id, "name": name, "arguments": arguments_text(arguments)}


def _content(message: Mapping[str, Any]) -> str:
    c = message.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    return json.dumps(c, ensure_ascii=False)  # content parts: kept as their JSON


def _agent_step(call: Call) -> dict[str, Any]:
    turn = call.metadata.get("turn") if isinstance(call.metadata.get("turn"), dict) else {}
    content = turn.get("content", call.output_text) if turn else call.output_text
    step: dict[str, Any] = {
        "source": "agent", "timestamp": _time(call.started_at),
        "message": content or "", "llm_call_count": 1,
        "metrics": {
            "prompt_tokens": int(call.prompt_ids.shape[0]),
            "completion_tokens": int(call.output_ids.shape[0]),
            "prompt_token_ids": call.prompt_ids.tolist(),
            "completion_token_ids": call.output_ids.tolist(),
            "logprobs": [float(x) for x in call.output_logprobs.tolist()],
        },
    }
    if call.tool_calls:
        step["tool_calls"] = [
            {"tool_call_id": str(t.get("id") or f"{call.call_id}-{i}"),
             "function_name": str(t.get("name") or t.get("function", {}).get("name", "")),
             "arguments": _arguments(t.get("arguments", t.get("function", {}).get(
                 "arguments", {})))}
            for i, t in enumerate(call.tool_calls)]
    step["extra"] = _call_extra(call, step)
    return step


def _call_extra(call: Call, step: Mapping[str, Any]) -> dict[str, Any]:
    """The call's ledger fields that the agent step does not carry (the module doc)."""
    extra: dict[str, Any] = {
        "call_id": call.call_id, "role": call.role, "policy_version": call.policy_version,
        "finish_reason": call.finish_reason, "raw_tool_calls": call.raw_tool_calls,
        "started_at": call.started_at, "ended_at": call.ended_at}
    for name, value in (("task_id", call.task_id), ("parent_call_id", call.parent_call_id),
                        ("parent_session_id", call.parent_session_id),
                        ("sampling", call.sampling), ("metadata", call.metadata)):
        if value:
            extra[name] = value
    if step["message"] != call.output_text:
        extra["output_text"] = call.output_text
    rebuilt = [recorded_tool_call(t["tool_call_id"], t["function_name"], t["arguments"])
               for t in step.get("tool_calls", ())]
    if (rebuilt or None) != call.tool_calls:
        extra["tool_calls"] = call.tool_calls
    if call.messages is None:
        extra["messages_recorded"] = False
    return extra


def _history_step(message: Mapping[str, Any], copied: bool) -> dict[str, Any]:
    role = message.get("role")
    step: dict[str, Any] = {"source": "system" if role in ("system", "developer") else
                            "agent" if role == "assistant" else "user",
                            "message": _content(message)}
    if role == "assistant":
        calls = message.get("tool_calls") or []
        if calls:
            step["tool_calls"] = [
                {"tool_call_id": str(c.get("id") or f"history-{i}"),
                 "function_name": str(c.get("function", {}).get("name", "")),
                 "arguments": _arguments(c.get("function", {}).get("arguments", {}))}
                for i, c in enumerate(calls)]
        step["llm_call_count"] = 0  # a turn the client sent, not sampled here
    if role not in ("system", "developer", "user", "assistant"):
        step["extra"] = {"role": role}
    if copied:
        step["is_copied_context"] = True
    return step


def _observe(seg: _Segment, message: Mapping[str, Any], copied: bool) -> None:
    """A tool result: an observation on the agent step that made the call, else (no such
    step in this segment) a user step that says what it is."""
    call_id = message.get("tool_call_id")
    owner = seg.agent_steps.get(str(call_id)) if call_id is not None else None
    if owner is None:
        step = _history_step(message, copied)
        step["extra"] = {"role": "tool", "tool_call_id": call_id}
        seg.steps.append(step)
        return
    owner.setdefault("observation", {"results": []})["results"].append(
        {"source_call_id": str(call_id), "content": _content(message)})


def _add_input(seg: _Segment, messages: Sequence[Mapping[str, Any]],
               copied_from: Sequence[Mapping[str, Any]]) -> None:
    for m in messages:
        copied = any(m == c for c in copied_from)
        if m.get("role") == "tool":
            _observe(seg, m, copied)
            continue
        step = _history_step(m, copied)
        seg.steps.append(step)
        for tc in step.get("tool_calls", ()):
            seg.agent_steps[tc["tool_call_id"]] = step


def _extends(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> bool:
    return len(new) >= len(old) and all(a == b for a, b in zip(old, new, strict=False))


def session_segments(log: CallLog) -> list[_Segment]:
    """The session's calls as trajectory segments (a new one at each rewritten history)."""
    segments: list[_Segment] = []
    seg: _Segment | None = None
    for sc in log.calls:
        call = log.full_call(sc.call_id)
        msgs = call.messages
        if seg is None or (msgs is not None and seg.seen and not _extends(seg.seen, msgs)):
            reason = None
            if seg is not None:
                declared = call.parent_call_id is not None and call.parent_call_id in log
                reason = (f"a fresh context from call {call.parent_call_id}" if declared
                          else "the history was rewritten (a compaction)")
            before = seg.seen if seg is not None else []
            seg = _Segment(log.session_id, len(segments), reason=reason)
            segments.append(seg)
            if msgs is not None:
                _add_input(seg, msgs, before)
        elif msgs is not None:
            new = list(msgs[len(seg.seen):])
            if new and new[0].get("role") == "assistant" and seg.steps:
                new = new[1:]  # the previous call's output, sent back: already a step
            _add_input(seg, new, ())
        if msgs is None:
            seg.missing_messages += 1
        if seg.tools is None and call.tools:
            seg.tools = call.tools
        step = _agent_step(call)
        seg.steps.append(step)
        seg.by_call[call.call_id] = step
        for tc in step.get("tool_calls", ()):
            seg.agent_steps[tc["tool_call_id"]] = step
        if msgs is not None:
            seg.seen = list(msgs)
            seg.call_tools.append((step, call.tools))
    for seg in segments:  # a call offered other tools than the trajectory's names them
        for step, tools in seg.call_tools:
            if tools != seg.tools:
                step["extra"]["tools"] = tools
    return segments


def _document(seg: _Segment, *, root: bool, next_file: str | None,
              outcome: Outcome | None, task_id: str | None) -> dict[str, Any]:
    steps = [{"step_id": i + 1, **s} for i, s in enumerate(seg.steps)]
    agent_steps = [s for s in seg.steps if s["source"] == "agent" and "metrics" in s]
    notes = []
    if seg.missing_messages:
        notes.append(f"{seg.missing_messages} call(s) recorded no request messages: their "
                     "input steps are not here")
    if seg.reason:
        notes.append(f"continues {seg.session_id}: {seg.reason}")
    doc: dict[str, Any] = {
        "schema_version": SCHEMA, "session_id": seg.session_id,
        "trajectory_id": seg.session_id if seg.index == 0 else
        f"{seg.session_id}.cont-{seg.index}",
        "agent": {"name": "tidal", "version": __version__,
                  **({"tool_definitions": seg.tools} if seg.tools else {})},
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": sum(s["metrics"]["prompt_tokens"] for s in agent_steps),
            "total_completion_tokens": sum(s["metrics"]["completion_tokens"]
                                           for s in agent_steps),
            "total_steps": len(steps)},
    }
    if notes:
        doc["notes"] = "; ".join(notes)
    if next_file is not None:
        doc["continued_trajectory_ref"] = next_file
    if seg.subagents:
        doc["subagent_trajectories"] = seg.subagents
    if root:
        doc["extra"] = {"task_id": task_id, **_outcome_extra(outcome)}
    return doc


def _outcome_extra(outcome: Outcome | None) -> dict[str, Any]:
    if outcome is None:
        return {"status": None, "reward": None}
    reward = outcome.reward if math.isfinite(outcome.reward) else None
    return {"status": outcome.status.value, "reward": reward,
            "partial_score": outcome.partial_score, "details": outcome.details,
            "recorded_at": outcome.recorded_at}


def episode_trajectories(store: LedgerStore, root_session: str) -> dict[str, dict[str, Any]]:
    """The ATIF documents of the episode whose root session is `root_session`, by file
    name: the root's first segment first, then its continuations."""
    infos = {i.session_id: i for i in store.sessions()}
    if root_session not in infos:
        raise LedgerError(f"no session {root_session!r} in the ledger")
    outcomes = store.outcomes()
    children: dict[str, list[str]] = {}
    for info in infos.values():
        if info.parent_session_id is not None:
            children.setdefault(info.parent_session_id, []).append(info.session_id)

    continuations: dict[str, dict[str, Any]] = {}  # the subagents' continuation files

    def build(session_id: str) -> tuple[list[_Segment], dict[str, dict[str, Any]]]:
        """The session's segments (subagents embedded) and its continuation documents."""
        log = store.call_log(session_id)
        segments = session_segments(log)
        for child in children.get(session_id, ()):
            child_segments, child_files = build(child)
            continuations.update(child_files)
            first = _document(child_segments[0], root=False, next_file=(
                child_segments[1].file_name if len(child_segments) > 1 else None),
                outcome=None, task_id=None)
            first["extra"] = _outcome_extra(outcomes.get(child))
            parent_call = infos[child].parent_call_id
            seg = next((s for s in segments if parent_call in s.by_call), segments[-1])
            seg.subagents.append(first)
            if parent_call in seg.by_call:
                seg.by_call[parent_call].setdefault("observation", {"results": []})[
                    "results"].append({"subagent_trajectory_ref": [
                        {"trajectory_id": child, "session_id": child}]})
        files = {}
        for i, seg in enumerate(segments):
            if i == 0:
                continue
            files[seg.file_name] = _document(seg, root=False, next_file=(
                segments[i + 1].file_name if i + 1 < len(segments) else None),
                outcome=None, task_id=None)
        return segments, files

    segments, files = build(root_session)
    head = _document(segments[0], root=True, next_file=(
        segments[1].file_name if len(segments) > 1 else None),
        outcome=outcomes.get(root_session), task_id=infos[root_session].task_id)
    return {segments[0].file_name: head, **files, **continuations}


def write_atif(store: LedgerStore, directory: str | Path) -> int:
    """One ATIF file per episode (and per continuation) in `directory`; returns how many
    episodes were written."""
    directory = Path(directory)
    try:
        directory.mkdir(exist_ok=True)
    except OSError as e:
        raise LedgerError(f"cannot create {directory}: {e.strerror}") from e
    roots = [i.session_id for i in store.sessions() if i.parent_session_id is None]
    for root in roots:
        for name, doc in episode_trajectories(store, root).items():
            tmp = directory / f".{name}.partial"
            try:
                tmp.write_text(json.dumps(doc, ensure_ascii=False, indent=1), encoding="utf-8")
                tmp.replace(directory / name)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise LedgerError(f"cannot write {directory / name}: {e.strerror or e}") from e
    return len(roots)
