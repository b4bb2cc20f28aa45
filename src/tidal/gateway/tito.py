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

Incremental assembly: a session's next request usually repeats the previous one's
messages and appends a few. Each session keeps its last two assembled requests (`Seen`):
the messages' JSON text, the parsed messages, the history fingerprints, the matching
results and drift, the blocks and the prompt ids. A request whose messages' JSON text
extends a kept one's at a message boundary, with the same tools, resumes from it: only
the new messages are parsed, fingerprinted and matched, and only the tail is rendered
(`Renderer.extend_blocks`) and spliced. The result is the full assembly's, exactly;
`tests/gateway/test_pure.py` compares the two. The kept matching is redone in full when a
turn recorded since could change it (one at a position inside the kept prefix, one that
carries a tool-call id of the prefix, or one whose content key equals that of a prefix
message matched only by key, by position, or not at all), and when the new messages start
with a tool result (it may extend the prefix's last run of results); the kept render is
dropped when the turns matched in the prefix differ. Requests whose tool-call arguments
are objects rather than JSON strings are not kept (their JSON text does not pin every
detail the template renders).

The recorded turns live in the gateway process's memory; a session it does not hold is
rebuilt from the ledger on first use (`SessionTurns.load_once`, `Gateway._load_turns`), so
a restart forgets nothing. Deliberately simplified: a length-truncated output (or one cut
at a stop string) gets the closing ids appended as prompt tokens.
"""

from __future__ import annotations

import ast
import hashlib
import json
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.gateway.drift import (
    FORK,
    PLAIN_TEXT,
    DriftRecord,
    RecordedToolCall,
    check_tool_results,
    compare_turn,
    drift_key,
    strip_thinking,
)
from tidal.gateway.messages import Message, message_fingerprint, tools_fingerprint
from tidal.gateway.render import Block, Renderer

_PLACEHOLDER = Message("assistant", "-")
_KEPT_REQUESTS = 2  # assembled requests a session keeps for its next ones


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
    """Arguments in one canonical JSON form; text nested too deeply to parse (a model
    may write it; clients' is refused at parse time) stays as it is."""
    text = args if isinstance(args, str) else None
    if text is not None:
        try:
            args = json.loads(text)
        except RecursionError:
            return text
        except ValueError:  # not JSON (or a number Python will not convert)
            try:
                args = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return text
    try:
        return json.dumps(args, sort_keys=True, ensure_ascii=False, default=repr)
    except RecursionError:
        return text if text is not None else repr(args)


def turn_key(content: str | None, calls: Sequence[tuple[str, object]]) -> str:
    """A key that survives cosmetic drift: whitespace (also text split into blocks or
    merged), thinking, key order, literals."""
    text = "".join(strip_thinking(content or "").split())
    return json.dumps([text, sorted((n, _canon_args(a)) for n, a in calls)])


class SessionTurns:
    """The recorded turns of one session, and its last assembled requests (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_call: dict[str, RecordedTurn] = {}
        self.by_tool_id: dict[str, str] = {}
        self.by_position: dict[int, list[str]] = {}
        self.by_key: dict[str, list[str]] = {}
        self._added: list[tuple[RecordedTurn, str]] = []  # (turn, key) in order of adding
        self._seen: deque[Seen] = deque(maxlen=_KEPT_REQUESTS)
        self._stored_drift: set[tuple[Any, ...]] = set()  # drift_key of stored records
        self._load_lock = threading.Lock()
        self._loaded = False
        # (task_id, parent_session_id) of the session's first call, as the ledger's
        # sessions row keeps them; None while the session has no call
        self.row: tuple[str | None, str | None] | None = None
        self._calls = 0  # calls generated for the session (recorded ones, on a reload)

    def next_call(self) -> int:
        """The index of the session's next generated call (0, 1, ...): what a seeded
        run's sampling seed derives from (`tidal.gateway.core.call_seed`)."""
        with self._lock:
            self._calls += 1
            return self._calls - 1

    def note_calls(self, n: int) -> None:
        """The session already has `n` recorded calls (read back from the ledger)."""
        with self._lock:
            self._calls = max(self._calls, n)

    def note_row(self, task_id: str | None, parent_session_id: str | None) -> None:
        """The session's first call is stored (or read back): its ids bind the session."""
        with self._lock:
            if self.row is None:
                self.row = (task_id, parent_session_id)

    def load_once(self, load: Callable[[SessionTurns], None]) -> None:
        """Run `load(self)` once, before any use of the turns (a restarted gateway
        rebuilds a session from the ledger); concurrent callers wait for it."""
        if self._loaded:
            return
        with self._load_lock:
            if not self._loaded:
                load(self)
                self._loaded = True

    def note_stored(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Drift records already in the ledger (as `DriftRecord.to_dict` wrote them)."""
        with self._lock:
            self._stored_drift.update(drift_key(d) for d in records)

    def unstored_drift(self, records: Sequence[DriftRecord]) -> list[DriftRecord]:
        """The records not yet stored for this session (a drifted turn is sent back with
        every later request; it is one event, recorded by the first call that saw it)."""
        with self._lock:
            return [d for d in records if drift_key(d.to_dict()) not in self._stored_drift]

    def note_stored_drift(self, records: Sequence[DriftRecord]) -> None:
        with self._lock:
            self._stored_drift.update(drift_key(d.to_dict()) for d in records)

    @property
    def version(self) -> int:
        """How many turns were added so far."""
        return len(self._added)

    def added_since(self, version: int) -> list[tuple[RecordedTurn, str]]:
        with self._lock:
            return self._added[version:]

    def add(self, turn: RecordedTurn) -> None:
        key = turn_key(turn.content, [(c.name, c.arguments) for c in turn.tool_calls])
        with self._lock:
            self.by_call[turn.call_id] = turn
            for c in turn.tool_calls:
                self.by_tool_id[c.id] = turn.call_id
            self.by_position.setdefault(turn.position, []).append(turn.call_id)
            self.by_key.setdefault(key, []).append(turn.call_id)
            self._added.append((turn, key))

    def remember(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    def seen_prefix(self, text: str) -> Seen | None:
        """The longest kept request whose messages are a prefix of (or equal to) those
        whose JSON text is `text` (`tidal.gateway.messages.messages_text`)."""
        with self._lock:
            kept = list(self._seen)
        best: Seen | None = None
        for s in kept:
            k = len(s.text)
            # "[m0,m1]" vs "[m0,m1,m2]": equal up to "]", then the "," of a next message
            if (
                text == s.text or (text.startswith(s.text[:-1]) and text[k - 1 : k] == ",")
            ) and (best is None or k > len(best.text)):
                best = s
        return best

    def find(self, index: int, msg: Message, prefix_fp: bytes) -> tuple[RecordedTurn | None, bool]:
        """(turn, matched_by_identity). Identity = ids or cosmetic-equal content; a turn
        found only by position + same history is returned with False (an edit)."""
        turn, identity, _ = self.find_how(index, msg, prefix_fp)
        return turn, identity

    def find_how(
        self, index: int, msg: Message, prefix_fp: bytes
    ) -> tuple[RecordedTurn | None, bool, str]:
        """`find`, plus how: "id", "exact" (same text at the same place after the same
        history), "key" (cosmetic-equal content), "position" or "none"."""
        with self._lock:
            for c in msg.tool_calls:
                cid = self.by_tool_id.get(c.id or "")
                if cid is not None:
                    return self.by_call[cid], True, "id"
            if not msg.tool_calls:  # fast path: the exact text this gateway returned
                for cid in reversed(self.by_position.get(index, [])):
                    t = self.by_call[cid]
                    if not t.tool_calls and t.content == msg.content and t.prefix_fp == prefix_fp:
                        return t, True, "exact"
            key = turn_key(msg.content, [(c.name, c.arguments) for c in msg.tool_calls])
            cands = self.by_key.get(key, [])
            if cands:
                same = [c for c in cands if self.by_call[c].position == index]
                return self.by_call[(same or cands)[-1]], True, "key"
            for cid in reversed(self.by_position.get(index, [])):
                t = self.by_call[cid]
                if t.prefix_fp == prefix_fp:
                    return t, False, "position"
        return None, False, "none"


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
    continued_end: int = 0  # length of the continued call's context (0: continues none)
    extra: dict[str, Any] = field(default_factory=dict)

    def metadata(self, drift: Sequence[DriftRecord]) -> dict[str, Any]:
        """What the ledger keeps of the plan. `spliced` lists only the turns spliced
        after the continued call's context: those inside it are vouched for by that
        call's own record (`tidal verify` checks the whole context is this prompt's
        prefix), so the header stays the same size however long the session grows.
        `drift` is what the caller passes: the records not yet stored for the session."""
        end = self.continued_end
        return {
            "tito": {
                "spliced": [[s.call_id, s.message_index, s.offset, s.length]
                            for s in self.spliced if s.offset >= end],
                "continues": self.continues,
                "foreign_turns": self.foreign_turns,
            },
            "drift": [d.to_dict() for d in drift],
        }


@dataclass(frozen=True, eq=False)
class Seen:
    """One assembled request, kept so that the session's next request can resume from it
    (see the module docstring). Never mutated; `final` is copied before it is extended."""

    text: str  # the messages' JSON text
    tools_fp: bytes
    messages: tuple[Message, ...]
    fps: tuple[bytes, ...]  # history fingerprint before each message
    final: Any  # the fingerprint hash after all messages
    version: int  # turns the session had when the matching ran
    matches: Mapping[int, RecordedTurn]
    loose: frozenset[str]  # keys of assistant messages matched by neither id nor exact text
    tool_ids: frozenset[str]  # tool-call ids the assistant messages carry
    drift: tuple[DriftRecord, ...]
    foreign: int
    blocks: tuple[Block, ...]
    offsets: tuple[int, ...]  # where each block starts in the prompt
    n_spliced: tuple[int, ...]  # spliced turns before each block
    prompt_ids: npt.NDArray[np.int32]
    spliced: tuple[Spliced, ...]
    specials: tuple[DriftRecord, ...] = ()  # `special_text_drift` of the messages


def _args_are_text(messages: Sequence[Message]) -> bool:
    return all(isinstance(c.arguments, str) for m in messages for c in m.tool_calls)


def _still_matches(base: Seen, turns: SessionTurns, messages: Sequence[Message]) -> bool:
    """Would matching the kept prefix again give the kept result?"""
    n0 = len(base.messages)
    if n0 < len(messages) and messages[n0].role == "tool":
        return False
    for turn, key in turns.added_since(base.version):
        if (
            turn.position < n0
            or key in base.loose
            or any(c.id in base.tool_ids for c in turn.tool_calls)
        ):
            return False
    return True


# long by design: one pass of the splicing algorithm (docs/gateway.md), its steps sharing locals
def assemble_prompt(  # noqa: PLR0915
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None,
    turns: SessionTurns,
    renderer: Renderer,
    *,
    text: str | None = None,
    base: Seen | None = None,
) -> PromptPlan:
    """Build the prompt ids for a request (see the module docstring). `text`: the JSON
    text of the request's messages (`messages_text`); with it the assembly is kept for the
    session's next requests. `base`: a kept request whose messages are a prefix of these
    (`SessionTurns.seen_prefix(text)`), to resume from."""
    tools_fp = tools_fingerprint(tools)
    n_msgs = len(messages)
    use = base if base is not None and base.tools_fp == tools_fp else None
    n0 = len(use.messages) if use is not None else 0
    if use is not None:
        fps = list(use.fps)
        h = use.final.copy()
    else:
        fps = []
        h = hashlib.blake2b(tools_fp, digest_size=16)
    for m in messages[n0:]:
        fps.append(h.digest())
        h.update(message_fingerprint(m))

    version = turns.version
    matches: dict[int, RecordedTurn] = {}
    drift: list[DriftRecord] = []
    foreign = 0
    loose: set[str] = set()
    tool_ids: set[str] = set()
    start = 0
    if use is not None and _still_matches(use, turns, messages):
        start = n0
        matches = dict(use.matches)
        drift = list(use.drift)
        foreign = use.foreign
        loose = set(use.loose)
        tool_ids = set(use.tool_ids)
    for i in range(start, n_msgs):
        m = messages[i]
        if m.role != "assistant":
            continue
        tool_ids.update(c.id for c in m.tool_calls if c.id)
        turn, identity, how = turns.find_how(i, m, fps[i])
        if how not in ("id", "exact"):
            loose.add(turn_key(m.content, [(c.name, c.arguments) for c in m.tool_calls]))
        if turn is None:
            foreign += 1
            continue
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
            while j < n_msgs and messages[j].role == "tool":
                results.append((j, messages[j].tool_call_id))
                j += 1
            if results:
                drift.extend(check_tool_results(turn.call_id, turn.tool_calls, results))

    # Matched turns are replaced by recorded tokens: render a placeholder in their place, so
    # that whatever the client did to their text cannot disturb the block structure.
    to_render = [_PLACEHOLDER if i in matches else m for i, m in enumerate(messages)]
    if use is not None and start == n0:  # the kept prefix's matches, hence its placeholders
        specials = [*use.specials, *special_text_drift(to_render, None, renderer, start=n0)]
    else:
        specials = special_text_drift(to_render, tools, renderer)
    blocks: list[Block] | None = None
    keep = 0
    if use is not None and (
        start == n0 or frozenset(k for k in matches if k < n0) == use.matches.keys()
    ):
        blocks = renderer.extend_blocks(use.blocks, to_render, tools)
        keep = len(use.blocks) - 2
    if blocks is None:
        blocks = renderer.blocks(to_render, tools)
        keep = 0
    plan, offsets, n_spliced = _splice(
        blocks,
        matches,
        renderer,
        drift=[*drift, *specials],
        foreign=foreign,
        final_fp=h.digest(),
        resume=use if keep else None,
        keep=keep,
    )
    checked = len(base.messages) if base is not None else 0
    if text is not None and _args_are_text(messages[checked:]):
        turns.remember(
            Seen(
                text,
                tools_fp,
                tuple(messages),
                tuple(fps),
                h,
                version,
                matches,
                frozenset(loose),
                frozenset(tool_ids),
                tuple(drift),
                foreign,
                tuple(blocks),
                offsets,
                n_spliced,
                plan.prompt_ids,
                plan.spliced,
                tuple(specials),
            )
        )
    return plan


def special_text_drift(
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None,
    renderer: Renderer,
    *,
    start: int = 0,
) -> list[DriftRecord]:
    """A `special_token_text` record for the tools and for each message from `start` on
    rendered from client text (the placeholders of matched turns are not), when their text
    holds a special token's text: it is tokenized as plain text (`tidal.gateway.render`)."""
    found = renderer.special_texts_in
    out = []
    if tools:
        texts = found(json.dumps(tools, ensure_ascii=False))
        if texts:
            out.append(_special_record(-1, [("tools", texts)]))
    for i in range(start, len(messages)):
        m = messages[i]
        if m is _PLACEHOLDER:
            continue
        fields = [("content", m.content or "")]
        for k, c in enumerate(m.tool_calls):
            args = c.arguments if isinstance(c.arguments, str) else json.dumps(
                c.arguments, ensure_ascii=False
            )
            fields += [(f"tool_calls[{k}].function.name", c.name),
                       (f"tool_calls[{k}].function.arguments", args)]
        hits = [(where, found(text)) for where, text in fields]
        if any(texts for _, texts in hits):
            out.append(_special_record(i, hits))
    return out


def _special_record(index: int, hits: Sequence[tuple[str, list[str]]]) -> DriftRecord:
    texts = list(dict.fromkeys(t for _, ts in hits for t in ts))
    where = ", ".join(w for w, ts in hits if ts)
    return DriftRecord(
        "special_token_text", index, None, " ".join(texts), "", PLAIN_TEXT,
        f"special-token text in {where}, tokenized as plain text",
    )


def _splice(
    blocks: list[Block],
    matches: dict[int, RecordedTurn],
    renderer: Renderer,
    *,
    drift: list[DriftRecord],
    foreign: int,
    final_fp: bytes,
    resume: Seen | None = None,
    keep: int = 0,
) -> tuple[PromptPlan, tuple[int, ...], tuple[int, ...]]:
    """The prompt of `blocks`; with `resume`, whose first `keep` blocks are those of
    `blocks` (with the same matches), their ids are taken from its prompt. Also returns
    each block's start offset and the spliced turns before it."""
    pieces: list[npt.NDArray[np.int32]] = []
    spliced: list[Spliced] = []
    offsets: list[int] = []
    n_spliced: list[int] = []
    n = 0
    if resume is not None and keep:
        n = resume.offsets[keep]
        pieces.append(resume.prompt_ids[:n])
        spliced.extend(resume.spliced[: resume.n_spliced[keep]])
        offsets.extend(resume.offsets[:keep])
        n_spliced.extend(resume.n_spliced[:keep])
    end_id = renderer.block_end_ids[0]
    for b in blocks[len(offsets) :]:
        offsets.append(n)
        n_spliced.append(len(spliced))
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
    continued_end = 0
    if spliced:
        last = spliced[-1]
        base = last.call_id
        t = matches[last.message_index]
        if last.offset == t.prompt_len and not any(
            d.kind == "history_rewritten" and d.call_id == t.call_id for d in drift
        ):
            continues = t.call_id
            continued_end = last.offset + last.length
    plan = PromptPlan(prompt, tuple(spliced), tuple(drift), continues, base, foreign, final_fp,
                      continued_end)
    return plan, tuple(offsets), tuple(n_spliced)
