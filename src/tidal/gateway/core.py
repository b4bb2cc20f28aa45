"""The gateway's core: one request in, one recorded call and one response out.

No HTTP here (see `server.py`): `Gateway.chat` and `Gateway.completion` take a parsed
JSON body and a `Route` (session, parent, task, role) and return an `Answer`: the
response object, the data the streaming encoder needs, and timings. Every chat-like API
(Chat Completions here; Responses in `responses.py`, Anthropic Messages in
`anthropic.py`) is translated to a `ChatCall` and served by `Gateway.call`, which returns
the recorded `ChatTurn` for the API to format: one path for token-in-token-out, drift and
the ledger. Order of work, so that nothing is half-written on error: validate everything
(model, messages, tools, sampling, session, parent, the session's task and parent session
as the ledger binds them, context length) -> generate -> cut
at a stop string -> parse tool calls -> commit the call to the ledger -> remember the
turn for token-in-token-out -> answer.

A session this process does not hold (a restart, another worker, a forgotten one) is
rebuilt from the ledger on its first use: each call's `metadata.turn` keeps what a
recorded turn needs beyond the call itself.

A resumed session (`Gateway.replay`, `tidal.gateway.replay`) has its recorded calls
answered from the ledger: a call whose prompt ids equal a recorded call's gets that call
back and nothing is recorded; the first one that matches none is generated as usual.

Sessions: `Route.session_id` picks the session. Without one (plain `/v1/...` and no
header) the gateway looks for a session that issued one of the request's tool-call ids
or produced one of its assistant turns, else starts a fresh `auto-...` session.

Deliberately simplified: `n` must be 1; stop strings cut the output after the token that
completes them (the recorded output is what was sampled up to there); `top_logprobs`
(up to 20) lists the alternatives of the distribution sampled from, and the ledger keeps
only the sampled token's logprob; `tool_choice` "required" or a named function is
recorded and passed to nothing (no constrained decoding): the model may still answer in
prose. The policy version is the engine's (bumped by `Engine.update_weights`) and is
taken from each generation.
"""

from __future__ import annotations

import hashlib
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.engine.base import Engine, EngineError, Generation, SamplingParams
from tidal.gateway.access import OPEN, Access
from tidal.gateway.drift import DriftRecord, RecordedToolCall
from tidal.gateway.family import ChatFamily, GatewayError, detect_family
from tidal.gateway.messages import RequestError, message_record, messages_text, shown
from tidal.gateway.record import (
    Turn,
    call_metadata,
    chat_call,
    sampling_record,
    shape_output,
)
from tidal.gateway.render import Renderer
from tidal.gateway.replay import Replay, ReplayStatus
from tidal.gateway.request import ChatRequest, parse_request
from tidal.gateway.sessions import Sessions, check_session_row
from tidal.gateway.tito import PromptPlan, RecordedTurn, SessionTurns, assemble_prompt, turn_key
from tidal.gateway.toolcalls import (
    ToolParser,
    ToolSet,
    parse_output,
    parsers_for_template,
    resolve_parsers,
)
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import ROLE_PATTERN, Call, LedgerError

DEFAULT_MAX_TOKENS = 256
MAX_ID_LEN = 128
# The ledger's ids without "/": an id must fit one URL path part, and every source of an
# id (the URL, the X-Tidal-* headers) is checked against this one pattern.
ROUTE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$")
_ID_CHARS = "[A-Za-z0-9._:@+-], starting with a letter or digit"
_ROUTE_IDS = ("session_id", "parent_call_id", "parent_session_id", "task_id")
MAX_SEED = 2**63 - 1


def _hex24(rng: random.Random | None) -> str:
    """24 hex digits: from `rng` (a seeded call's ids), else random."""
    return f"{rng.getrandbits(96):024x}" if rng is not None else uuid.uuid4().hex[:24]


def call_seed(run_seed: int, key: str, index: int) -> int:
    """The sampling seed of call `index` of the session whose seed key is `key`, in a
    gateway seeded `run_seed`: the same (seed, session, call) always samples alike."""
    digest = hashlib.blake2b(f"{run_seed}\x00{key}\x00{index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") & MAX_SEED


@dataclass(frozen=True)
class Route:
    """Who a request belongs to. `session_id=None`: pick or start one automatically."""

    session_id: str | None = None
    parent_call_id: str | None = None
    parent_session_id: str | None = None
    task_id: str | None = None
    role: str | None = None
    key: str | None = None  # the API key the request bore (`tidal.gateway.access`)

    def validate(self) -> None:
        """The same rules for an id from the URL or from a header (`check_route_id`)."""
        for name in _ROUTE_IDS:
            v = getattr(self, name)
            if v is not None:
                check_route_id(name, v)
        if self.role is not None and not ROLE_PATTERN.match(self.role):
            raise RequestError(
                f"invalid role {shown(self.role)}: use a lowercase name like 'main' (at most "
                "32 characters from [a-z0-9_-], starting with a letter)",
                param="role",
                code="invalid_role",
            )


def check_route_id(name: str, value: str) -> None:
    """Refuse a session, parent call, parent session or task id that the ledger would not
    keep or a URL path part could not carry, naming the field and the rule (a long id is
    shown cut, with its length)."""
    label = name.replace("_", " ")
    if len(value) > MAX_ID_LEN:
        raise RequestError(
            f"invalid {label} {shown(value)} ({len(value)} characters): at most "
            f"{MAX_ID_LEN} characters from {_ID_CHARS}",
            param=name,
            code=f"invalid_{name}",
        )
    if not ROUTE_ID_PATTERN.match(value):
        raise RequestError(
            f"invalid {label} {shown(value)}: use 1-{MAX_ID_LEN} characters from {_ID_CHARS}",
            param=name,
            code=f"invalid_{name}",
        )


@dataclass(frozen=True, eq=False)
class Answer:
    """A finished call: the OpenAI response body plus what streaming and headers need."""

    body: dict[str, Any]
    session_id: str
    call_id: str
    engine_s: float
    total_s: float
    token_texts: tuple[str, ...] = ()
    logprobs: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class ChatCall:
    """What a request asks, in chat terms: every API (Chat Completions, Responses,
    Anthropic Messages) is translated to this, so one path validates, assembles the prompt
    token-in-token-out, generates, records and remembers the turn.

    `messages`/`tools`: OpenAI chat-format data (validated here); `sampling`: the body keys
    `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `n` (validated here); `stop`:
    strings that end the turn (the output is cut after the token that completes one);
    `tool_id_prefix`: how the API's tool-call ids start; `metadata`: what the API adds to
    the call's ledger metadata (merged at the top level)."""

    messages: Any
    tools: Any = None
    tool_choice: Any = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    endpoint: str = "chat.completions"
    tool_id_prefix: str = "call_"
    metadata: Mapping[str, Any] = field(default_factory=dict)
    want_texts: bool = False  # token texts of the output (streaming, logprobs)


@dataclass(frozen=True, eq=False)
class ChatTurn:
    """One recorded chat call, before an API formats it. `finish`: stop | length |
    tool_calls; `stop_sequence`: the stop string that ended it (the recorded output ends
    with the token completing it; `content` stops before it)."""

    session_id: str
    call_id: str
    gen: Generation
    output_ids: npt.NDArray[np.int32]  # as recorded (cut at a stop string)
    logprobs: npt.NDArray[np.float32]
    content: str | None
    tool_calls: tuple[RecordedToolCall, ...]
    finish: str
    stop_sequence: str | None
    n_prompt: int
    drift: int
    started: float
    engine_s: float
    t_start: float
    texts: tuple[str, ...]
    tops: list[list[dict[str, Any]]] | None
    unparsed: str | None = None  # why text that looks like a tool call was not parsed
    replayed: bool = False  # answered from the ledger (a resumed session), not sampled

    def message(self) -> dict[str, Any]:
        return chat_message(self.content, self.tool_calls)


def chat_message(content: str | None, calls: Sequence[RecordedToolCall]) -> dict[str, Any]:
    """An assistant turn as an OpenAI chat message (the form every API is translated to)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [
            {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in calls
        ]
    return msg


def int_field(
    body: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int = 2**31 - 1
) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(
            f"{key} must be an integer in [{lo}, {hi}], got {shown(v)}", param=key
        )
    return v


def _float(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise RequestError(f"{key} must be a number in [{lo}, {hi}], got {shown(v)}", param=key)
    return float(v)


def flag(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    """A boolean field: true, false or absent/null (the default); anything else (1, "yes",
    a list) is refused, naming the field."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false, got {shown(v)}", param=key)
    return v


def check_stream_options(body: Mapping[str, Any]) -> None:
    """`stream_options`: null or an object whose `include_usage` is a boolean."""
    opts = body.get("stream_options")
    if opts is None:
        return
    if not isinstance(opts, Mapping):
        raise RequestError(
            f"stream_options must be an object, got {shown(opts)}", param="stream_options"
        )
    v = opts.get("include_usage")
    if v is not None and not isinstance(v, bool):
        raise RequestError(
            f"stream_options.include_usage must be true or false, got {shown(v)}",
            param="stream_options.include_usage",
        )


class Gateway:
    """Serves OpenAI-style requests from an `Engine`, recording every call in a ledger."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        store: LedgerStore,
        *,
        family: ChatFamily | None = None,
        model_aliases: tuple[str, ...] = (),
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        tool_parsers: str | Sequence[str | ToolParser] | None = None,
        lenient_tool_parsing: bool = True,
        seed: int | None = None,
        seed_key: Callable[[str], str] | None = None,
        access: Access = OPEN,
    ) -> None:
        """`tool_parsers`: names (`tidal.gateway.toolcalls.resolve_parsers`), default the
        chat template's (`parsers_for_template`); `lenient_tool_parsing`: the parsers'
        lenient rules (`tidal.gateway.toolparsers`).

        `seed`: a run seed. A request without its own `seed` then samples with
        `call_seed(seed, seed_key(session), n)`, n the session's generated calls before
        it, and its tool-call ids derive from that seed too: one config and seed sample
        alike in every run (bit for bit with consistent numerics). `seed_key` maps a
        session id to what its seeds derive from (default: the id itself; `tidal run`
        drops the random part of its ids, `tidal.run.rollout.seed_key`)."""
        self.engine = engine
        self.access = access
        self.seed = seed
        self.seed_key = seed_key or (lambda session_id: session_id)
        self.store = store
        template = getattr(tokenizer, "chat_template", None)
        self.family = family or detect_family(template)
        self.tool_parsers = resolve_parsers(
            tool_parsers if tool_parsers is not None else parsers_for_template(template)
        )
        self.lenient_tool_parsing = lenient_tool_parsing
        self.renderer = Renderer(tokenizer, self.family)
        self.model_names = (engine.model_name, *model_aliases)
        self.default_max_tokens = default_max_tokens
        self._lock = threading.Lock()
        self.sessions = Sessions(store, self._load_turns)
        self._token_text: dict[int, str] = {}
        self._replays: dict[str, Replay] = {}  # resumed sessions: recorded calls to serve
        # what an API keeps per session beyond the turns (held responses) drops with them
        self.on_forget: list[Callable[[str], None]] = []
        # told of every call once it is committed (a run's live episodes count them)
        self.on_record: list[Callable[[Call], None]] = []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def live_sessions(self) -> int:
        """Sessions whose turns this gateway keeps in memory (until `forget_session`)."""
        return len(self.sessions)

    def forget_session(self, session_id: str) -> bool:
        """Drop a finished session's in-memory turns (the ledger keeps everything). Later
        requests of that session are then served without token-in-token-out for the
        turns before it. Returns whether the session was known."""
        known = self.sessions.forget(session_id)
        with self._lock:
            self._replays.pop(session_id, None)
        for hook in self.on_forget:
            hook(session_id)
        return known

    # ---------------------------------------------------------------- replay
    def replay(self, session_ids: Sequence[str]) -> int:
        """Put resumed sessions in replay mode (`tidal.gateway.replay`): a chat call of
        one of them whose prompt ids equal a recorded call's is answered with that call,
        recording nothing. Returns the number of recorded calls waiting."""
        replays = {sid: Replay(self.store.call_log(sid)) for sid in session_ids
                   if self.store.has_session(sid)}
        with self._lock:
            self._replays.update(replays)
        return sum(r.pending for r in replays.values())

    def replay_status(self, session_id: str) -> ReplayStatus | None:
        """How far a replayed session got (None: not in replay mode)."""
        with self._lock:
            r = self._replays.get(session_id)
        return None if r is None else r.status()

    def _replayed(self, session_id: str, plan_prompt: npt.NDArray[np.int32], *,
                  t_start: float, started: float, want_texts: bool,
                  logprobs: bool) -> ChatTurn | None:
        with self._lock:
            r = self._replays.get(session_id)
        c = r.take(plan_prompt) if r is not None else None
        if c is None:
            return None
        meta = c.metadata or {}
        kept = meta.get("turn")
        turn: Mapping[str, Any] = kept if isinstance(kept, Mapping) else {}
        calls = tuple(RecordedToolCall(x["id"], x["name"], x["arguments"])
                      for x in c.tool_calls or [])
        stop_sequence = meta.get("stop_sequence")
        gen = Generation(c.output_ids, c.output_logprobs, c.finish_reason, c.policy_version)
        parse = meta.get("tool_parse")
        return ChatTurn(
            session_id=session_id, call_id=c.call_id, gen=gen, output_ids=c.output_ids,
            logprobs=c.output_logprobs,
            content=turn["content"] if "content" in turn else self.visible_text(c.output_ids),
            tool_calls=calls,
            finish="tool_calls" if calls else ("stop" if stop_sequence else c.finish_reason),
            stop_sequence=stop_sequence, n_prompt=int(plan_prompt.shape[0]), drift=0,
            started=started, engine_s=0.0, t_start=t_start,
            texts=self.token_texts(c.output_ids) if want_texts else (),
            tops=[[] for _ in range(int(c.output_ids.shape[0]))] if logprobs else None,
            unparsed=parse.get("reason") if isinstance(parse, Mapping) else None,
            replayed=True,
        )

    # ---------------------------------------------------------------- helpers
    def check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str):
            raise RequestError("model is required (a string)", param="model")
        if model not in self.model_names:
            raise RequestError(
                f"the model {shown(model)} does not exist; this gateway serves "
                f"{', '.join(map(repr, self.model_names))}",
                param="model",
                code="model_not_found",
                status=404,
            )

    def _sampling(
        self, body: Mapping[str, Any], prompt_len: int, top_logprobs: int = 0,
        stop: tuple[str, ...] = (),
    ) -> SamplingParams:
        if int_field(body, "n", 1, 1) != 1:
            raise RequestError(
                "n must be 1: each choice is its own recorded call; send several requests",
                param="n",
            )
        limit = self.engine.max_context
        room = limit - prompt_len
        asked = int_field(body, "max_completion_tokens", None, 1)
        asked = int_field(body, "max_tokens", asked, 1)
        if room < 1 or (asked is not None and asked > room):
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_len} tokens and {asked or 1} more were requested",
                param="messages",
                code="context_length_exceeded",
            )
        max_tokens = asked if asked is not None else min(self.default_max_tokens, room)
        seed = int_field(body, "seed", None, 0, MAX_SEED)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_float(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
                top_k=int_field(body, "top_k", 0, 0) or 0,
                stop_token_ids=self.renderer.stop_ids,
                seed=seed,
                top_logprobs=top_logprobs,
            )
        except EngineError as e:
            raise RequestError(str(e), param="sampling") from e

    def _load_turns(self, session_id: str, turns: SessionTurns) -> None:
        """Rebuild a session this process does not hold from the ledger (a restarted
        gateway, another worker's session, one forgotten): every chat turn recorded with
        its `metadata.turn` becomes a recorded turn again, and its drift records count as
        stored. One read of the session's calls, on its first use here."""
        if not self.store.has_session(session_id):
            return
        log = self.store.call_log(session_id)
        turns.note_calls(len(log.calls))
        if log.calls:
            first = log.calls[0].call
            turns.note_row(first.task_id, first.parent_session_id)
        owners = []
        for sc in log.calls:
            c = sc.call
            meta = c.metadata or {}
            turns.note_stored(d for d in meta.get("drift") or [] if isinstance(d, Mapping))
            owners.append(c.call_id)
            t = meta.get("turn")
            if not isinstance(t, Mapping):
                continue  # /v1/completions, or a ledger written before turns were kept
            turns.add(
                RecordedTurn(
                    c.call_id,
                    int(t["position"]),
                    bytes.fromhex(t["history"]),
                    sc.prompt.prompt_len,
                    c.output_ids,
                    t["content"] if "content" in t else self.visible_text(c.output_ids),
                    tuple(
                        RecordedToolCall(x["id"], x["name"], x["arguments"])
                        for x in c.tool_calls or []
                    ),
                )
            )
        self.sessions.own_calls(session_id, owners)

    def token_texts(self, ids: np.ndarray) -> tuple[str, ...]:
        out = []
        for i in ids.tolist():
            s = self._token_text.get(i)
            if s is None:
                s = self._token_text[i] = self.renderer.decode([i])
            out.append(s)
        return tuple(out)

    def _tops(self, gen: Generation) -> list[list[dict[str, Any]]]:
        """`gen.top_logprobs` as OpenAI's alternatives per token (empty lists when none)."""
        if gen.top_logprobs is None:
            return [[] for _ in range(int(gen.output_ids.shape[0]))]
        out = []
        for alts in gen.top_logprobs:
            texts = self.token_texts(np.asarray([t for t, _ in alts], dtype=np.int64))
            out.append([
                {"token": s, "logprob": float(v), "bytes": list(s.encode("utf-8"))}
                for s, (_, v) in zip(texts, alts, strict=True)
            ])
        return out

    def _seeded(self, params: SamplingParams, turns: SessionTurns,
                session_id: str) -> tuple[SamplingParams, random.Random | None]:
        """A seeded gateway's seed for a request that brought none (`call_seed`), and the
        generator of its tool-call ids (None: random ids)."""
        if self.seed is None or params.seed is not None:
            return params, None
        seed = call_seed(self.seed, self.seed_key(session_id), turns.next_call())
        return replace(params, seed=seed), random.Random(seed)

    def _generate(self, prompt: np.ndarray, params: SamplingParams,
                  session_id: str) -> tuple[Generation, float]:
        t0 = time.perf_counter()
        try:
            # the session id lets a pool of servers keep a session on one (its prefix cache)
            gen = self.engine.generate([prompt], params, session=session_id)[0]
        except EngineError as e:
            raise RequestError(
                f"the engine refused the request: {e}", param=None, code="engine_error"
            ) from e
        return gen, time.perf_counter() - t0

    def _commit(self, call: Call, base_hint: str | None) -> None:
        try:
            self.store.append_call(call, base_hint=base_hint)
        except LedgerError as e:
            raise RequestError(
                f"the ledger refused the call: {e}",
                code="ledger_error",
                status=409 if "already" in str(e) else 400,
            ) from e
        for hook in self.on_record:
            hook(call)

    def _parent(self, route: Route, session_id: str) -> tuple[str | None, str | None]:
        """The call's (parent call, parent session), once its API key is found good for
        the session (`self.access`; a refusal is 403 and nothing runs). A parent session
        the route names is checked before the parent call is looked up, so a call naming
        a session the key does not own is refused as such."""
        named = route.parent_call_id is None or route.parent_session_id is not None
        if named:
            self.access.check(route.key, route.session_id, route.parent_session_id,
                              self.store.session_info)
        parent_call, parent_session = self.sessions.parent(
            route.parent_call_id, route.parent_session_id, session_id)
        if not named:
            self.access.check(route.key, route.session_id, parent_session,
                              self.store.session_info)
        return parent_call, parent_session

    # ---------------------------------------------------------------- chat
    def call(self, req: ChatCall, route: Route) -> ChatTurn:
        """One chat turn (any API): parse the request, find its session, assemble the
        prompt token-in-token-out, generate (or replay a resumed session's recorded call),
        then record the call and remember the turn."""
        t_start, started = time.perf_counter(), time.time()
        route.validate()
        request = self._parse(req, route)
        auto = route.session_id is None  # an automatic session is found by content
        session_id = route.session_id or self.sessions.find(*request.routing())
        parent_call, parent_session = self._parent(route, session_id)
        turns = self.sessions.turns(session_id)
        check_session_row(turns, session_id, route.task_id, parent_session)
        plan = self._assemble(request, turns)
        n_prompt = int(plan.prompt_ids.shape[0])
        params = self._sampling(req.sampling, n_prompt, req.top_logprobs, req.stop)
        replayed = self._replayed(session_id, plan.prompt_ids, t_start=t_start, started=started,
                                  want_texts=req.logprobs or req.want_texts,
                                  logprobs=req.logprobs)
        if replayed is not None:  # a resumed session's recorded call: nothing new
            return replayed
        params, ids_rng = self._seeded(params, turns, session_id)
        gen, engine_s = self._generate(plan.prompt_ids, params, session_id)
        out = shape_output(gen, params.stop_token_ids, req.stop, self.renderer.decode)
        offered = (ToolSet.of(request.tools) if request.tools and request.tool_choice != "none"
                   else None)
        parsed = parse_output(out.text, self.tool_parsers, offered,
                              lenient=self.lenient_tool_parsing)
        turn = Turn(session_id, f"call-{uuid.uuid4().hex[:20]}",
                    route.role or ("subagent" if parent_session else "main"), parent_call,
                    parent_session, route.task_id, started, max(time.time(), started))
        tool_calls = tuple(
            RecordedToolCall(f"{req.tool_id_prefix}{_hex24(ids_rng)}", t.name, t.arguments)
            for t in parsed.tool_calls)
        new_drift = turns.unstored_drift(plan.drift)
        meta = call_metadata(request, plan, new_drift, out, parsed, endpoint=req.endpoint,
                             extra=req.metadata)
        self._commit(chat_call(turn, plan, gen, out, parsed=parsed, tool_calls=tool_calls,
                               sampling=sampling_record(params), metadata=meta,
                               decode=self.renderer.decode,
                               messages=[message_record(m) for m in request.messages],
                               tools=request.tools), plan.base_hint)
        self._remember(turns, turn, RecordedTurn(
            turn.call_id, len(request.messages), plan.prefix_fp, n_prompt, out.ids,
            parsed.content, tool_calls), new_drift, auto=auto)
        want_texts = req.logprobs or req.want_texts
        return ChatTurn(
            session_id=session_id, call_id=turn.call_id, gen=gen, output_ids=out.ids,
            logprobs=out.logprobs, content=parsed.content, tool_calls=tool_calls,
            finish="tool_calls" if tool_calls else out.finish,
            stop_sequence=out.stop_sequence, n_prompt=n_prompt, drift=len(plan.drift),
            started=started, engine_s=engine_s, t_start=t_start,
            texts=self.token_texts(out.ids) if want_texts else (),
            tops=self._tops(gen)[: int(out.ids.shape[0])] if req.logprobs else None,
            unparsed=parsed.unparsed,
        )

    def _parse(self, req: ChatCall, route: Route) -> ChatRequest:
        """The request validated; a session this process holds parses only the messages
        after its last request's."""
        text = messages_text(req.messages)
        base = None
        if text is not None and route.session_id is not None:
            kept = self.sessions.kept(route.session_id)
            base = kept.seen_prefix(text) if kept is not None else None
        return parse_request(req.messages, req.tools, req.tool_choice, text=text, base=base,
                             logprobs=req.logprobs, top_logprobs=req.top_logprobs)

    def _assemble(self, request: ChatRequest, turns: SessionTurns) -> PromptPlan:
        """The prompt's token ids, the recorded turns spliced back (`tidal.gateway.tito`)."""
        base = request.base
        if base is None and request.text is not None:
            base = turns.seen_prefix(request.text)
        try:
            return assemble_prompt(request.messages, request.tools, turns, self.renderer,
                                   text=request.text, base=base)
        except GatewayError as e:
            raise RequestError(str(e), param="messages", code="template_error") from e

    def _remember(self, turns: SessionTurns, turn: Turn, recorded: RecordedTurn,
                  new_drift: Sequence[DriftRecord], *, auto: bool) -> None:
        """The recorded turn, kept for the session's next request (token-in-token-out);
        an automatic session is found again by its tool-call ids and the turn's key."""
        turns.note_row(turn.task_id, turn.parent_session)
        turns.note_stored_drift(new_drift)
        turns.add(recorded)
        calls = recorded.tool_calls
        key = turn_key(recorded.content, [(t.name, t.arguments) for t in calls])
        self.sessions.remember(turn.session_id, turn.call_id,
                               tool_ids=[t.id for t in calls] if auto else (),
                               key=key if auto else None)

    def visible_text(self, out_ids: npt.NDArray[np.int32]) -> str | None:
        """The text of an output without its final stop token (what a turn returned when
        it had no tool calls and no stop string)."""
        ids = out_ids.tolist()
        if ids and ids[-1] in self.renderer.stop_ids:
            ids = ids[:-1]
        return self.renderer.decode(ids) or None

    def chat(self, body: Mapping[str, Any], route: Route) -> Answer:
        """OpenAI Chat Completions."""
        self.check_model(body)
        stop = body.get("stop")
        stops = (stop,) if isinstance(stop, str) else stop
        if stops is None:
            stops = ()
        if not isinstance(stops, list | tuple) or not all(isinstance(x, str) for x in stops):
            raise RequestError("stop must be a string or a list of strings", param="stop")
        if len(stops) > 4:
            raise RequestError("stop takes at most 4 strings", param="stop")
        want_logprobs = flag(body, "logprobs")
        for key in ("parallel_tool_calls", "store"):
            flag(body, key)  # accepted, not enforced (docs/gateway.md), but booleans
        check_stream_options(body)
        turn = self.call(
            ChatCall(
                messages=body.get("messages"),
                tools=body.get("tools"),
                tool_choice=body.get("tool_choice"),
                sampling=body,
                stop=tuple(s for s in stops if s),
                logprobs=want_logprobs,
                top_logprobs=int_field(body, "top_logprobs", 0, 0) or 0,
                want_texts=flag(body, "stream"),
            ),
            route,
        )
        msg = turn.message()
        gen = turn.gen
        body_out = {
            "id": f"chatcmpl-{turn.call_id}",
            "object": "chat.completion",
            "created": int(turn.started),
            "model": self.engine.model_name,
            "system_fingerprint": f"tidal-policy-{gen.policy_version}",
            "choices": [
                {
                    "index": 0,
                    "message": msg,
                    "finish_reason": turn.finish,
                    "logprobs": {"content": lp_entries(turn.texts, turn.logprobs, turn.tops)}
                    if turn.tops is not None
                    else None,
                }
            ],
            "usage": usage(turn),
            "tidal": tidal_block(turn),
        }
        return answer(turn, body_out)

    # ---------------------------------------------------------------- completions
    def completion(self, body: Mapping[str, Any], route: Route) -> Answer:
        t_start = time.perf_counter()
        started = time.time()
        route.validate()
        self.check_model(body)
        ids = self._completion_prompt(body.get("prompt"))
        flag(body, "stream")
        check_stream_options(body)
        if flag(body, "echo"):
            raise RequestError("echo is not supported", param="echo")
        if body.get("stop") not in (None, [], ""):
            raise RequestError(
                "stop strings are not supported on /v1/completions (use chat, responses or "
                "messages, which cut the recorded output after the stop string)",
                param="stop",
            )
        lp = int_field(body, "logprobs", None, 0)
        session_id = route.session_id or f"auto-{uuid.uuid4().hex[:16]}"
        parent_call, parent_session = self._parent(route, session_id)
        turns = self.sessions.turns(session_id)
        check_session_row(turns, session_id, route.task_id, parent_session)
        params = self._sampling(body, int(ids.shape[0]), lp or 0)
        params, _ = self._seeded(params, turns, session_id)
        gen, engine_s = self._generate(ids, params, session_id)
        out_ids = gen.output_ids
        text = self.renderer.decode(out_ids.tolist())
        call_id = f"call-{uuid.uuid4().hex[:20]}"
        call = Call(
            session_id=session_id,
            call_id=call_id,
            role=route.role or ("subagent" if parent_session else "main"),
            prompt_ids=ids,
            output_ids=out_ids,
            output_logprobs=gen.logprobs,
            output_text=text,
            policy_version=int(gen.policy_version),
            finish_reason=gen.finish_reason,
            started_at=started,
            ended_at=max(time.time(), started),
            parent_call_id=parent_call,
            parent_session_id=parent_session,
            task_id=route.task_id,
            sampling=sampling_record(params),
            metadata={"request": {"endpoint": "completions"}},
        )
        self._commit(call, None)
        turns.note_row(call.task_id, call.parent_session_id)
        self.sessions.remember(session_id, call_id)
        texts = self.token_texts(out_ids)
        logprobs = None
        if lp is not None:
            offsets, pos = [], 0
            for s in texts:
                offsets.append(pos)
                pos += len(s)
            logprobs = {
                "tokens": list(texts),
                "token_logprobs": [float(x) for x in gen.logprobs],
                "top_logprobs": [{e["token"]: e["logprob"] for e in alts}
                                 for alts in self._tops(gen)] if lp else None,
                "text_offset": offsets,
            }
        n_prompt, n_out = int(ids.shape[0]), int(out_ids.shape[0])
        body_out = {
            "id": f"cmpl-{call_id}",
            "object": "text_completion",
            "created": int(started),
            "model": self.engine.model_name,
            "choices": [
                {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": gen.finish_reason}
            ],
            "usage": _usage(n_prompt, n_out, gen),
            "tidal": _tidal_block(session_id, call_id, gen),
        }
        return Answer(
            body_out,
            session_id,
            call_id,
            engine_s,
            time.perf_counter() - t_start,
            texts,
            tuple(float(x) for x in gen.logprobs),
        )

    def _completion_prompt(self, prompt: object) -> npt.NDArray[np.int32]:
        """`/v1/completions`' prompt as ids: a string (tokenized as the raw prompt it is:
        special-token text becomes those tokens) or a list of ids, each an id of the
        tokenizer's vocabulary."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return np.asarray(
                self.renderer.tokenizer.encode(prompt, add_special_tokens=False), dtype=np.int32
            )
        if not isinstance(prompt, list) or not prompt:
            raise RequestError(
                "prompt must be a non-empty string or a list of token ids", param="prompt"
            )
        vocab = self.renderer.vocab_size
        for k, x in enumerate(prompt):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < vocab:
                raise RequestError(
                    f"prompt[{k}] must be a token id in [0, {vocab - 1}] (this tokenizer's "
                    f"vocabulary), got {shown(x)}",
                    param=f"prompt[{k}]",
                )
        return np.asarray(prompt, dtype=np.int32)

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": n, "object": "model", "created": 0, "owned_by": "tidal"}
                for n in self.model_names
            ],
        }


def usage(turn: ChatTurn) -> dict[str, Any]:
    """OpenAI's usage block of a chat turn."""
    return _usage(turn.n_prompt, int(turn.output_ids.shape[0]), turn.gen)


def answer(turn: ChatTurn, body: dict[str, Any]) -> Answer:
    """The `Answer` carrying an API's response body for a chat turn."""
    return Answer(
        body,
        turn.session_id,
        turn.call_id,
        turn.engine_s,
        time.perf_counter() - turn.t_start,
        turn.texts,
        tuple(float(x) for x in turn.logprobs),
    )


def tidal_block(turn: ChatTurn) -> dict[str, Any]:
    """What tidal adds to every chat-turn response body, in every API."""
    block = {**_tidal_block(turn.session_id, turn.call_id, turn.gen), "drift": turn.drift}
    if turn.unparsed is not None:
        block["tool_parse"] = {"status": "unparsed", "reason": turn.unparsed}
    if turn.replayed:
        block["replayed"] = True
    return block


def _usage(n_prompt: int, n_out: int, gen: Generation) -> dict[str, Any]:
    """OpenAI's usage block; `prompt_tokens_details.cached_tokens` when the engine says
    how many prompt tokens it read from its prefix cache."""
    usage: dict[str, Any] = {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
    }
    if "cached_tokens" in gen.extra:
        usage["prompt_tokens_details"] = {"cached_tokens": int(gen.extra["cached_tokens"])}
    return usage


def _tidal_block(session_id: str, call_id: str, gen: Generation) -> dict[str, Any]:
    """What tidal adds to every response body: where the call was recorded."""
    return {
        "session_id": session_id,
        "call_id": call_id,
        "policy_version": int(gen.policy_version),
    }


def lp_entries(
    texts: tuple[str, ...], logprobs: np.ndarray, tops: list[list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """OpenAI's per-token logprob entries (also the Responses API's)."""
    return [
        {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8")), "top_logprobs": top}
        for s, lp, top in zip(texts, logprobs.tolist(), tops, strict=True)
    ]
