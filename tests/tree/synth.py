"""Synthetic sessions of every shape, written as real `Call`s into a real `LedgerStore`.

For tests and benchmarks of the processor and of other packages. Token ids are random
(seeded), logprobs are random negatives, times increase by one second per call. Every
shape follows the linking conventions of the gateway:
- a continuation's prompt is the previous context plus new tokens (a tool result);
- parallel tool calls are separate calls on the same context plus different results;
- a subagent is its own session whose calls carry parent_session_id / parent_call_id
  (the spawning call); the spawning session continues with the helper's answer;
- compaction: a summary call (role `<role>_summary`) on the full history, then a fresh
  context (system prompt + new text + the summary's output) whose first call has
  parent_call_id = the summary; with `declared=False`, as a third-party harness does
  it: no link, and the summary call recorded with the agent's own role (the processor
  infers the compaction from the carried summary, `tidal.tree.compaction`);
- a retry repeats a prompt exactly with a new output.

Deliberately simplified: the "text" of a call is a short description, not a decoding of
its tokens (there is no tokenizer in tidal.tree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Call, IdArray, Outcome, Status


def context(call: Call) -> IdArray:
    """A call's prompt followed by its output."""
    return np.concatenate([call.prompt_ids, call.output_ids])


class SynthWriter:
    """Appends synthetic calls and outcomes to a store; one writer per store."""

    def __init__(
        self, store: LedgerStore, *, seed: int = 0, vocab: int = 32000, policy_version: int = 0
    ) -> None:
        self.store = store
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.policy_version = policy_version
        self.clock = 1_700_000_000.0
        self.calls_written = 0

    def tokens(self, n: int) -> IdArray:
        """n fresh random token ids."""
        return self.rng.integers(1, self.vocab, size=n, dtype=np.int32)

    def call(
        self,
        session_id: str,
        call_id: str,
        role: str,
        prompt_ids: IdArray,
        n_out: int = 4,
        *,
        output_ids: IdArray | None = None,
        parent_call_id: str | None = None,
        parent_session_id: str | None = None,
        task_id: str | None = None,
        base_hint: str | None = None,
        text: str | None = None,
        raw_tool_calls: str | None = None,
        metadata: dict[str, object] | None = None,
    ) -> Call:
        out = self.tokens(n_out) if output_ids is None else np.asarray(output_ids, np.int32)
        n = int(out.shape[0])
        self.clock += 1.0
        call = Call(
            session_id=session_id,
            call_id=call_id,
            role=role,
            prompt_ids=np.asarray(prompt_ids, np.int32),
            output_ids=out,
            output_logprobs=-self.rng.random(n, dtype=np.float32),
            output_text=text if text is not None else f"{role} output of {call_id}",
            policy_version=self.policy_version,
            finish_reason="tool_calls" if raw_tool_calls else "stop",
            started_at=self.clock - 0.5,
            ended_at=self.clock,
            raw_tool_calls=raw_tool_calls,
            parent_call_id=parent_call_id,
            parent_session_id=parent_session_id,
            task_id=task_id,
            metadata=dict(metadata or {}),
        )
        self.store.append_call(call, base_hint=base_hint)
        self.calls_written += 1
        return call

    def outcome(
        self, session_id: str, status: Status | str = Status.COMPLETE, reward: float = 1.0,
        partial_score: float = 0.0,
    ) -> None:
        self.store.append_outcome(
            Outcome(session_id, Status(status), reward, partial_score, recorded_at=self.clock)
        )


# ------------------------------------------------------------------------------ shapes


def write_linear(
    w: SynthWriter, sid: str, *, task_id: str = "task", n_calls: int = 4, prompt_tokens: int = 16,
    tool_tokens: int = 8, out_tokens: int = 4, role: str = "main",
) -> list[Call]:
    """c0 on a fresh prompt, then each call on the previous context + a tool result."""
    calls = [w.call(sid, f"{sid}-c0", role, w.tokens(prompt_tokens), out_tokens, task_id=task_id,
                    raw_tool_calls='{"name": "run"}')]
    for i in range(1, n_calls):
        prompt = np.concatenate([context(calls[-1]), w.tokens(tool_tokens)])
        calls.append(w.call(sid, f"{sid}-c{i}", role, prompt, out_tokens, task_id=task_id))
    return calls


def write_fanout(
    w: SynthWriter, sid: str, *, task_id: str = "task", width: int = 3, prompt_tokens: int = 16,
    tool_tokens: int = 8, out_tokens: int = 4,
) -> list[Call]:
    """c0 emits `width` tool calls; each result is handled by its own call (p0..p{w-1}),
    and each of those is continued once (f0..f{w-1})."""
    c0 = w.call(sid, f"{sid}-c0", "main", w.tokens(prompt_tokens), out_tokens, task_id=task_id)
    calls = [c0]
    for k in range(width):
        p = w.call(sid, f"{sid}-p{k}", "main",
                   np.concatenate([context(c0), w.tokens(tool_tokens)]), out_tokens,
                   base_hint=c0.call_id)
        calls.append(p)
    for k in range(width):
        p = calls[1 + k]
        calls.append(w.call(sid, f"{sid}-f{k}", "main",
                            np.concatenate([context(p), w.tokens(tool_tokens)]), out_tokens,
                            base_hint=p.call_id))
    return calls


def write_subagents(
    w: SynthWriter, sid: str, *, task_id: str = "task", width: int = 2, depth: int = 2,
    prompt_tokens: int = 16, tool_tokens: int = 8, out_tokens: int = 4,
) -> dict[str, list[Call]]:
    """Main call m0 spawns `width` subagent sessions `<sid>/s<k>`; each subagent runs two
    calls, and (depth > 1) its first call spawns `width` nested helpers `<sub>/s<k>`.
    After its helpers, each spawner continues once with their answers.
    Returns the calls per session id."""
    out: dict[str, list[Call]] = {}

    def run(session: str, role: str, parent: Call | None, level: int) -> None:
        first = w.call(
            session, f"{session.replace('/', '.')}-c0", role, w.tokens(prompt_tokens), out_tokens,
            task_id=task_id,
            parent_call_id=parent.call_id if parent else None,
            parent_session_id=parent.session_id if parent else None,
        )
        calls = [first]
        out[session] = calls
        if level < depth:
            for k in range(width):
                run(f"{session}/s{k}", "subagent", first, level + 1)
        nxt = w.call(
            session, f"{session.replace('/', '.')}-c1", role,
            np.concatenate([context(first), w.tokens(tool_tokens)]), out_tokens,
            task_id=task_id,
            parent_call_id=parent.call_id if parent else None,
            parent_session_id=parent.session_id if parent else None,
        )
        calls.append(nxt)

    run(sid, "main", None, 0)
    return out


def write_compaction(
    w: SynthWriter, sid: str, *, task_id: str = "task", n_compactions: int = 2,
    calls_per_context: int = 3, prompt_tokens: int = 16, tool_tokens: int = 8,
    out_tokens: int = 4, summary_tokens: int = 6, role: str = "main",
    parent: Call | None = None, declared: bool = True,
) -> list[Call]:
    """`n_compactions + 1` contexts of `calls_per_context` calls each; between them a
    summary call (role `<role>_summary`) on the full history, then a fresh context
    (the same system prompt + new text + the summary) whose first call links to the
    summary. `declared=False`: no link, and the summary call has role `role` (a silent
    harness; needs `summary_tokens` >= 9 for the processor to infer the compaction)."""
    system = w.tokens(prompt_tokens // 2)
    calls: list[Call] = []
    up_session = parent.session_id if parent else None
    up_call = parent.call_id if parent else None
    prompt = np.concatenate([system, w.tokens(prompt_tokens - prompt_tokens // 2)])
    summary: Call | None = None
    for ctx in range(n_compactions + 1):
        for i in range(calls_per_context):
            fresh = declared and i == 0 and summary is not None
            c = w.call(
                sid, f"{sid}-x{ctx}c{i}", role, prompt, out_tokens, task_id=task_id,
                parent_call_id=summary.call_id if fresh and summary else up_call,
                parent_session_id=None if fresh else up_session,
            )
            calls.append(c)
            prompt = np.concatenate([context(c), w.tokens(tool_tokens)])
        if ctx == n_compactions:
            break
        summary = w.call(sid, f"{sid}-x{ctx}sum", f"{role}_summary" if declared else role,
                         np.concatenate([context(calls[-1]), w.tokens(4)]), summary_tokens,
                         task_id=task_id, parent_call_id=up_call, parent_session_id=up_session,
                         text=f"summary {ctx}")
        calls.append(summary)
        prompt = np.concatenate([system, w.tokens(prompt_tokens // 2), summary.output_ids])
    return calls


def write_retries(
    w: SynthWriter, sid: str, *, task_id: str = "task", n_retries: int = 2,
    prompt_tokens: int = 16, tool_tokens: int = 8, out_tokens: int = 4,
) -> list[Call]:
    """c0, then c1 on its context; c1 is regenerated `n_retries` times with new outputs
    (r0..), and once more with exactly c1's output (`dup`: an identical path)."""
    c0 = w.call(sid, f"{sid}-c0", "main", w.tokens(prompt_tokens), out_tokens, task_id=task_id)
    prompt = np.concatenate([context(c0), w.tokens(tool_tokens)])
    c1 = w.call(sid, f"{sid}-c1", "main", prompt, out_tokens)
    calls = [c0, c1]
    for k in range(n_retries):
        calls.append(w.call(sid, f"{sid}-r{k}", "main", prompt, out_tokens))
    calls.append(w.call(sid, f"{sid}-dup", "main", prompt, output_ids=c1.output_ids))
    return calls


@dataclass(frozen=True)
class LongSessionSpec:
    """Shape of `write_long_session`: `n_calls` calls in all (main + helpers), about
    `tokens` stored tokens; every `subagent_every`-th main call spawns a helper session
    of `subagent_calls` calls, every `parallel_every`-th runs `parallel_width` parallel
    calls, every `compaction_every`-th compacts (summary + fresh context); with
    `declared=False` silently (no parent link, the summary call recorded as "main")."""

    n_calls: int = 500
    tokens: int = 1_000_000
    out_tokens: int = 200
    subagent_every: int = 50
    subagent_calls: int = 10
    parallel_every: int = 25
    parallel_width: int = 3
    compaction_every: int = 100
    status: Status = Status.COMPLETE
    reward: float = 1.0
    partial_score: float = 0.5
    roles: tuple[str, ...] = field(default=("main", "subagent"))
    declared: bool = True


def write_long_session(
    w: SynthWriter, sid: str, spec: LongSessionSpec, *, task_id: str = "long"
) -> int:
    """One long episode (see `LongSessionSpec`); returns the number of calls written."""
    per_call = max(1, spec.tokens // spec.n_calls - spec.out_tokens)
    written = 0
    system = w.tokens(64)
    prompt = np.concatenate([system, w.tokens(per_call)])
    link: str | None = None
    i = 0
    last: Call | None = None
    while written < spec.n_calls:
        c = w.call(sid, f"{sid}-m{i}", "main", prompt, spec.out_tokens, task_id=task_id,
                   parent_call_id=link, base_hint=last.call_id if last else None)
        written += 1
        link = None
        ctx = context(c)
        last = c
        if spec.parallel_every and i % spec.parallel_every == spec.parallel_every - 1:
            for k in range(spec.parallel_width - 1):
                if written >= spec.n_calls:
                    break
                w.call(sid, f"{sid}-m{i}p{k}", "main",
                       np.concatenate([ctx, w.tokens(per_call)]), spec.out_tokens,
                       base_hint=c.call_id)
                written += 1
        if spec.subagent_every and i % spec.subagent_every == spec.subagent_every - 1:
            sub = f"{sid}/sub{i}"
            sp = w.tokens(per_call)
            prev: Call | None = None
            for j in range(spec.subagent_calls):
                if written >= spec.n_calls:
                    break
                sprompt = (
                    sp if prev is None else np.concatenate([context(prev), w.tokens(per_call)])
                )
                prev = w.call(sub, f"{sub}-c{j}".replace("/", "."), "subagent", sprompt,
                              spec.out_tokens, task_id=task_id, parent_session_id=sid,
                              parent_call_id=c.call_id)
                written += 1
        if spec.compaction_every and i % spec.compaction_every == spec.compaction_every - 1 \
                and written < spec.n_calls:
            s = w.call(sid, f"{sid}-m{i}sum", "main_summary" if spec.declared else "main",
                       np.concatenate([ctx, w.tokens(32)]), spec.out_tokens, base_hint=c.call_id)
            written += 1
            prompt = np.concatenate([system, s.output_ids, w.tokens(per_call)])
            link = s.call_id if spec.declared else None
            last = None
        else:
            prompt = np.concatenate([ctx, w.tokens(per_call)])
        i += 1
    w.outcome(sid, spec.status, spec.reward, spec.partial_score)
    return written
