"""Harbor ATIF trajectories into the ledger (`tidal ledger import --atif DIR`).

The reverse of `atif.py`. A directory's `*.json` files are read and checked whole before
the store is opened; every file that no other names (by `continued_trajectory_ref` or a
`subagent_trajectory_ref`'s `trajectory_path`) is the root of an episode. Then:

- a trajectory and its continuation files are one ledger session: the trajectory's
  `session_id` (else its file name without `.json`). An embedded subagent (or one in a
  file its parent names) is a session of its own, linked to its parent's.
- each agent step that is an LLM call (not `is_copied_context`, `llm_call_count` not 0)
  is one `Call`: its `metrics` must hold `prompt_token_ids`, `completion_token_ids` and
  one logprob per completion token. A step without them cannot be trained: it is
  refused, naming its file and step, or with `skip_untrainable` skipped with a note.
- a call's request messages are rebuilt from the steps before it: a system or user step
  is a message, an agent step an assistant turn (its message and tool calls), each
  observation result with a `source_call_id` a tool message after it. Its tools are the
  trajectory's `tool_definitions`.
- an outcome comes from a root or subagent trajectory whose `extra` holds `status`
  (not null) and `reward`, as tidal's export writes them.

A trajectory tidal wrote (`agent.name == "tidal"`) carries each call's ledger fields in
its agent steps' `extra` (`atif.py`): the call's id, role, policy version, finish reason,
times, links, metadata... are taken from there, so export -> import -> export gives the
same files, and the calls come back exactly but for their messages (rebuilt from the
steps: an assistant turn as the step shows it, a null content as "", content parts as
their JSON text, a tool result right after the turn that asked for it). In any other
trajectory, `extra` is the producer's and is not read: a call's id is `step-<N>` (in the
k-th continuation `cont-<k>.step-<N>`), its role `main` or `subagent`, policy version 0,
finish reason `unknown`, times the step's `timestamp`, metadata where it came from
(`{"atif": {"file", "trajectory_id", "step_id"}}`); a subagent's calls name the call of
the step that refers to it, if that step is a call.

Pure but for `read_atif`, which reads a directory, and `append_atif`, which writes all of
one import in one store transaction after refusing sessions the store already has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tidal.ledger.atif import arguments_text, recorded_tool_call
from tidal.ledger.interchange import ImportReport
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import (
    Call,
    IdArray,
    LedgerError,
    Outcome,
    as_ids,
    check_free_form,
    check_id,
    make_call,
    make_outcome,
    short_repr,
)

SKIP_FLAG = "--skip-untrainable"

# The fields of harbor's models (all `extra="forbid"`): a field beyond them is refused.
_TRAJECTORY = frozenset({"schema_version", "session_id", "trajectory_id", "agent", "steps",
                         "notes", "final_metrics", "continued_trajectory_ref", "extra",
                         "subagent_trajectories"})
_AGENT = frozenset({"name", "version", "model_name", "tool_definitions", "extra"})
_STEP = frozenset({"step_id", "timestamp", "source", "model_name", "reasoning_effort",
                   "message", "reasoning_content", "tool_calls", "observation", "metrics",
                   "is_copied_context", "llm_call_count", "extra"})
_METRICS = frozenset({"prompt_tokens", "completion_tokens", "cached_tokens", "cost_usd",
                      "prompt_token_ids", "completion_token_ids", "logprobs", "extra"})
_TOOL_CALL = frozenset({"tool_call_id", "function_name", "arguments", "extra"})
_OBSERVATION = frozenset({"results"})
_RESULT = frozenset({"source_call_id", "content", "subagent_trajectory_ref", "extra"})
_REF = frozenset({"trajectory_id", "session_id", "trajectory_path", "extra"})
_SCHEMA = re.compile(r"^ATIF-v1\.\d+$")


# --------------------------------------------------------------- the parsed form


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class SubagentRef:
    trajectory_id: str | None
    path: str | None


@dataclass(frozen=True)
class Result:
    """An observation result: a tool's output (`call_id`), other feedback, or subagent
    references."""

    call_id: str | None
    content: str | None
    refs: tuple[SubagentRef, ...]


@dataclass(frozen=True)
class Tokens:
    prompt: IdArray | None
    completion: IdArray | None
    logprobs: list[float] | None


@dataclass(frozen=True)
class Step:
    where: str  # "DIR/f.json step 3", for messages
    step_id: int
    source: str  # system | user | agent
    message: str  # content parts as their JSON text
    timestamp: float | None  # unix seconds
    tool_calls: tuple[ToolCall, ...]
    results: tuple[Result, ...]
    tokens: Tokens | None
    copied: bool
    llm_calls: int | None
    extra: dict[str, Any]

    @property
    def is_call(self) -> bool:
        """An LLM call made in this trajectory (not copied context, not a dispatch)."""
        return self.source == "agent" and not self.copied and self.llm_calls != 0


@dataclass(frozen=True)
class Trajectory:
    where: str  # "DIR/f.json", "DIR/f.json subagent 'x'"
    file: str  # the file it is in
    tidal: bool  # written by tidal's export: its steps' `extra` holds the ledger fields
    session_id: str | None
    trajectory_id: str | None
    tools: list[dict[str, Any]] | None
    steps: tuple[Step, ...]
    continued: str | None
    subagents: tuple[Trajectory, ...]
    extra: dict[str, Any]


def _kind(value: object) -> str:
    """A JSON value's type, as a message names it."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _object(value: object, where: str, what: str, known: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise LedgerError(f"{where}: {what} must be an object, got {_kind(value)}")
    unknown = [k for k in value if k not in known]
    if unknown:
        names = ", ".join(short_repr(k, 40) for k in unknown)
        raise LedgerError(f"{where}: {what} has unknown field(s) {names} (ATIF has no such "
                          "field; a producer's own data belongs under \"extra\")")
    return value


def _required_str(d: Mapping[str, Any], key: str, where: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise LedgerError(f"{where}: {key} must be a string, got {_kind(v)}")
    return v


def _str(d: Mapping[str, Any], key: str, where: str) -> str | None:
    return None if d.get(key) is None else _required_str(d, key, where)


def _array(d: Mapping[str, Any], key: str, where: str) -> list[Any]:
    v = d.get(key)
    if v is None:
        return []
    if not isinstance(v, list):
        raise LedgerError(f"{where}: {key} must be an array, got {_kind(v)}")
    return v


def _extra(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    v = d.get("extra")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise LedgerError(f"{where}: extra must be an object, got {_kind(v)}")
    return v


def _text(value: object, name: str, where: str) -> str:
    """A message or result content: text, or content parts kept as their JSON text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return json.dumps(value, ensure_ascii=False)
    raise LedgerError(f"{where}: {name} must be a string or an array of content parts, "
                      f"got {_kind(value)}")


def _timestamp(value: str, where: str) -> float:
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise LedgerError(f"{where}: timestamp {short_repr(value)} is not an ISO 8601 "
                          "time") from None
    return (t if t.tzinfo is not None else t.replace(tzinfo=UTC)).timestamp()


def _tool_call(value: object, where: str) -> ToolCall:
    d = _object(value, where, "a tool call", _TOOL_CALL)
    args = d.get("arguments")
    if not isinstance(args, dict):
        raise LedgerError(f"{where}: a tool call's arguments must be an object, "
                          f"got {_kind(args)}")
    return ToolCall(_required_str(d, "tool_call_id", where),
                    _required_str(d, "function_name", where), args)


def _result(value: object, where: str, call_ids: set[str]) -> Result:
    d = _object(value, where, "an observation result", _RESULT)
    call_id = _str(d, "source_call_id", where)
    if call_id is not None and call_id not in call_ids:
        raise LedgerError(f"{where}: an observation result's source_call_id {call_id!r} is "
                          "not one of the step's tool calls")
    content = d.get("content")
    refs = []
    for r in _array(d, "subagent_trajectory_ref", where):
        rd = _object(r, where, "a subagent_trajectory_ref", _REF)
        ref = SubagentRef(_str(rd, "trajectory_id", where), _str(rd, "trajectory_path", where))
        if ref.trajectory_id is None and ref.path is None:
            raise LedgerError(f"{where}: a subagent_trajectory_ref names neither a "
                              "trajectory_id nor a trajectory_path")
        refs.append(ref)
    return Result(call_id, None if content is None else _text(content, "content", where),
                  tuple(refs))


def _tokens(value: object, where: str) -> Tokens:
    d = _object(value, where, "metrics", _METRICS)
    prompt, completion = d.get("prompt_token_ids"), d.get("completion_token_ids")
    logprobs = d.get("logprobs")
    out = Tokens(None if prompt is None else as_ids(prompt, "metrics.prompt_token_ids", where),
                 None if completion is None else
                 as_ids(completion, "metrics.completion_token_ids", where), None)
    if logprobs is None:
        return out
    if not isinstance(logprobs, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in logprobs):
        raise LedgerError(f"{where}: metrics.logprobs must be an array of numbers")
    if out.completion is not None and len(logprobs) != out.completion.shape[0]:
        raise LedgerError(
            f"{where}: metrics.logprobs has {len(logprobs)} entries but "
            f"metrics.completion_token_ids has {out.completion.shape[0]} tokens; every "
            "completion token needs exactly one logprob")
    return Tokens(out.prompt, out.completion, logprobs)


def _step(value: object, index: int, where: str) -> Step:
    d = _object(value, f"{where} step {index + 1}", "the step", _STEP)
    step_id = d.get("step_id")
    if isinstance(step_id, bool) or step_id != index + 1:
        raise LedgerError(f"{where} steps[{index}]: step_id must be {index + 1} (steps are "
                          f"numbered from 1, in order), got {short_repr(step_id)}")
    here = f"{where} step {step_id}"
    source = d.get("source")
    if source not in ("system", "user", "agent"):
        raise LedgerError(f"{here}: source must be \"system\", \"user\" or \"agent\", "
                          f"got {short_repr(source)}")
    if "message" not in d:
        raise LedgerError(f"{here}: missing required field message")
    stamp = _str(d, "timestamp", here)
    calls = tuple(_tool_call(t, here) for t in _array(d, "tool_calls", here))
    if calls and source != "agent":
        raise LedgerError(f"{here}: tool_calls on a {source} step (only an agent step "
                          "calls tools)")
    observation = d.get("observation")
    results: tuple[Result, ...] = ()
    if observation is not None:
        od = _object(observation, here, "observation", _OBSERVATION)
        if not isinstance(od.get("results"), list):
            raise LedgerError(f"{here}: observation.results must be an array")
        ids = {c.id for c in calls}
        results = tuple(_result(r, here, ids) for r in od["results"])
    llm_calls = d.get("llm_call_count")
    if llm_calls is not None and (isinstance(llm_calls, bool) or not isinstance(
            llm_calls, int) or llm_calls < 0):
        raise LedgerError(f"{here}: llm_call_count must be a non-negative integer, "
                          f"got {short_repr(llm_calls)}")
    metrics = d.get("metrics")
    if metrics is not None and source != "agent":
        raise LedgerError(f"{here}: metrics on a {source} step (only an agent step has them)")
    if metrics is not None and llm_calls == 0:
        raise LedgerError(f"{here}: metrics on a step whose llm_call_count is 0 (a step that "
                          "made no LLM call)")
    copied = d.get("is_copied_context")
    if copied is not None and not isinstance(copied, bool):
        raise LedgerError(f"{here}: is_copied_context must be true or false, "
                          f"got {short_repr(copied)}")
    return Step(here, index + 1, source, _text(d["message"], "message", here),
                None if stamp is None else _timestamp(stamp, here), calls, results,
                None if metrics is None else _tokens(metrics, here), bool(copied),
                llm_calls, _extra(d, here))


def parse_trajectory(value: object, where: str, file: str) -> Trajectory:
    """One ATIF document (and the subagents it embeds), checked field by field; raises
    `LedgerError` naming `where`, the step and what is wrong."""
    d = _object(value, where, "a trajectory", _TRAJECTORY)
    schema = d.get("schema_version")
    if schema is not None and (not isinstance(schema, str) or not _SCHEMA.match(schema)):
        raise LedgerError(f"{where}: schema_version must be \"ATIF-v1.<minor>\", "
                          f"got {short_repr(schema)}")
    agent = _object(d.get("agent"), where, "agent", _AGENT)
    name = _required_str(agent, "name", f"{where} agent")
    tools = agent.get("tool_definitions")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
        raise LedgerError(f"{where}: agent.tool_definitions must be an array of objects")
    raw_steps = d.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise LedgerError(f"{where}: steps must be a non-empty array, got "
                          f"{_kind(raw_steps) if not isinstance(raw_steps, list) else 'none'}")
    steps = tuple(_step(s, i, where) for i, s in enumerate(raw_steps))
    subagents: list[Trajectory] = []
    for i, s in enumerate(_array(d, "subagent_trajectories", where)):
        tid = s.get("trajectory_id") if isinstance(s, dict) else None
        if not isinstance(tid, str):
            raise LedgerError(f"{where}: subagent_trajectories[{i}] has no trajectory_id "
                              "(every embedded subagent needs one)")
        if any(t.trajectory_id == tid for t in subagents):
            raise LedgerError(f"{where}: two subagent_trajectories have trajectory_id {tid!r}")
        subagents.append(parse_trajectory(s, f"{where} subagent {tid!r}", file))
    return Trajectory(where, file, name == "tidal", _str(d, "session_id", where),
                      _str(d, "trajectory_id", where), tools, steps,
                      _str(d, "continued_trajectory_ref", where), tuple(subagents),
                      _extra(d, where))


# ------------------------------------------------------------------- the records


@dataclass(frozen=True)
class AtifRecords:
    """What an ATIF directory holds for the ledger: its calls (each session's in order, a
    parent's before its subagents'), outcomes, sessions (by id, with where each came
    from), episodes, and notes on what was skipped."""

    source: str
    calls: list[Call]
    outcomes: list[Outcome]
    sessions: dict[str, str]
    episodes: int
    notes: list[str] = field(default_factory=list)


Parent = tuple[str, str | None]  # a subagent's parent session and spawning call


@dataclass(frozen=True)
class _Session:
    """The ledger session a trajectory's calls go to."""

    id: str
    role: str  # of calls whose step does not say (main, subagent)
    parent: Parent | None


def _assistant(step: Step) -> dict[str, Any]:
    """An agent step as the assistant message a client sends back."""
    msg: dict[str, Any] = {"role": "assistant", "content": step.message or None}
    if step.tool_calls:
        msg["tool_calls"] = [{"id": t.id, "type": "function", "function": {
            "name": t.name, "arguments": arguments_text(t.arguments)}} for t in step.tool_calls]
    return msg


def _feedback(step: Step) -> list[dict[str, Any]]:
    """A step's observation results as the messages that carried them: a tool message per
    tool result, a user message for other feedback (subagent references are not)."""
    out: list[dict[str, Any]] = []
    for r in step.results:
        if r.call_id is not None:
            out.append({"role": "tool", "tool_call_id": r.call_id, "content": r.content or ""})
        elif r.content is not None:
            out.append({"role": "user", "content": r.content})
    return out


def _input(traj: Trajectory, step: Step) -> dict[str, Any]:
    """A system or user step as a message; tidal's export names other roles in `extra`."""
    role = step.extra.get("role") if traj.tidal else None
    if not isinstance(role, str):
        return {"role": step.source, "content": step.message}
    if role == "tool":
        return {"role": "tool", "tool_call_id": step.extra.get("tool_call_id"),
                "content": step.message}
    return {"role": role, "content": step.message}


def _untrainable(step: Step) -> str | None:
    t = step.tokens
    if t is None or t.prompt is None or t.completion is None:
        return ("its metrics hold no prompt_token_ids and completion_token_ids, so it "
                "cannot be trained")
    if t.logprobs is None:
        return "its metrics hold no logprobs, so it cannot be trained"
    if step.llm_calls is not None and step.llm_calls > 1:
        return (f"it stands for {step.llm_calls} LLM calls (llm_call_count), and a ledger "
                "call is one")
    return None


class _Importer:
    def __init__(self, docs: Mapping[str, Trajectory], directory: Path, skip: bool) -> None:
        self.docs = docs
        self.directory = directory
        self.skip = skip
        self.calls: list[Call] = []
        self.outcomes: list[Outcome] = []
        self.sessions: dict[str, str] = {}  # every session id given out -> its trajectory
        self.with_calls: dict[str, str] = {}
        self.call_ids: dict[tuple[str, str], str] = {}
        self.taken: dict[str, str] = {}  # file -> what names it
        self.notes: list[str] = []

    def run(self) -> AtifRecords:
        named = {n for doc in self.docs.values() for n in _files_named(doc)}
        roots = [n for n in sorted(self.docs) if n not in named]
        for name in roots:
            doc = self.docs[name]
            self.taken[name] = doc.where
            sid = doc.session_id if doc.session_id is not None else Path(name).stem
            self._session(doc, _Session(check_id(sid, "session_id", doc.where), "main", None))
        left = sorted(set(self.docs) - set(self.taken))
        if left:
            raise LedgerError(f"{self.directory / left[0]}: named by a continued_trajectory_ref "
                              "or subagent_trajectory_ref that no root trajectory leads to "
                              "(the references go round in a cycle)")
        if not self.calls:
            raise LedgerError(f"{self.directory}: no agent step with token ids in any "
                              "trajectory: nothing to import")
        return AtifRecords(str(self.directory), self.calls, self.outcomes, self.with_calls,
                           len(roots), self.notes)

    def _take(self, name: str, where: str, what: str) -> Trajectory:
        """The trajectory of file `name`, which `where` names by `what`."""
        doc = self.docs.get(name)
        if doc is None:
            raise LedgerError(f"{where}: {what} {name!r} names no trajectory file in "
                              f"{self.directory}")
        if name in self.taken:
            raise LedgerError(f"{where}: {what} {name!r} names a file that {self.taken[name]} "
                              "names too (a file is one trajectory's continuation or one "
                              "subagent)")
        self.taken[name] = where
        return doc

    def _session(self, first: Trajectory, session: _Session) -> None:
        sid = session.id
        if sid in self.sessions:
            raise LedgerError(f"{first.where}: session {sid!r} is also {self.sessions[sid]}; "
                              "every trajectory (but a continuation) is a session of its own")
        self.sessions[sid] = first.where
        chain = [first]
        while (ref := chain[-1].continued) is not None:
            chain.append(self._take(ref, chain[-1].where, "continued_trajectory_ref"))
        before = len(self.calls)
        subagents: list[tuple[Trajectory, str | None]] = []
        for k, seg in enumerate(chain):
            call_of_step = self._segment(seg, k, session)
            subagents += self._subagents(seg, call_of_step)
        made = len(self.calls) - before
        outcome = _outcome(first, sid)
        if made:
            self.with_calls[sid] = first.where
            if outcome is not None:
                self.outcomes.append(outcome)
        elif not self.skip:
            raise LedgerError(f"{first.where}: none of its agent steps carries token ids, so "
                              f"session {sid!r} would have no calls ({SKIP_FLAG} imports the "
                              "rest, noting what it skips)")
        else:
            self.notes.append(f"skipped {first.where}: session {sid!r} has no agent step with "
                              "token ids" + (", nor its outcome" if outcome else "")
                              + (" (its subagents are imported without a parent)"
                                 if subagents else ""))
        for sub, spawner in subagents:
            self._session(sub, _Session(self._subagent_id(sub, sid), "subagent",
                                        (sid, spawner) if made else None))

    def _subagent_id(self, sub: Trajectory, parent: str) -> str:
        sid = sub.session_id
        if not sub.tidal and (sid is None or sid == parent or sid in self.sessions):
            # ATIF lets a subagent share its parent's (or a sibling's) run id
            sid = f"{parent}.{sub.trajectory_id or Path(sub.file).stem}"
        if sid is None:
            raise LedgerError(f"{sub.where}: a subagent of tidal's export needs its session_id")
        return check_id(sid, "session_id", sub.where)

    def _segment(self, seg: Trajectory, k: int, session: _Session) -> dict[int, str]:
        """The calls of one file of a session (its k-th); returns their ids by step."""
        history: list[dict[str, Any]] = []
        first = next((i for i, s in enumerate(seg.steps) if s.is_call), len(seg.steps))
        has_input = seg.tidal or first > 0  # else: a trajectory that shows no input
        call_of_step: dict[int, str] = {}
        for step in seg.steps:
            if not step.is_call:
                history.append(_assistant(step) if step.source == "agent"
                               else _input(seg, step))
                history += _feedback(step)
                continue
            problem = _untrainable(step)
            if problem is not None:
                if not self.skip:
                    raise LedgerError(f"{step.where}: {problem} ({SKIP_FLAG} imports the rest, "
                                      "noting each step it skips)")
                self.notes.append(f"skipped {step.where}: {problem}")
                history.append(_assistant(step))
                history += _feedback(step)
                continue
            recorded = step.extra.get("messages_recorded") is not False if seg.tidal \
                else has_input
            call = self._call(seg, step, k, session, list(history) if recorded else None)
            call_of_step[step.step_id] = call.call_id
            if recorded:
                history.append(_assistant(step))
            history += _feedback(step)
        return call_of_step

    def _call(self, seg: Trajectory, step: Step, k: int, session: _Session,
              messages: list[dict[str, Any]] | None) -> Call:
        sid = session.id
        t = step.tokens
        assert t is not None
        x = step.extra if seg.tidal else {}
        started = x.get("started_at", step.timestamp if step.timestamp is not None else 0.0)
        data: dict[str, Any] = {
            "session_id": sid,
            "call_id": x.get("call_id", f"step-{step.step_id}" if k == 0
                             else f"cont-{k}.step-{step.step_id}"),
            "role": x.get("role", session.role),
            "prompt_ids": t.prompt, "output_ids": t.completion, "output_logprobs": t.logprobs,
            "output_text": x.get("output_text", step.message),
            "raw_tool_calls": x.get("raw_tool_calls"),
            "tool_calls": x["tool_calls"] if "tool_calls" in x else [
                recorded_tool_call(c.id, c.name, c.arguments) for c in step.tool_calls] or None,
            "policy_version": x.get("policy_version", 0),
            "finish_reason": x.get("finish_reason", "unknown"),
            "started_at": started, "ended_at": x.get("ended_at", started),
            "task_id": x.get("task_id"),
            "parent_call_id": x.get("parent_call_id"),
            "parent_session_id": x.get("parent_session_id"),
            "sampling": x.get("sampling", {}), "metadata": x.get("metadata", {}),
            "messages": messages,
            "tools": None if messages is None else x.get("tools", seg.tools),
        }
        if not seg.tidal:
            data["metadata"] = {"atif": {"file": seg.file, "trajectory_id": seg.trajectory_id,
                                         "step_id": step.step_id}}
            if session.parent is not None:
                data["parent_session_id"], data["parent_call_id"] = session.parent
        try:
            call = make_call(data)
        except LedgerError as e:
            raise LedgerError(f"{step.where}: {e}") from None
        key = (sid, call.call_id)
        if key in self.call_ids:
            raise LedgerError(f"{step.where}: call id {call.call_id!r} of session {sid!r} is "
                              f"also {self.call_ids[key]}'s")
        self.call_ids[key] = step.where
        self.calls.append(call)
        return call

    def _subagents(self, seg: Trajectory, call_of_step: Mapping[int, str],
                   ) -> list[tuple[Trajectory, str | None]]:
        """The segment's subagents (embedded ones in order, then those in files), each
        with the call of the step that refers to it (None: no call refers to it)."""
        embedded = {s.trajectory_id for s in seg.subagents}
        spawned: dict[str, str | None] = {}
        in_files: list[tuple[Trajectory, str | None]] = []
        for step in seg.steps:
            for r in step.results:
                for ref in r.refs:
                    tid = ref.trajectory_id
                    if tid is not None and tid in embedded:
                        spawned.setdefault(tid, call_of_step.get(step.step_id))
                    elif ref.path is not None:
                        sub = self._take(ref.path, step.where, "subagent_trajectory_ref")
                        in_files.append((sub, call_of_step.get(step.step_id)))
                    else:
                        raise LedgerError(
                            f"{step.where}: subagent_trajectory_ref names trajectory "
                            f"{ref.trajectory_id!r}, which is not in subagent_trajectories "
                            "(and the reference names no trajectory_path)")
        return [(s, spawned.get(s.trajectory_id or "")) for s in seg.subagents] + in_files


def _files_named(doc: Trajectory) -> list[str]:
    """The files `doc` (and the subagents it embeds) name: continuations, subagents."""
    names = [] if doc.continued is None else [doc.continued]
    embedded = {s.trajectory_id for s in doc.subagents}
    names += [ref.path for step in doc.steps for r in step.results for ref in r.refs
              if ref.trajectory_id not in embedded and ref.path is not None]
    for sub in doc.subagents:
        names += _files_named(sub)
    return names


def _outcome(doc: Trajectory, sid: str) -> Outcome | None:
    """The outcome in a trajectory's `extra` (`status` not null, and `reward`), if any."""
    x = doc.extra
    if x.get("status") is None or "reward" not in x:
        return None
    try:
        return make_outcome({"session_id": sid, "status": x["status"], "reward": x["reward"],
                             "partial_score": x.get("partial_score", 0.0),
                             "details": x.get("details") or {},
                             "recorded_at": x.get("recorded_at", 0.0)})
    except LedgerError as e:
        raise LedgerError(f"{doc.where}: extra: {e}") from None


def atif_records(files: Mapping[str, object], *, directory: Path = Path(),
                 skip_untrainable: bool = False) -> AtifRecords:
    """The ledger records of ATIF documents (parsed JSON) by file name, `directory` naming
    where they are in messages. Raises `LedgerError` naming the file, the step and what
    is wrong; with `skip_untrainable`, agent steps without token ids (and sessions left
    with no call) are skipped, each with a note."""
    docs = {name: parse_trajectory(value, str(directory / name), name)
            for name, value in files.items()}
    return _Importer(docs, directory, skip_untrainable).run()


# ------------------------------------------------------------------------ files, store


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _read_json(path: Path) -> object:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise LedgerError(f"cannot read {path}: {e.strerror}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LedgerError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte "
                          f"{e.start + 1}); a trajectory is UTF-8 JSON") from None
    try:
        value: object = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise LedgerError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column "
                          f"{e.colno})") from None
    except RecursionError:
        raise LedgerError(f"{path}: JSON nested too deeply to parse") from None
    except ValueError as e:  # NaN/Infinity, an integer of more than 4300 digits
        raise LedgerError(f"{path}: not valid JSON ({e})") from None
    # every string UTF-8 text (no lone surrogate escapes), nesting within bounds
    check_free_form(value, "the trajectory", str(path))
    return value


def read_atif(directory: Path, *, skip_untrainable: bool = False) -> AtifRecords:
    """The records of every trajectory in `directory` (its `*.json` files), all checked."""
    if not directory.exists():
        raise LedgerError(f"cannot read {directory}: no such directory")
    if not directory.is_dir():
        raise LedgerError(f"cannot read {directory}: it is a file; give the directory that "
                          "holds the trajectory and its continuation files")
    names = sorted(p.name for p in directory.iterdir()
                   if p.suffix == ".json" and not p.name.startswith(".") and p.is_file())
    if not names:
        raise LedgerError(f"{directory}: no ATIF trajectory (*.json file) in it")
    files = {name: _read_json(directory / name) for name in names}
    return atif_records(files, directory=directory, skip_untrainable=skip_untrainable)


def append_atif(records: AtifRecords, store: LedgerStore) -> ImportReport:
    """Append the records to `store` in one transaction, all or nothing; a session the
    store already has (calls or an outcome) is refused by name, before anything is
    written."""
    taken = [f"{sid!r} ({where})" for sid, where in records.sessions.items()
             if store.has_session(sid) or store.outcome(sid) is not None]
    if taken:
        shown = ", ".join(taken[:5]) + (f" and {len(taken) - 5} more" if len(taken) > 5 else "")
        raise LedgerError(f"session(s) {shown} already in {store.path}: an import adds new "
                          "sessions only (nothing was imported)")
    try:
        store.append_records(records.calls, records.outcomes)
    except LedgerError as e:
        raise LedgerError(f"{records.source}: {e} (nothing was imported)") from None
    return ImportReport(calls=len(records.calls), outcomes=len(records.outcomes))

