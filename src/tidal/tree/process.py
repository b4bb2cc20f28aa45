"""From episodes to `TrainTree`s: candidate paths, the J cap, rewards, advantages, weights.

Pipeline (each step a plain function; `process_sessions` wires them):
1. `resolve_reward`: the episode's status decides its reward (see docs/trees.md):
   complete/aborted keep the grader's reward; timeout/truncated follow the `incomplete`
   policy ("partial": reward = partial_score, "zero": 0, "mask"); infra_error and a
   missing outcome ("pending") are masked: no trainable branch, counted, never punished.
2. `find_candidates`: each distinct call context that no other kept context extends is
   a candidate path; identical contexts and contexts that are a strict prefix of
   another (with no reward of their own: `metadata["reward"]`) are removed and counted.
   With `compaction_samples`, summary calls leave the session tree and each becomes its
   own sample (prompt = the history being summarised, untrained; trained tokens = the
   summary) whose reward is the episode's outcome, the work that continued from it.
   The source of a compaction edge (declared or inferred) ranks as a summary
   (`summary_role`: "main" -> "main_summary") whatever role its harness recorded.
   Subagent sessions whose own outcome is infra_error contribute nothing (counted).
3. `select_paths`: at most J per episode, by role priority main > main_summary >
   subagent > subagent_summary > other roles (alphabetical), then by `order`:
   "coverage" (default; greedy: the path adding the most model tokens that no chosen
   path carries yet, ties to the longer then the earlier), "longest" (most tokens
   first, then earliest commit) or "random" (a permutation seeded by `seed` and the
   episode id, so reproducible).
4. `group_baselines` + advantages: GRPO groups are episodes with the same task id (an
   episode without one is its own group). A_b = R_b - mean_g(R) ("mean"),
   (R_b - mean_g) / (std_g + 1e-6) ("mean_std"), or R_b ("none").
5. `emit_trees`: each trie root with a chosen path becomes one TrainTree (the root
   session's first root gets the episode id as tree id, others "<episode>/<session>" and
   "#k" for extra roots; summary samples "<episode>/compaction/N"); coef and
   norm_group encode the normalisation (types.py docstring, docs/trees.md).

Deliberately simplified: every branch of an episode uses the episode's reward (a
subagent is graded by the episode it served); episodes are never merged here (the
trainer merges trees that start alike before packing: `tidal.train.merge`).
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Outcome, Status
from tidal.tree.episode import (
    EpisodeGraph,
    SessionData,
    build_episode,
    group_episodes,
    load_sessions,
)
from tidal.tree.trie import SessionTrie, TreeError
from tidal.tree.types import Branch, Segment, TrainTree

NORMALISATIONS = ("two_level", "token", "path")
INCOMPLETE_POLICIES = ("partial", "zero", "mask")
ORDERS = ("coverage", "longest", "random")
ADVANTAGES = ("mean", "mean_std", "batch_mean", "none")
ROLE_PRIORITY = {"main": 0, "main_summary": 1, "subagent": 2, "subagent_summary": 3}
BATCH_GROUP = "batch"
_STD_EPS = 1e-6


def role_key(role: str) -> tuple[int, str]:
    return ROLE_PRIORITY.get(role, len(ROLE_PRIORITY)), role


# ---------------------------------------------------------------------------- rewards


def resolve_reward(outcome: Outcome | None, incomplete: str) -> tuple[str, float | None]:
    """(status, reward), reward None when the episode is masked."""
    if incomplete not in INCOMPLETE_POLICIES:
        raise ValueError(
            f"incomplete policy must be one of {INCOMPLETE_POLICIES}, got {incomplete!r}"
        )
    if outcome is None:
        return "pending", None
    st = outcome.status
    if st is Status.INFRA_ERROR:
        return st.value, None
    if st in (Status.TIMEOUT, Status.TRUNCATED):
        if incomplete == "mask":
            return st.value, None
        return st.value, (outcome.partial_score if incomplete == "partial" else 0.0)
    return st.value, outcome.reward


def success(reward: float) -> float:
    """1.0 where the grader gave full marks (reward >= 1: a solved task), else 0.0."""
    return 1.0 if reward >= 1.0 else 0.0


TRAIN_REWARDS: dict[str, Callable[[float], float]] = {"score": float, "success": success}


def with_rewards(sessions: Sequence[SessionData],
                 reward_of: Callable[[float], float]) -> list[SessionData]:
    """The sessions with each outcome's reward and partial score mapped by `reward_of`
    (`TRAIN_REWARDS[rl.reward]`: `float` keeps them, `success` trains on solved or not).
    Partial credit can reward the wrong command: a grader that gives 0.25 for a non-empty
    answer file makes any command that always prints something (`grep -c`) better, in
    its group, than a right command written wrong, and RL moves the skill there."""
    return [s if s.outcome is None else replace(s, outcome=replace(
        s.outcome, reward=reward_of(s.outcome.reward),
        partial_score=reward_of(s.outcome.partial_score)))
            for s in sessions]


def group_baselines(
    rewards: dict[str, tuple[str, float | None]], advantage: str
) -> dict[str, tuple[float, float]]:
    """Per episode: (baseline, scale) so that A = (R - baseline) / scale.

    `rewards` maps episode id -> (group key, reward or None when masked)."""
    if advantage not in ADVANTAGES:
        raise ValueError(f"advantage must be one of {ADVANTAGES}, got {advantage!r}")
    if advantage == "batch_mean":  # one baseline: every unmasked episode given
        every = [r for _g, r in rewards.values() if r is not None]
        return dict.fromkeys(rewards, (math.fsum(every) / len(every) if every else 0.0, 1.0))
    groups: dict[str, list[float]] = defaultdict(list)
    for g, r in rewards.values():
        if r is not None:
            groups[g].append(r)
    out: dict[str, tuple[float, float]] = {}
    for ep, (g, _r) in rewards.items():
        vals = groups.get(g, [])
        if advantage == "none" or not vals:
            out[ep] = (0.0, 1.0)
            continue
        mean = math.fsum(vals) / len(vals)
        scale = 1.0
        if advantage == "mean_std":
            var = math.fsum((v - mean) ** 2 for v in vals) / len(vals)
            scale = math.sqrt(var) + _STD_EPS
        out[ep] = (mean, scale)
    return out


def balance_advantages(
    trees: Sequence[TrainTree], skill_of_session: Mapping[str, str]
) -> list[TrainTree]:
    """Advantages rescaled so that every skill carries the same share of the batch's
    signal: one skill cannot take over what the skills share (a command prefix, the tool
    syntax) because it had more groups that disagreed (MT-GRPO reweights tasks in the same
    spirit; `rl.advantage_balance = "family"`).

    A skill's signal is the sum over its branches of |A_b| * coef_b (what its branches
    weigh in the loss's numerator); each skill's advantages are multiplied by
    mean(signal over skills with any) / its own, so the total is kept and skills with
    none stay at 0. A branch's skill is `skill_of_session[branch.session_id]` (a session
    not in it is its own skill, alone: its scale is 1 when it is the only one)."""
    mass: dict[str, float] = defaultdict(float)
    for t in trees:
        for b in t.branches:
            mass[skill_of_session.get(b.session_id, b.session_id)] += abs(b.advantage) * b.coef
    live = [m for m in mass.values() if m > 0.0]
    if len(live) < 2:
        return list(trees)
    target = math.fsum(live) / len(live)
    scale = {k: target / m for k, m in mass.items() if m > 0.0}

    def rescaled(b: Branch) -> Branch:
        f = scale.get(skill_of_session.get(b.session_id, b.session_id), 1.0)
        return b if f == 1.0 else replace(b, advantage=b.advantage * f)

    return [TrainTree(t.tree_id, t.segments, tuple(rescaled(b) for b in t.branches))
            for t in trees]


# ------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    """A path that may be trained: the context of call `call` of session `session`
    (an index into the episode's sessions), or that call's summary sample."""

    session: int
    call: int
    session_id: str
    call_id: str
    role: str
    tokens: int
    seq: int
    compaction: bool = False
    own_reward: float | None = None


@dataclass(frozen=True)
class CandidateSet:
    candidates: tuple[Candidate, ...]
    identical: int  # calls whose context equals an earlier call's
    prefix: int  # distinct contexts that are a strict prefix of a kept one, no own reward
    masked_sessions: int


def _own_reward(meta: dict[str, Any]) -> float | None:
    r = meta.get("reward")
    if isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r):
        return float(r)
    return None


def is_summary(role: str) -> bool:
    return role.endswith("_summary")


def summary_role(role: str) -> str:
    """The role a compaction's summary call plays: its recorded role when that already
    is a summary role, else `<role>_summary` (a harness that compacts silently records
    its summary call as "main")."""
    return role if is_summary(role) else f"{role}_summary"


def find_candidates(graph: EpisodeGraph, *, compaction_samples: bool) -> CandidateSet:
    """The episode's candidate paths (step 2 of the module docstring), with counts of
    the redundant paths removed and of the subagent sessions masked for infra_error."""
    compaction_src = {(e.src_session, e.src_call) for e in graph.edges if e.kind == "compaction"}
    cands: list[Candidate] = []
    identical = prefix = masked = 0
    for si, (sess, trie) in enumerate(zip(graph.sessions, graph.tries, strict=True)):
        if si > 0 and sess.outcome is not None and sess.outcome.status is Status.INFRA_ERROR:
            masked += 1
            continue
        excluded: set[int] = set()
        roles: dict[int, str] = {}
        for p in trie.places:
            c = trie.calls[p.index].call
            src = (sess.session_id, p.call_id) in compaction_src
            if src:
                roles[p.index] = summary_role(c.role)
            if compaction_samples and (is_summary(c.role) or src):
                excluded.add(p.index)
                cands.append(_candidate(si, trie, p.index, compaction=True,
                                        own_reward=_own_reward(c.metadata),
                                        role=roles.get(p.index)))
        ends: dict[int, list[int]] = defaultdict(list)
        for p in trie.places:
            if p.index not in excluded and p.context_end >= 0:
                ends[p.context_end].append(p.index)
        below = _has_end_below(trie, ends)
        for node, calls in ends.items():
            identical += len(calls) - 1
            first = calls[0]
            own = _own_reward(trie.calls[first].call.metadata)
            if below[node] and own is None:
                prefix += 1
                continue
            cands.append(_candidate(si, trie, first, own_reward=own, role=roles.get(first)))
    return CandidateSet(tuple(cands), identical, prefix, masked)


def _candidate(
    si: int, trie: SessionTrie, index: int, *, compaction: bool = False,
    own_reward: float | None = None, role: str | None = None,
) -> Candidate:
    sc = trie.calls[index]
    return Candidate(
        session=si, call=index, session_id=trie.session_id, call_id=sc.call_id,
        role=role or sc.call.role, tokens=trie.places[index].context_len, seq=sc.seq,
        compaction=compaction, own_reward=own_reward,
    )


def _has_end_below(trie: SessionTrie, ends: dict[int, list[int]]) -> list[bool]:
    """below[n]: some kept context ends strictly below node n (pre-order, so reverse)."""
    below = [False] * len(trie.nodes)
    for n in reversed(trie.nodes):
        if n.parent >= 0 and (below[n.index] or n.index in ends):
            below[n.parent] = True
    return below


def select_paths(
    candidates: Sequence[Candidate], *, max_paths: int | None, order: str, seed: int,
    episode_id: str, tries: Sequence[SessionTrie] = (),
) -> list[Candidate]:
    """At most `max_paths` candidates (None or 0: all), by role priority then `order`.

    `tries` (the episode's, indexed like `Candidate.session`) is needed by "coverage"."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "coverage":
        return _by_coverage(candidates, tries, max_paths)
    if order == "longest":
        ranked = sorted(
            candidates, key=lambda c: (role_key(c.role), -c.tokens, c.seq, c.compaction)
        )
    else:
        rng = np.random.default_rng([seed, zlib.crc32(episode_id.encode())])
        rank = rng.permutation(len(candidates))
        ranked = [
            c for _, c in sorted(
                zip(rank.tolist(), candidates, strict=True),
                key=lambda rc: (role_key(rc[1].role), rc[0]),
            )
        ]
    return ranked[:max_paths] if max_paths else ranked


def _by_coverage(
    candidates: Sequence[Candidate], tries: Sequence[SessionTrie], max_paths: int | None
) -> list[Candidate]:
    """Greedy: within each role tier, repeatedly take the path that adds the most model
    tokens not yet carried by a chosen path (ties: more tokens, then earlier commit).
    A summary sample's gain is its output length (its own tree)."""
    if candidates and len(tries) <= max(c.session for c in candidates):
        raise ValueError("order 'coverage' needs the episode's tries")
    cum: dict[int, list[int]] = {}
    covered: dict[int, set[int]] = defaultdict(set)

    def cum_model(si: int) -> list[int]:
        if si not in cum:
            out = [0] * len(tries[si].nodes)
            for n in tries[si].nodes:  # pre-order: parents first
                base = out[n.parent] if n.parent >= 0 else 0
                out[n.index] = base + (len(n) if n.model else 0)
            cum[si] = out
        return cum[si]

    def gain(c: Candidate) -> int:
        trie = tries[c.session]
        if c.compaction:
            return int(trie.calls[c.call].call.output_ids.shape[0])
        leaf = trie.places[c.call].context_end
        if leaf < 0:
            return 0
        cm = cum_model(c.session)
        cov = covered[c.session]
        node = leaf
        while node != -1 and node not in cov:
            node = trie.nodes[node].parent
        return cm[leaf] - (cm[node] if node != -1 else 0)

    def cover(c: Candidate) -> None:
        if c.compaction:
            return
        trie = tries[c.session]
        cov = covered[c.session]
        node = trie.places[c.call].context_end
        while node != -1 and node not in cov:
            cov.add(node)
            node = trie.nodes[node].parent

    limit = max_paths or len(candidates)
    tiers: dict[tuple[int, str], list[Candidate]] = defaultdict(list)
    for c in candidates:
        tiers[role_key(c.role)].append(c)
    chosen: list[Candidate] = []
    for key in sorted(tiers):
        pool = list(tiers[key])
        while pool and len(chosen) < limit:
            best = max(pool, key=lambda c: (gain(c), c.tokens, -c.seq, not c.compaction))
            pool.remove(best)
            chosen.append(best)
            cover(best)
    return chosen


# ------------------------------------------------------------------------------ emit


@dataclass(frozen=True)
class BranchSpec:
    """What a chosen path becomes: its advantage, coefficient, group and labels."""

    advantage: float
    coef: float
    norm_group: str
    reward: float


def _segment(nodes: Sequence[Any]) -> Segment:
    toks = [n.token_ids for n in nodes]
    mask = [np.full(len(n), n.model, np.bool_) for n in nodes]
    lps = [
        n.logprobs if n.logprobs is not None else np.zeros(len(n), np.float32) for n in nodes
    ]
    pvs = [np.full(len(n), n.policy_version if n.model else -1, np.int32) for n in nodes]

    def cat(parts: list[Any], dtype: Any) -> Any:
        # Always a fresh, writable array (ledger arrays are read-only buffer views).
        return np.concatenate(parts).astype(dtype, copy=False) if len(parts) > 1 \
            else np.array(parts[0], dtype=dtype)

    return Segment(
        parent=-1, token_ids=cat(toks, np.int32), model_mask=cat(mask, np.bool_),
        logprobs=cat(lps, np.float32), policy_versions=cat(pvs, np.int32),
    )


def trie_trees(
    trie: SessionTrie, chosen: Sequence[tuple[Candidate, BranchSpec]], tree_id: str
) -> list[TrainTree]:
    """The TrainTrees (one per trie root) holding the chosen paths of one session."""
    end_of = {c.call: trie.places[c.call].context_end for c, _ in chosen}
    marked: set[int] = set()
    for end in end_of.values():
        node = end
        while node != -1 and node not in marked:
            marked.add(node)
            node = trie.nodes[node].parent
    chosen_ends = set(end_of.values())
    trees: list[TrainTree] = []
    for k, root in enumerate(r for r in trie.roots if r in marked):
        segs: list[Segment] = []
        seg_of_node: dict[int, int] = {}
        stack: list[tuple[int, int]] = [(root, -1)]
        while stack:
            start, parent_seg = stack.pop()
            run = [start]
            while True:
                kids = [c for c in trie.nodes[run[-1]].children if c in marked]
                if len(kids) == 1 and run[-1] not in chosen_ends:
                    run.append(kids[0])
                    continue
                break
            seg = _segment([trie.nodes[i] for i in run])
            segs.append(Segment(parent_seg, seg.token_ids, seg.model_mask, seg.logprobs,
                                seg.policy_versions))
            si = len(segs) - 1
            seg_of_node[run[-1]] = si
            stack.extend((c, si) for c in reversed(kids))
        branches = tuple(
            Branch(
                leaf=seg_of_node[end_of[c.call]], advantage=s.advantage, coef=s.coef,
                norm_group=s.norm_group, role=c.role, session_id=c.session_id,
                call_id=c.call_id, reward=s.reward,
            )
            for c, s in sorted(chosen, key=lambda cs: cs[0].seq)
            if end_of[c.call] in seg_of_node
        )
        tid = tree_id if k == 0 else f"{tree_id}#{k}"
        trees.append(TrainTree(tid, tuple(segs), branches))
    return trees


def compaction_tree(
    trie: SessionTrie, cand: Candidate, spec: BranchSpec, tree_id: str
) -> TrainTree:
    """A summary call as its own sample: its prompt untrained, its output trained."""
    place = trie.places[cand.call]
    call = trie.calls[cand.call].call
    prompt = (
        trie.path_ids(place.prompt_end) if place.prompt_end >= 0 else np.zeros(0, np.int32)
    )
    n_p, n_o = int(prompt.shape[0]), int(call.output_ids.shape[0])
    seg = Segment(
        parent=-1,
        token_ids=np.concatenate([prompt, call.output_ids]).astype(np.int32, copy=False),
        model_mask=np.concatenate([np.zeros(n_p, np.bool_), np.ones(n_o, np.bool_)]),
        logprobs=np.concatenate([np.zeros(n_p, np.float32), call.output_logprobs]),
        policy_versions=np.concatenate(
            [np.full(n_p, -1, np.int32), np.full(n_o, call.policy_version, np.int32)]
        ),
    )
    br = Branch(leaf=0, advantage=spec.advantage, coef=spec.coef, norm_group=spec.norm_group,
                role=cand.role, session_id=cand.session_id, call_id=cand.call_id,
                reward=spec.reward)
    return TrainTree(tree_id, (seg,), (br,))


def branch_specs(
    chosen: Sequence[Candidate], *, episode_id: str, reward: float, baseline: float,
    scale: float, normalisation: str,
) -> list[BranchSpec]:
    """Advantage, coef and norm group of each chosen path (docs/trees.md)."""
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {normalisation!r}")
    out: list[BranchSpec] = []
    n = len(chosen)
    for c in chosen:
        r = c.own_reward if c.own_reward is not None else reward
        adv = (r - baseline) / scale
        if normalisation == "two_level":
            out.append(BranchSpec(adv, 1.0 / n, episode_id, r))
        elif normalisation == "token":
            out.append(BranchSpec(adv, 1.0 / n, BATCH_GROUP, r))
        else:
            out.append(BranchSpec(adv, 1.0, f"{episode_id}|{c.session_id}|{c.call_id}"
                                  f"{'|summary' if c.compaction else ''}", r))
    return out


def emit_trees(
    graph: EpisodeGraph, chosen: Sequence[Candidate], specs: Sequence[BranchSpec]
) -> list[TrainTree]:
    """The episode's TrainTrees: one per trie root holding a chosen path (root session
    first, then subagents in episode order), then one per chosen summary sample."""
    ep = graph.episode_id
    trees: list[TrainTree] = []
    per_session: dict[int, list[tuple[Candidate, BranchSpec]]] = defaultdict(list)
    summaries: list[tuple[Candidate, BranchSpec]] = []
    for c, s in zip(chosen, specs, strict=True):
        (summaries if c.compaction else per_session[c.session]).append((c, s))
    for si in sorted(per_session):
        sid = graph.sessions[si].session_id
        tid = ep if si == 0 else f"{ep}/{sid}"
        trees.extend(trie_trees(graph.tries[si], per_session[si], tid))
    for n, (c, s) in enumerate(sorted(summaries, key=lambda cs: cs[0].seq)):
        trees.append(compaction_tree(graph.tries[c.session], c, s, f"{ep}/compaction/{n}"))
    return trees


# ------------------------------------------------------------------------------ driver


@dataclass(frozen=True)
class EpisodeReport:
    """What `tidal trees --json` prints for one episode (keyed by `episode_id`)."""

    episode_id: str
    task_id: str | None
    status: str
    reward: float | None  # after the status policy; None when masked
    masked: bool
    sessions: int
    calls: int
    nodes: int
    leaves: int
    unique_tokens: int
    path_tokens: int
    edges: dict[str, int]
    candidates: int
    sampled_paths: int
    redundant_identical: int
    redundant_prefix: int
    masked_sessions: int
    trained_tokens: int  # unique tokens of the emitted trees
    error: str | None = None
    inferred_edges: dict[str, int] = field(default_factory=dict)  # of `edges`, inferred

    @property
    def dedup_ratio(self) -> float:
        return self.path_tokens / self.unique_tokens if self.unique_tokens else 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "leaves": self.leaves,
            "unique_tokens": self.unique_tokens,
            "path_tokens": self.path_tokens,
            "dedup_ratio": round(self.dedup_ratio, 4),
            "edges": self.edges,
            "inferred_edges": self.inferred_edges,
            "sampled_paths": self.sampled_paths,
            "status": self.status,
            "reward": self.reward,
            "task_id": self.task_id,
            "masked": self.masked,
            "sessions": self.sessions,
            "calls": self.calls,
            "candidates": self.candidates,
            "redundant": {"identical": self.redundant_identical, "prefix": self.redundant_prefix},
            "masked_sessions": self.masked_sessions,
            "trained_tokens": self.trained_tokens,
            "error": self.error,
        }


@dataclass(frozen=True, eq=False)
class ProcessResult:
    trees: tuple[TrainTree, ...]
    episodes: tuple[EpisodeReport, ...]
    graphs: tuple[EpisodeGraph, ...] = field(default=(), repr=False)

    def to_json(self) -> dict[str, Any]:
        return {e.episode_id: e.to_json() for e in self.episodes}


def process_sessions(
    sessions: Sequence[SessionData],
    *,
    max_paths: int | None = 5,
    order: str = "coverage",
    seed: int = 0,
    incomplete: str = "partial",
    advantage: str = "mean",
    normalisation: str = "two_level",
    compaction_samples: bool = False,
    strict: bool = True,
    keep_graphs: bool = False,
    infer_compaction: bool = True,
) -> ProcessResult:
    """Sessions -> episodes -> TrainTrees and per-episode reports.

    With `strict` (default) malformed input raises `TreeError`; otherwise the faulty
    episode is reported with its error, masked, and the rest is processed.
    `infer_compaction` (default on) types a silent compaction by the summary its fresh
    context carries (`tidal.tree.compaction`); off, only parent links make one."""
    for name, val, allowed in (
        ("order", order, ORDERS), ("incomplete", incomplete, INCOMPLETE_POLICIES),
        ("advantage", advantage, ADVANTAGES), ("normalisation", normalisation, NORMALISATIONS),
    ):
        if val not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {val!r}")
    graphs: list[EpisodeGraph | None] = []
    errors: list[str | None] = []
    groups = group_episodes(sessions)
    for ep in groups:
        try:
            graphs.append(build_episode(ep, infer_compaction=infer_compaction))
            errors.append(None)
        except TreeError as e:
            if strict:
                raise
            graphs.append(None)
            errors.append(str(e))
    statuses: dict[str, tuple[str, float | None]] = {}
    for ep, g in zip(groups, graphs, strict=True):
        root = ep[0]
        st, r = resolve_reward(root.outcome, incomplete)
        statuses[root.session_id] = (st, None if g is None else r)
    baselines = group_baselines(
        {
            ep[0].session_id: (ep[0].task_id or ep[0].session_id, statuses[ep[0].session_id][1])
            for ep in groups
        },
        advantage,
    )
    trees: list[TrainTree] = []
    reports: list[EpisodeReport] = []
    for ep, g, err in zip(groups, graphs, errors, strict=True):
        eid = ep[0].session_id
        st, reward = statuses[eid]
        if g is None:
            reports.append(EpisodeReport(
                eid, ep[0].task_id, st, None, True, len(ep), sum(len(s.calls) for s in ep),
                0, 0, 0, 0, {}, 0, 0, 0, 0, 0, 0, err,
            ))
            continue
        cs = find_candidates(g, compaction_samples=compaction_samples)
        ep_trees: list[TrainTree] = []
        chosen: list[Candidate] = []
        if reward is not None:
            chosen = select_paths(cs.candidates, max_paths=max_paths, order=order, seed=seed,
                                  episode_id=eid, tries=g.tries)
            base, scale = baselines[eid]
            specs = branch_specs(chosen, episode_id=eid, reward=reward, baseline=base,
                                 scale=scale, normalisation=normalisation)
            ep_trees = emit_trees(g, chosen, specs)
        trees.extend(ep_trees)
        reports.append(EpisodeReport(
            episode_id=eid,
            task_id=g.task_id,
            status=st,
            reward=reward,
            masked=reward is None,
            sessions=len(g.sessions),
            calls=sum(len(t.calls) for t in g.tries),
            nodes=sum(len(t.nodes) for t in g.tries),
            leaves=sum(len(t.leaves) for t in g.tries),
            unique_tokens=sum(t.unique_tokens for t in g.tries),
            path_tokens=sum(t.path_tokens for t in g.tries),
            edges=g.edge_counts(),
            inferred_edges=g.inferred_counts(),
            candidates=len(cs.candidates),
            sampled_paths=sum(len(t.branches) for t in ep_trees),
            redundant_identical=cs.identical,
            redundant_prefix=cs.prefix,
            masked_sessions=cs.masked_sessions,
            trained_tokens=sum(t.unique_tokens for t in ep_trees),
        ))
    kept = tuple(g for g in graphs if g is not None) if keep_graphs else ()
    return ProcessResult(tuple(trees), tuple(reports), kept)


def process_store(
    store: LedgerStore, session_ids: Iterable[str] | None = None, **options: Any
) -> ProcessResult:
    """Read a ledger store and process it (`options`: those of `process_sessions`)."""
    return process_sessions(load_sessions(store, session_ids), **options)
