"""Recording: what a generation becomes, and the ledger call that keeps it.

`shape_output` cuts a generation at the first stop string (the recorded output ends with
the token that completes it: what was sampled up to there, exactly) and parses its tool
calls; `chat_call` is the ledger's `Call` of a chat turn, with the metadata a restarted
gateway needs to rebuild the turn (`metadata.turn`) and what the request asked. Pure:
the gateway commits the call and remembers the turn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.engine.base import Generation, SamplingParams
from tidal.gateway.drift import DriftRecord, RecordedToolCall
from tidal.gateway.request import ChatRequest
from tidal.gateway.tito import PromptPlan
from tidal.gateway.toolcalls import ParsedOutput
from tidal.ledger.types import Call

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class Output:
    """A generation as recorded: its ids and logprobs (cut at a stop string), the text
    shown before that string (without the final stop token), the finish reason the API
    reports before tool calls are counted, and the stop string that ended it."""

    ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    text: str
    finish: str
    stop_sequence: str | None


def shape_output(gen: Generation, stop_token_ids: Sequence[int], stops: tuple[str, ...],
                 decode: Decode) -> Output:
    """The output a generation records: cut after the token that completes the first of
    `stops` found in its text."""
    ids, logprobs = gen.output_ids, gen.logprobs
    ends_stop = (gen.finish_reason == "stop" and ids.size > 0
                 and int(ids[-1]) in stop_token_ids)
    visible = ids[:-1] if ends_stop else ids
    text = decode(visible.tolist())
    if stops:
        cut = cut_at_stop(visible, text, stops, decode)
        if cut is not None:
            n_keep, text, stop = cut
            return Output(ids[:n_keep], logprobs[:n_keep], text, "stop", stop)
    return Output(ids, logprobs, text, gen.finish_reason, None)


def cut_at_stop(visible: npt.NDArray[np.int32], text: str, stops: tuple[str, ...],
                decode: Decode) -> tuple[int, str, str] | None:
    """Where the first stop string ends the output: (tokens kept, the text before the
    stop string, the stop string), or None. The tokens kept are the fewest whose text
    holds the whole stop string: what was sampled up to there, exactly."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return None
    pos, stop = min(hits)
    lo, hi = 1, int(visible.shape[0])
    while lo < hi:  # fewest tokens whose decoded text contains text[: pos + len(stop)]
        mid = (lo + hi) // 2
        if len(decode(visible[:mid].tolist())) >= pos + len(stop):
            hi = mid
        else:
            lo = mid + 1
    return lo, text[:pos], stop


@dataclass(frozen=True)
class Turn:
    """Who a chat call belongs to and when it ran."""

    session_id: str
    call_id: str
    role: str
    parent_call: str | None
    parent_session: str | None
    task_id: str | None
    started: float
    ended: float


def call_metadata(request: ChatRequest, plan: PromptPlan, new_drift: Sequence[DriftRecord],
                  out: Output, parsed: ParsedOutput, *, endpoint: str,
                  extra: Mapping[str, Any]) -> dict[str, Any]:
    """A chat call's ledger metadata: the prompt plan's (splices, drift not stored
    before), the request's shape, the tool-call formats seen, a parse failure, and the
    turn a restarted gateway rebuilds (`metadata.turn`; its content only when it is not
    the output's text)."""
    meta = plan.metadata(new_drift)
    meta["request"] = {
        "endpoint": endpoint,
        "n_messages": len(request.messages),
        "tools": sorted(request.tool_names),
        "tool_choice": request.tool_choice_record(),
    }
    meta["tool_call_formats"] = sorted({t.format for t in parsed.tool_calls})
    if parsed.unparsed is not None:
        meta["tool_parse"] = {"status": "unparsed", "reason": parsed.unparsed}
    meta["turn"] = {"position": len(request.messages), "history": plan.prefix_fp.hex()}
    if parsed.content != (out.text or None) or out.stop_sequence is not None:
        meta["turn"]["content"] = parsed.content
    if out.stop_sequence is not None:
        meta["stop_sequence"] = out.stop_sequence
    meta.update(extra)
    return meta


def chat_call(turn: Turn, plan: PromptPlan, gen: Generation, out: Output, *,
              parsed: ParsedOutput, tool_calls: Sequence[RecordedToolCall],
              sampling: dict[str, Any], metadata: dict[str, Any], decode: Decode,
              messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Call:
    """The ledger call of a chat turn; `messages` and `tools` the request's
    (`message_record`)."""
    return Call(
        session_id=turn.session_id,
        call_id=turn.call_id,
        role=turn.role,
        prompt_ids=plan.prompt_ids,
        output_ids=out.ids,
        output_logprobs=out.logprobs,
        output_text=decode(out.ids.tolist()),
        policy_version=int(gen.policy_version),
        finish_reason=gen.finish_reason if out.stop_sequence is None else "stop",
        started_at=turn.started,
        ended_at=turn.ended,
        raw_tool_calls=parsed.raw_tool_calls,
        tool_calls=[{"id": t.id, "name": t.name, "arguments": t.arguments}
                    for t in tool_calls] or None,
        parent_call_id=turn.parent_call,
        parent_session_id=turn.parent_session,
        task_id=turn.task_id,
        sampling=sampling,
        metadata=metadata,
        messages=messages,
        tools=tools,
    )


def sampling_record(params: SamplingParams) -> dict[str, Any]:
    """What the ledger keeps of a call's sampling parameters."""
    return {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "stop_token_ids": list(params.stop_token_ids),
    }
