"""Token-in-token-out prompt assembly.

For each session the gateway keeps a `RecordedTurn` per assistant turn it produced: the
exact output token ids, the content and tool calls it returned (with the tool-call ids
it issued), the message position the turn occupies and a fingerprint of the history it
followed. A new request is assembled by `assemble_prompt`:

1. Each assistant message in the request is matched to a recorded turn: by the tool-call
   ids it carries (issued by this gateway, unique); else by content and tool-call values
   under cosmetic normalisation; else, when a recorded turn sits at the same position
   after the same history, it is that turn edited.
2. Each match is compared field by field (`tidal.gateway.drift.compare_turn`); tool
   results after it are checked for ids and order. Cosmetic drift keeps the turn the
   model's; an edit makes it the client's.
3. The conversation is rendered through the chat template and cut into blocks
   (`tidal.gateway.render`). The prompt is the concatenation of: for a model turn, the
   assistant header ids + the recorded output ids + the closing ids (`<|im_end|>\\n`,
   or only `\\n` when the output already ended with `<|im_end|>`); for every other block,
   the template text's token ids.

When the history before the latest model turn is unchanged, the recorded context
(prompt + output) of that turn's call is then exactly a prefix of the new prompt: the
call "continues" it, and `tidal verify` re-checks this from the ledger.

Deliberately simplified: the recorded turns live in the gateway process's memory (a
restart forgets them; earlier assistant messages are then rendered from text and counted
as foreign turns in the call's metadata); a length-truncated output gets the closing
ids appended as prompt tokens.
"""

from __future__ import annotations

import ast
import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.gateway.drift import (
    FORK,
    DriftRecord,
    RecordedToolCall,
    check_tool_results,
    compare_turn,
    strip_thinking,
)
from tidal.gateway.messages import Message, message_fingerprint, tools_fingerprint
from tidal.gateway.render import Block, Renderer


@dataclass(frozen=True, eq=False)
class RecordedTurn:
    call_id: str
    position: int  # index the turn takes in the conversation (= messages in its request)
    prefix_fp: bytes  # fingerprint of the tools + the messages before it
    prompt_len: int
    output_ids: npt.NDArray[np.int32]
    content: str | None
    tool_calls: tuple[RecordedToolCall, ...]


def _canon_args(args: object) -> str:
    if isinstance(args, str):
        text = args
        try:
            args = json.loads(text)
        except json.JSONDecodeError:
            try:
                args = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return text
    return json.dumps(args, sort_keys=True, ensure_ascii=False, default=repr)


def turn_key(content: str | None, calls: Sequence[tuple[str, object]]) -> str:
    """A key that survives cosmetic drift: whitespace, thinking, key order, literals."""
    text = " ".join(strip_thinking(content or "").split())
    return json.dumps([text, sorted((n, _canon_args(a)) for n, a in calls)])


class SessionTurns:
    """The recorded turns of one session (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_call: dict[str, RecordedTurn] = {}
        self.by_tool_id: dict[str, str] = {}
        self.by_position: dict[int, list[str]] = {}
        self.by_key: dict[str, list[str]] = {}

    def add(self, turn: RecordedTurn) -> None:
        key = turn_key(turn.content, [(c.name, c.arguments) for c in turn.tool_calls])
        with self._lock:
            self.by_call[turn.call_id] = turn
            for c in turn.tool_calls:
                self.by_tool_id[c.id] = turn.call_id
            self.by_position.setdefault(turn.position, []).append(turn.call_id)
            self.by_key.setdefault(key, []).append(turn.call_id)

    def find(self, index: int, msg: Message, prefix_fp: bytes) -> tuple[RecordedTurn | None, bool]:
        """(turn, matched_by_identity). Identity = ids or cosmetic-equal content; a turn
        found only by position + same history is returned with False (an edit)."""
        with self._lock:
            for c in msg.tool_calls:
                cid = self.by_tool_id.get(c.id or "")
                if cid is not None:
                    return self.by_call[cid], True
            if not msg.tool_calls:  # fast path: the exact text this gateway returned
                for cid in reversed(self.by_position.get(index, [])):
                    t = self.by_call[cid]
                    if not t.tool_calls and t.content == msg.content and t.prefix_fp == prefix_fp:
                        return t, True
            key = turn_key(msg.content, [(c.name, c.arguments) for c in msg.tool_calls])
            cands = self.by_key.get(key, [])
            if cands:
                same = [c for c in cands if self.by_call[c].position == index]
                return self.by_call[(same or cands)[-1]], True
            for cid in reversed(self.by_position.get(index, [])):
                t = self.by_call[cid]
                if t.prefix_fp == prefix_fp:
                    return t, False
        return None, False


@dataclass(frozen=True)
class Spliced:
    call_id: str
    message_index: int
    offset: int  # where the recorded output ids start in the new prompt
    length: int


@dataclass(frozen=True, eq=False)
class PromptPlan:
    prompt_ids: npt.NDArray[np.int32]
    spliced: tuple[Spliced, ...]
    drift: tuple[DriftRecord, ...]
    continues: str | None  # call whose whole context is a prefix of this prompt
    base_hint: str | None
    foreign_turns: int  # assistant messages this gateway did not produce
    prefix_fp: bytes  # fingerprint of tools + all messages: the new turn's history
    extra: dict[str, Any] = field(default_factory=dict)

    def metadata(self) -> dict[str, Any]:
        return {
            "tito": {
                "spliced": [[s.call_id, s.message_index, s.offset, s.length] for s in self.spliced],
                "continues": self.continues,
                "foreign_turns": self.foreign_turns,
            },
            "drift": [d.to_dict() for d in self.drift],
        }


def _fp_step(h: Any, m: Message) -> Any:
    h = h.copy()
    h.update(message_fingerprint(m))
    return h


def assemble_prompt(
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None,
    turns: SessionTurns,
    renderer: Renderer,
) -> PromptPlan:
    """Build the prompt ids for a request (see the module docstring)."""
    h = hashlib.blake2b(tools_fingerprint(tools), digest_size=16)
    fps: list[bytes] = []
    matches: dict[int, RecordedTurn] = {}
    drift: list[DriftRecord] = []
    foreign = 0
    for i, m in enumerate(messages):
        fps.append(h.digest())
        if m.role == "assistant":
            turn, identity = turns.find(i, m, fps[i])
            if turn is None:
                foreign += 1
            else:
                recs = compare_turn(
                    i,
                    call_id=turn.call_id,
                    rec_content=turn.content,
                    rec_calls=turn.tool_calls,
                    cli_content=m.content,
                    cli_calls=m.tool_calls,
                )
                if not identity and not any(r.kind == "edited" for r in recs):
                    recs.append(
                        DriftRecord(
                            "edited",
                            i,
                            turn.call_id,
                            m.content or "",
                            turn.content or "",
                            "client_text_as_prompt",
                        )
                    )
                edited = any(r.kind == "edited" for r in recs)
                if not edited:
                    if turn.position != i or turn.prefix_fp != fps[i]:
                        recs.append(
                            DriftRecord(
                                "history_rewritten",
                                i,
                                turn.call_id,
                                f"message index {i}",
                                f"message index {turn.position}",
                                FORK,
                                "the messages before this turn changed since it was produced",
                            )
                        )
                    matches[i] = turn
                drift.extend(recs)
                if turn.tool_calls:
                    results: list[tuple[int, str | None]] = []
                    j = i + 1
                    while j < len(messages) and messages[j].role == "tool":
                        results.append((j, messages[j].tool_call_id))
                        j += 1
                    if results:
                        drift.extend(check_tool_results(turn.call_id, turn.tool_calls, results))
        h = _fp_step(h, m)
    # Matched turns are replaced by recorded tokens: render a placeholder in their place, so
    # that whatever the client did to their text cannot disturb the block structure.
    to_render = [Message("assistant", "-") if i in matches else m for i, m in enumerate(messages)]
    blocks = renderer.blocks(to_render, tools)
    return _splice(blocks, matches, renderer, drift=drift, foreign=foreign, final_fp=h.digest())


def _splice(
    blocks: list[Block],
    matches: dict[int, RecordedTurn],
    renderer: Renderer,
    *,
    drift: list[DriftRecord],
    foreign: int,
    final_fp: bytes,
) -> PromptPlan:
    pieces: list[npt.NDArray[np.int32]] = []
    spliced: list[Spliced] = []
    n = 0
    end_id = renderer.block_end_ids[0]
    for b in blocks:
        turn = matches.get(b.first) if b.role == "assistant" and not b.generation else None
        if turn is None:
            ids = renderer.encode_array(b.text)
            pieces.append(ids)
            n += int(ids.shape[0])
            continue
        out = turn.output_ids
        closing = (
            renderer.separator_array
            if out.size and int(out[-1]) == end_id
            else renderer.closing_array
        )
        pieces.append(renderer.header_array)
        n += len(renderer.header_ids)
        spliced.append(Spliced(turn.call_id, b.first, n, int(out.shape[0])))
        pieces.append(out)
        pieces.append(closing)
        n += int(out.shape[0]) + len(closing)
    prompt = np.concatenate(pieces).astype(np.int32, copy=False)
    continues = base = None
    if spliced:
        last = spliced[-1]
        base = last.call_id
        t = matches[last.message_index]
        if last.offset == t.prompt_len and not any(
            d.kind == "history_rewritten" and d.call_id == t.call_id for d in drift
        ):
            continues = t.call_id
    return PromptPlan(prompt, tuple(spliced), tuple(drift), continues, base, foreign, final_fp)
