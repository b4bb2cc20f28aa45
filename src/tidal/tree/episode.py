"""Episodes: a root session plus every subagent session linked to it, with typed edges.

Each session gets its own exact prefix trie (`tidal.tree.trie`): a subagent has its own
context, so it shares no tokens with its parent. Sessions are linked by the
`parent_session_id` / `parent_call_id` of their calls. Every call gets one incoming edge
(or none, for a root call), typed by these rules, in order:

- `subagent`: the call links to a call of another session and extends nothing in its
  own session (the first call of a spawned helper);
- `compaction`: the call links to a call of its own session (the summary call) and its
  prompt does not extend that call's context: the history was replaced; the edge also
  names the call whose context was replaced (`replaced`: the summary's prefix parent).
  Without such a link (an opaque harness that compacts silently), a call that extends
  no earlier context and is no retry gets an *inferred* compaction edge
  (`Edge.inferred`) when the newest earlier output of its session that its prompt
  carries is carried as a summary, not as that call's turn re-sent in a history
  (`tidal.tree.compaction` states the rule); `build_episode(...,
  infer_compaction=False)` turns that off;
- `retry`: the prompt equals an earlier call's prompt exactly (a regeneration);
- `continuation`: the prompt extends an earlier call's context, and that call has no
  other child with a different prompt;
- `parallel`: as continuation, but the earlier call has several children with different
  prompts (parallel tool calls handled as separate model calls);
- `fork`: the prompt shares a prefix with earlier calls and diverges inside one of them
  without extending any earlier context (an edited or re-rendered history; the gateway
  is meant to prevent it, the trie records it faithfully).
A call with none of these is a root (not counted as an edge).

The inferred compaction is tried before `subagent` too: a later call of a helper
session that repeats its session link on every call, and starts a fresh context
carrying its own session's summary, is that helper compacting, not a second spawn.

Deliberately simplified: sibling subagents are typed `subagent` (the session link is
the more specific fact), not `parallel`; an inferred compaction is only recognised by
token ids (the summary re-sent almost verbatim, `tidal.tree.compaction`): a harness
that edits or re-flows the summary text still produces a `fork` or a new root.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from tidal.ledger.store import CallLog, LedgerStore
from tidal.ledger.types import Outcome, PromptDelta, StoredCall
from tidal.tree.compaction import CarriedSummaries
from tidal.tree.trie import CallPlace, SessionTrie, TreeError, build_trie

EDGE_KINDS = ("continuation", "parallel", "subagent", "compaction", "retry", "fork")


@dataclass(frozen=True, eq=False)
class SessionData:
    """One session's calls (commit order) and its outcome, as read from a ledger."""

    session_id: str
    calls: tuple[StoredCall, ...]
    outcome: Outcome | None

    @property
    def parent_link(self) -> tuple[str, str | None, str] | None:
        """(parent session, parent call, linking call) of the first call that names
        another session, or None for a root session."""
        for sc in self.calls:
            psid = sc.call.parent_session_id
            if psid is not None and psid != self.session_id:
                return psid, sc.call.parent_call_id, sc.call_id
        return None

    @property
    def task_id(self) -> str | None:
        return next((sc.call.task_id for sc in self.calls if sc.call.task_id), None)


@dataclass(frozen=True)
class Edge:
    """A typed edge into call `dst_call` of session `dst_session`."""

    kind: str
    src_session: str
    src_call: str
    dst_session: str
    dst_call: str
    replaced: str | None = None  # compaction: the call whose context was replaced
    inferred: bool = False  # compaction found by its carried summary, not a parent link


@dataclass(frozen=True, eq=False)
class EpisodeGraph:
    """An episode: its sessions (root first, then breadth-first), their tries, edges."""

    episode_id: str
    task_id: str | None
    sessions: tuple[SessionData, ...]
    tries: tuple[SessionTrie, ...]
    edges: tuple[Edge, ...]
    depth: tuple[int, ...]  # subagent nesting depth of each session (root: 0)

    @property
    def root(self) -> SessionData:
        return self.sessions[0]

    def edge_counts(self) -> dict[str, int]:
        c = Counter(e.kind for e in self.edges)
        return {k: c[k] for k in EDGE_KINDS if c[k]}

    def inferred_counts(self) -> dict[str, int]:
        """The edges of `edge_counts` that were inferred, by kind (only compaction)."""
        c = Counter(e.kind for e in self.edges if e.inferred)
        return {k: c[k] for k in EDGE_KINDS if c[k]}


def load_sessions(
    store: LedgerStore, session_ids: Iterable[str] | None = None
) -> list[SessionData]:
    """Read sessions (all, or the given ones) with their outcomes from a ledger store.

    An outcome recorded for a session that has no calls becomes a session with no calls
    (refused later with a clear error)."""
    ids = list(session_ids) if session_ids is not None else store.session_ids()
    outcomes = store.outcomes(ids if session_ids is not None else None)
    if session_ids is None:
        known = set(ids)
        ids += [s for s in outcomes if s not in known]
    out = []
    for sid in ids:
        outcome = outcomes.get(sid)
        log = store.call_log(sid)
        gone = abandoned(outcome)
        calls = without_calls(log, gone) if gone else log.calls
        if gone and not calls:
            continue  # every call of it was on a branch its resumed episode did not take
        out.append(SessionData(sid, calls, outcome))
    return out


def abandoned(outcome: Outcome | None) -> frozenset[str]:
    """The calls an outcome says its resumed session never asked for again
    (`details.abandoned_calls`, `tidal.agent.preempt`): a branch sampled before a
    preemption that the resumed session did not take. They are not trained."""
    if outcome is None:
        return frozenset()
    got = (outcome.details or {}).get("abandoned_calls") or ()
    return frozenset(c for c in got if isinstance(c, str))


def without_calls(log: CallLog, gone: frozenset[str]) -> tuple[StoredCall, ...]:
    """The session's calls less `gone`; a kept call whose prompt was stored against a
    dropped one gets its whole prompt instead (the trie merges it by tokens)."""
    out = []
    for sc in log.calls:
        if sc.call_id in gone:
            continue
        rebased = sc.prompt.base_call_id in gone
        out.append(replace(sc, prompt=PromptDelta(None, 0, log.prompt_ids(sc.call_id)))
                   if rebased else sc)
    return tuple(out)


def group_episodes(sessions: Sequence[SessionData]) -> list[list[SessionData]]:
    """Group sessions into episodes (root first, then subagents breadth-first).

    Raises `TreeError` on a session with no calls, a link to a session that is not there,
    or a cycle of parent links, naming the session and the linking call."""
    by_id: dict[str, SessionData] = {}
    for s in sessions:
        if not s.calls:
            raise TreeError(f"session {s.session_id!r} has no calls")
        if s.session_id in by_id:
            raise TreeError(f"session {s.session_id!r} appears twice")
        by_id[s.session_id] = s
    children: dict[str, list[str]] = defaultdict(list)
    roots: list[str] = []
    for s in sessions:
        link = s.parent_link
        if link is None:
            roots.append(s.session_id)
            continue
        psid, _pcid, via = link
        if psid not in by_id:
            raise TreeError(
                f"session {s.session_id!r}, call {via!r}: parent session {psid!r} is not in "
                "the input (dangling subagent link)"
            )
        children[psid].append(s.session_id)
    # Cycle check: every session must reach a root by following parent links.
    for s in sessions:
        seen = [s.session_id]
        cur = s
        while (link := cur.parent_link) is not None:
            if link[0] in seen:
                raise TreeError(
                    f"session {cur.session_id!r}, call {link[2]!r}: parent links form a cycle "
                    f"({' -> '.join([*seen, link[0]])})"
                )
            seen.append(link[0])
            cur = by_id[link[0]]
    out: list[list[SessionData]] = []
    for r in roots:
        ep = [by_id[r]]
        i = 0
        while i < len(ep):
            ep.extend(by_id[c] for c in children.get(ep[i].session_id, ()))
            i += 1
        out.append(ep)
    return out


def _session_edges(
    trie: SessionTrie, call_ids: dict[str, set[str]], *, infer_compaction: bool = True
) -> list[Edge]:
    sid = trie.session_id
    calls = trie.calls
    by_id = {p.call_id: p.index for p in trie.places}
    edges: list[Edge | None] = [None] * len(calls)
    ext_children: dict[int, list[int]] = defaultdict(list)
    carried: list[CarriedSummaries] = []  # built at the first eligible call
    used: set[int] = set()  # sources of the compaction edges so far

    def compaction(src: int, p: CallPlace, *, inferred: bool) -> Edge:
        used.add(src)
        replaced = trie.places[src].prefix_parent
        return Edge(
            "compaction", sid, calls[src].call_id, sid, p.call_id,
            replaced=calls[replaced].call_id if replaced >= 0 else None, inferred=inferred,
        )

    def inferred_source(p: CallPlace) -> int:
        if not infer_compaction or p.index == 0 or p.prefix_parent >= 0 or p.retry_of >= 0:
            return -1
        if not carried:
            carried.append(CarriedSummaries(trie))
        return carried[0].source(p.index, used)

    for p in trie.places:
        c = calls[p.index].call
        where = f"session {sid!r}, call {p.call_id!r}"
        psid = c.parent_session_id or sid
        pcid = c.parent_call_id
        if psid != sid:  # a link to another session
            if pcid is not None and pcid not in call_ids.get(psid, ()):
                raise TreeError(
                    f"{where}: parent call {pcid!r} of session {psid!r} is not in the input "
                    "(dangling parent link)"
                )
            if p.prefix_parent < 0 and p.retry_of < 0:
                src = inferred_source(p)
                edges[p.index] = (
                    compaction(src, p, inferred=True) if src >= 0
                    else Edge("subagent", psid, pcid or "", sid, p.call_id)
                )
                continue
        elif pcid is not None:
            parent = by_id.get(pcid)
            if parent is None or parent >= p.index:
                raise TreeError(
                    f"{where}: parent call {pcid!r} is not an earlier call of the session "
                    "(a missing parent or a cycle in parent links)"
                )
            pp = trie.places[parent]
            if not trie.is_ancestor(pp.context_end, p.prompt_end) and p.retry_of < 0:
                edges[p.index] = compaction(parent, p, inferred=False)
                continue
        if p.retry_of >= 0:
            edges[p.index] = Edge("retry", sid, calls[p.retry_of].call_id, sid, p.call_id)
        elif p.prefix_parent >= 0:
            ext_children[p.prefix_parent].append(p.index)
        elif (src := inferred_source(p)) >= 0:
            edges[p.index] = compaction(src, p, inferred=True)
        elif p.fork_from >= 0:
            edges[p.index] = Edge("fork", sid, calls[p.fork_from].call_id, sid, p.call_id)
    for parent, kids in ext_children.items():
        distinct = {trie.places[k].prompt_end for k in kids}
        kind = "parallel" if len(distinct) > 1 else "continuation"
        for k in kids:
            edges[k] = Edge(kind, sid, calls[parent].call_id, sid, calls[k].call_id)
    return [e for e in edges if e is not None]


def build_episode(
    sessions: Sequence[SessionData], *, infer_compaction: bool = True
) -> EpisodeGraph:
    """Build the tries and typed edges of one episode (root session first).

    `infer_compaction` (default on): type a silent compaction by the summary its fresh
    context carries (`tidal.tree.compaction`); off, only parent links make one."""
    tries = [build_trie(s.session_id, s.calls) for s in sessions]
    call_ids = {t.session_id: {p.call_id for p in t.places} for t in tries}
    edges: list[Edge] = []
    for t in tries:
        edges.extend(_session_edges(t, call_ids, infer_compaction=infer_compaction))
    depth: dict[str, int] = {sessions[0].session_id: 0}
    for s in sessions[1:]:
        link = s.parent_link
        assert link is not None
        depth[s.session_id] = depth.get(link[0], 0) + 1
    return EpisodeGraph(
        episode_id=sessions[0].session_id,
        task_id=sessions[0].task_id,
        sessions=tuple(sessions),
        tries=tuple(tries),
        edges=tuple(edges),
        depth=tuple(depth[s.session_id] for s in sessions),
    )
