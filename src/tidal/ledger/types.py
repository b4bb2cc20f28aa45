"""The ledger's data model: one `Call` per LLM call, one `Outcome` per session.

Pure Python + numpy, no I/O. Token ids are int32 arrays, logprobs float32 arrays.
Validation lives here (`validate_call`, `validate_outcome`) so that the store, the
JSONL importer and the gateway refuse bad records with the same clear messages.

Two views of a call's prompt exist:
- `Call.prompt_ids`: the full prompt, as a writer hands it in.
- `PromptDelta`: how the store keeps it, `(base call, prefix length, new suffix)`,
  where the prefix is taken from the base call's *context* (its prompt followed by its
  output). Storage then grows with unique tokens, not with the sum of prompt lengths.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

IdArray = npt.NDArray[np.int32]
LogprobArray = npt.NDArray[np.float32]

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}$")
ROLE_PATTERN = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
MAX_TOKEN_ID = 2**31 - 1
MAX_INT = 2**63 - 1  # policy_version: what SQLite, Parquet (int64) and numpy hold
MAX_DEPTH = 128  # nesting levels of a free-form object (metadata, tool_calls, ...)


class LedgerError(ValueError):
    """A record or store failed validation; the message names the record and field."""


class Status(enum.StrEnum):
    """How a session ended. Every session ends with exactly one of these."""

    COMPLETE = "complete"
    TRUNCATED = "truncated"
    TIMEOUT = "timeout"
    ABORTED = "aborted"
    INFRA_ERROR = "infra_error"


class Role(enum.StrEnum):
    """Well-known agent roles. Other lowercase role names are accepted as-is."""

    MAIN = "main"
    MAIN_SUMMARY = "main_summary"
    SUBAGENT = "subagent"
    SUBAGENT_SUMMARY = "subagent_summary"


@dataclass(frozen=True, eq=False)
class Call:
    """One LLM call, exactly as the engine saw and produced it.

    `prompt_ids` is the full prompt; `output_ids[i]` was sampled with log-probability
    `output_logprobs[i]` under policy `policy_version`. `output_text` is the raw
    decoded output and `raw_tool_calls` the tool-call text exactly as the model wrote
    it (before any parsing); `tool_calls` is the parsed form handed to the client.
    `messages` and `tools` are the request the call answered, in chat-completions form
    (None where it was not a chat request): the store keeps them as a delta against an
    earlier call, as it keeps prompts, so a session costs what its new messages do.
    """

    session_id: str
    call_id: str
    role: str
    prompt_ids: IdArray
    output_ids: IdArray
    output_logprobs: LogprobArray
    output_text: str
    policy_version: int
    finish_reason: str
    started_at: float
    ended_at: float
    raw_tool_calls: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    parent_call_id: str | None = None
    parent_session_id: str | None = None
    task_id: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def context_len(self) -> int:
        """Length of prompt + output: what a later call can extend."""
        return int(self.prompt_ids.shape[0] + self.output_ids.shape[0])


@dataclass(frozen=True, eq=False)
class PromptDelta:
    """A prompt stored as `base context[:prefix_len] + suffix_ids`.

    `base_call_id` is None when the prompt shares nothing with an earlier call (then
    `prefix_len` is 0 and the suffix is the whole prompt). The base's context is its
    prompt followed by its output, so a call continuing a conversation stores only the
    tool results and new user text since that call.
    """

    base_call_id: str | None
    prefix_len: int
    suffix_ids: IdArray

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + int(self.suffix_ids.shape[0])


@dataclass(frozen=True)
class RequestDelta:
    """A call's request messages stored as `base_call_id`'s messages[:keep] + `new` (no
    base: `new` is all of them); its tools as the base's (`tools_from_base`) or `tools`."""

    base_call_id: str | None
    keep: int
    new: list[dict[str, Any]]
    tools_from_base: bool
    tools: list[dict[str, Any]] | None

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base_call_id, "keep": self.keep, "new": self.new,
                "tools": "base" if self.tools_from_base else self.tools}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestDelta:
        same = d["tools"] == "base"
        return cls(d["base"], int(d["keep"]), list(d["new"]), same,
                   None if same else d["tools"])


@dataclass(frozen=True, eq=False)
class StoredCall:
    """A call as read back from the store: the prompt as a delta, plus bookkeeping.

    `seq` is the store's commit order (1, 2, ...); `content_hash` the SHA-256 that
    `tidal ledger check` re-verifies. Use `CallLog.prompt_ids` to materialise prompts.
    """

    seq: int
    call: Call  # with an empty prompt_ids and no messages: `prompt` and `request` hold them
    prompt: PromptDelta
    content_hash: str
    request: RequestDelta | None = None  # None: the call recorded no request messages

    @property
    def call_id(self) -> str:
        return self.call.call_id

    @property
    def session_id(self) -> str:
        return self.call.session_id

    @property
    def context_len(self) -> int:
        return self.prompt.prompt_len + int(self.call.output_ids.shape[0])


@dataclass(frozen=True)
class Outcome:
    """How a session ended and what it earned.

    `reward` is the grader's final reward; `partial_score` in [0, 1] is the share of
    progress made (kept for sessions that time out or are truncated).
    """

    session_id: str
    status: Status
    reward: float
    partial_score: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    recorded_at: float = 0.0


@dataclass(frozen=True)
class SessionMeta:
    """What a run records of a session beside its calls: the phase it ran in (`rl`,
    `eval<tag>`), the RL step it was planned for, its task, its sample index in the task's
    group, and for a subagent its parent session. Recorded by the run that starts the
    session (not by anything inside the sandbox), read back on resume."""

    phase: str
    step: int
    task_id: str
    sample: int
    parent: str | None = None


# --------------------------------------------------------------------------- validation


def short_repr(value: object, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters: a 10^30 id or a 10k-character string is
    named, not echoed whole."""
    if isinstance(value, int) and abs(value) >= 10**limit:  # repr may refuse > 4300 digits
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _where(session_id: object, call_id: object) -> str:
    return f"call {short_repr(call_id, 140)} of session {short_repr(session_id, 140)}"


def check_id(value: object, name: str, where: str) -> str:
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise LedgerError(
            f"{where}: {name} must be a string of 1-128 characters from [A-Za-z0-9._:@/+-] "
            f"starting with a letter or digit, got {short_repr(value)}"
        )
    return value


def as_ids(value: object, name: str, where: str) -> IdArray:
    """Convert a sequence of token ids to int32, refusing non-integers and negatives."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise LedgerError(f"{where}: {name} must be one-dimensional, got shape {value.shape}")
        if value.dtype.kind not in "iu" and value.size:
            raise LedgerError(f"{where}: {name} must hold integers, got dtype {value.dtype}")
        arr = value
    else:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise LedgerError(
                f"{where}: {name} must be a list of token ids, got {type(value).__name__}"
            )
        for i, tok in enumerate(value):
            if isinstance(tok, bool) or not isinstance(tok, int | np.integer):
                raise LedgerError(
                    f"{where}: {name}[{i}] must be an integer token id, got {short_repr(tok)}"
                )
        try:
            arr = np.asarray(value, dtype=np.int64) if len(value) else np.zeros(0, np.int64)
        except OverflowError:  # beyond int64: name the first token out of range
            i = next(i for i, t in enumerate(value) if not 0 <= int(t) <= MAX_TOKEN_ID)
            raise LedgerError(
                f"{where}: {name}[{i}] = {short_repr(value[i])} is not a token id "
                f"(0 <= id <= {MAX_TOKEN_ID})"
            ) from None
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            i = int(np.argmax(arr < 0))
            raise LedgerError(f"{where}: {name}[{i}] is negative ({int(arr[i])})")
        if hi > MAX_TOKEN_ID:
            i = int(np.argmax(arr > MAX_TOKEN_ID))
            raise LedgerError(f"{where}: {name}[{i}] = {int(arr[i])} exceeds int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


def as_logprobs(value: object, n: int, where: str) -> LogprobArray:
    """Convert logprobs to float32; there must be exactly one per output token, each <= 0."""
    name = "output_logprobs"
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "fiu":
            raise LedgerError(f"{where}: {name} must be a 1-D numeric array")
        arr = value.astype(np.float32, copy=False)
    else:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise LedgerError(
                f"{where}: {name} must be a list of numbers, got {type(value).__name__}"
            )
        for i, lp in enumerate(value):
            if isinstance(lp, bool) or not isinstance(lp, int | float | np.floating):
                raise LedgerError(f"{where}: {name}[{i}] must be a number, got {short_repr(lp)}")
        try:
            with np.errstate(over="ignore"):  # 1e300 becomes inf, refused below
                arr = np.asarray(value, np.float32) if len(value) else np.zeros(0, np.float32)
        except OverflowError:  # an int beyond float range
            i = next(i for i, lp in enumerate(value) if _finite(lp) is None)
            raise LedgerError(
                f"{where}: {name}[{i}] = {short_repr(value[i])} is not a log-probability "
                "(finite, <= 0)"
            ) from None
    if arr.shape[0] != n:
        raise LedgerError(
            f"{where}: {name} has {arr.shape[0]} entries but output_ids has {n} tokens; "
            "every output token needs exactly one logprob"
        )
    if arr.size:
        bad = ~np.isfinite(arr) | (arr > 1e-4)
        if bad.any():
            i = int(np.argmax(bad))
            raise LedgerError(
                f"{where}: {name}[{i}] = {float(arr[i])} is not a log-probability (finite, <= 0)"
            )
    return np.ascontiguousarray(arr, dtype=np.float32)


def _finite(value: object) -> float | None:
    """`value` as a finite float, or None when it is not a finite number (bools, NaN,
    infinities and ints beyond float range included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _check_time(value: object, name: str, where: str) -> float:
    t = _finite(value)
    if t is None:
        raise LedgerError(
            f"{where}: {name} must be a finite number (unix seconds), got {short_repr(value)}"
        )
    return t


def check_text(value: str, name: str, where: str) -> str:
    """Refuse a string that is not UTF-8 text (a lone surrogate such as "\\ud800", which
    JSON escapes allow but no stored text may hold)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise LedgerError(
            f"{where}: {name} holds a lone surrogate ({value[e.start]!r} at character "
            f"{e.start}), which is not UTF-8 text"
        ) from None
    return value


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_free_form(value: object, name: str, where: str) -> None:
    """Walk a free-form JSON value (metadata, sampling, tool_calls, details): every
    string (keys too) must be UTF-8 text and nesting at most `MAX_DEPTH` levels deep,
    so that what is stored can be encoded, hashed and read back. One pass without
    bookkeeping (the gateway's path); the bad value's place is found only on refusal."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if not _is_text(v):
                _refuse_text(value, name, where)
        elif isinstance(v, Mapping | list | tuple):
            if depth > MAX_DEPTH:
                raise LedgerError(f"{where}: {name} is nested more than {MAX_DEPTH} levels deep")
            if isinstance(v, Mapping):
                for k, item in v.items():
                    if isinstance(k, str) and not _is_text(k):
                        _refuse_text(value, name, where)
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in v)


def _refuse_text(value: object, at: str, where: str) -> None:
    """Raise naming the first string (or key) in `value` that is not UTF-8 text."""
    if isinstance(value, str):
        check_text(value, at, where)
    elif isinstance(value, Mapping):
        for k, item in value.items():
            if isinstance(k, str):
                check_text(k, f"a key of {at}", where)
            _refuse_text(item, f"{at}[{short_repr(k, 40)}]", where)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _refuse_text(item, f"{at}[{i}]", where)


def _check_json_obj(value: object, name: str, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise LedgerError(f"{where}: {name} must be an object, got {type(value).__name__}")
    check_free_form(value, name, where)
    return dict(value)


# long by design: the JSONL contract checked field by field, two statements a field
def make_call(data: Mapping[str, Any]) -> Call:  # noqa: PLR0915
    """Build a validated `Call` from a JSON-like mapping (the JSONL contract's fields).

    Raises `LedgerError` naming the call and the field on any problem.
    """
    if not isinstance(data, Mapping):
        raise LedgerError(f"a call must be a JSON object, got {type(data).__name__}")
    sid, cid = data.get("session_id"), data.get("call_id")
    where = _where(sid, cid)
    required = (
        "session_id", "call_id", "role", "prompt_ids", "output_ids", "output_logprobs",
        "output_text", "policy_version", "finish_reason", "started_at", "ended_at",
    )
    missing = [k for k in required if k not in data]
    if missing:
        raise LedgerError(f"{where}: missing required field(s) {', '.join(missing)}")
    sid = check_id(sid, "session_id", where)
    cid = check_id(cid, "call_id", where)
    role = data["role"]
    if not isinstance(role, str) or not ROLE_PATTERN.match(role):
        raise LedgerError(
            f"{where}: role must be a lowercase name like 'main', got {short_repr(role)}"
        )
    prompt_ids = as_ids(data["prompt_ids"], "prompt_ids", where)
    output_ids = as_ids(data["output_ids"], "output_ids", where)
    logprobs = as_logprobs(data["output_logprobs"], int(output_ids.shape[0]), where)
    text = data["output_text"]
    if not isinstance(text, str):
        raise LedgerError(f"{where}: output_text must be a string, got {type(text).__name__}")
    check_text(text, "output_text", where)
    pv = data["policy_version"]
    if isinstance(pv, bool) or not isinstance(pv, int) or not 0 <= pv <= MAX_INT:
        raise LedgerError(
            f"{where}: policy_version must be a non-negative integer below 2^63, "
            f"got {short_repr(pv)}"
        )
    fr = data["finish_reason"]
    if not isinstance(fr, str) or not fr:
        raise LedgerError(
            f"{where}: finish_reason must be a non-empty string, got {short_repr(fr)}"
        )
    check_text(fr, "finish_reason", where)
    started = _check_time(data["started_at"], "started_at", where)
    ended = _check_time(data["ended_at"], "ended_at", where)
    if ended < started:
        raise LedgerError(f"{where}: ended_at ({ended}) is before started_at ({started})")
    raw = data.get("raw_tool_calls")
    if raw is not None:
        if not isinstance(raw, str):
            raise LedgerError(
                f"{where}: raw_tool_calls must be a string or null, got {short_repr(raw)}"
            )
        check_text(raw, "raw_tool_calls", where)
    tool_calls = data.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list) or not all(isinstance(t, Mapping) for t in tool_calls):
            raise LedgerError(f"{where}: tool_calls must be a list of objects or null")
        check_free_form(tool_calls, "tool_calls", where)
        tool_calls = [dict(t) for t in tool_calls]
    pcid, psid = data.get("parent_call_id"), data.get("parent_session_id")
    if pcid is not None:
        check_id(pcid, "parent_call_id", where)
    if psid is not None:
        check_id(psid, "parent_session_id", where)
    if psid == sid:
        raise LedgerError(f"{where}: parent_session_id equals the call's own session_id")
    if pcid == cid:
        raise LedgerError(f"{where}: parent_call_id points at the call itself")
    task_id = data.get("task_id")
    if task_id is not None:
        check_id(task_id, "task_id", where)
    messages = _objects(data.get("messages"), "messages", where)
    if messages is not None and not all(isinstance(m.get("role"), str) for m in messages):
        raise LedgerError(f"{where}: every message must have a role")
    tools = _objects(data.get("tools"), "tools", where)
    return Call(
        session_id=sid,
        call_id=cid,
        role=role,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        output_logprobs=logprobs,
        output_text=text,
        policy_version=pv,
        finish_reason=fr,
        started_at=started,
        ended_at=ended,
        raw_tool_calls=raw,
        tool_calls=tool_calls,
        parent_call_id=pcid,
        parent_session_id=psid,
        task_id=task_id,
        sampling=_check_json_obj(data.get("sampling") or {}, "sampling", where),
        metadata=_check_json_obj(data.get("metadata") or {}, "metadata", where),
        messages=messages,
        tools=tools,
    )


def _objects(value: Any, name: str, where: str) -> list[dict[str, Any]] | None:
    """A list of JSON objects (or None). Only its shape is checked here, not every value
    (a call's messages are its whole request: a deep check on every call would cost the
    square of a session's length); the store's canonical JSON refuses what is not JSON."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise LedgerError(f"{where}: {name} must be a list of objects or null")
    return [v if type(v) is dict else dict(v) for v in value]


def validate_call(call: Call) -> Call:
    """Re-validate a `Call` built in code (the gateway's path); returns a normalised copy.

    Arrays are checked in place (no list round trip), so this stays cheap for 1M-token
    prompts."""
    return make_call(call_to_dict(call, as_lists=False))


def make_outcome(data: Mapping[str, Any]) -> Outcome:
    """Build a validated `Outcome` from a JSON-like mapping."""
    if not isinstance(data, Mapping):
        raise LedgerError(f"an outcome must be a JSON object, got {type(data).__name__}")
    sid = data.get("session_id")
    where = f"outcome of session {short_repr(sid)}"
    for k in ("session_id", "status", "reward"):
        if k not in data:
            raise LedgerError(f"{where}: missing required field {k}")
    sid = check_id(sid, "session_id", where)
    try:
        status = Status(data["status"])
    except ValueError:
        allowed = ", ".join(s.value for s in Status)
        raise LedgerError(
            f"{where}: unknown status {short_repr(data['status'])} (expected one of {allowed})"
        ) from None
    reward = _finite(data["reward"])
    if reward is None:
        raise LedgerError(
            f"{where}: reward must be a finite number, got {short_repr(data['reward'])}"
        )
    raw_partial = data.get("partial_score", 0.0)
    partial = _finite(raw_partial)
    if partial is None or not 0.0 <= partial <= 1.0:
        raise LedgerError(
            f"{where}: partial_score must be a number in [0, 1], got {short_repr(raw_partial)}"
        )
    details = _check_json_obj(data.get("details") or {}, "details", where)
    recorded = data.get("recorded_at", 0.0)
    return Outcome(
        session_id=sid,
        status=status,
        reward=reward,
        partial_score=partial,
        details=details,
        recorded_at=_check_time(recorded, "recorded_at", where),
    )


# ------------------------------------------------------------------------ serialisation


def call_to_dict(call: Call, *, as_lists: bool = True) -> dict[str, Any]:
    """The JSONL contract's field layout (see docs/ledger.md). With `as_lists=False`
    the token arrays stay numpy arrays."""

    def conv(a: np.ndarray) -> Any:
        return a.tolist() if as_lists else a

    return {
        "type": "call",
        "session_id": call.session_id,
        "call_id": call.call_id,
        "role": call.role,
        "task_id": call.task_id,
        "parent_call_id": call.parent_call_id,
        "parent_session_id": call.parent_session_id,
        "prompt_ids": conv(call.prompt_ids),
        "output_ids": conv(call.output_ids),
        # Shortest decimal that parses back to the same float32: exact and readable.
        "output_logprobs": (
            call.output_logprobs.astype(str).astype(np.float64).tolist()
            if as_lists
            else call.output_logprobs
        ),
        "output_text": call.output_text,
        "raw_tool_calls": call.raw_tool_calls,
        "tool_calls": call.tool_calls,
        "policy_version": call.policy_version,
        "finish_reason": call.finish_reason,
        "started_at": call.started_at,
        "ended_at": call.ended_at,
        "sampling": call.sampling,
        "metadata": call.metadata,
        "messages": call.messages,
        "tools": call.tools,
    }


def outcome_to_dict(outcome: Outcome) -> dict[str, Any]:
    return {
        "type": "outcome",
        "session_id": outcome.session_id,
        "status": outcome.status.value,
        "reward": outcome.reward,
        "partial_score": outcome.partial_score,
        "details": outcome.details,
        "recorded_at": outcome.recorded_at,
    }
