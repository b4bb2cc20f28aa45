"""The embedded engine alone on a finished run's own calls, as they arrived: how much of the
run's rollout speed its engine accounts for, and how much the run around it costs.

Reads one phase of a run directory's ledger (`--phase rl-3`: RL step 3's sessions,
dynamic sampling's re-rolls included; `evalstart-0`, `eval-6`: an evaluation), then runs
its sessions again against a fresh `EmbeddedEngine` built with the run's engine settings
(model, `max_batch_size`, `prefix_cache_mb`, `matmul_dtype`, `kv_dtype`): each session
starts when it started in the run, and each call is sent as long after the previous one's
answer as the run's tools and harness took between them (the recorded gap). A call asks
for as many tokens as the run sampled (no stop token, so it gets exactly that many) and
extends the replayed history, not the recorded one: prompt k+1 is replayed prompt k, its
replayed output and the tokens the run appended after them, so prompt lengths and what
the prefix cache can serve are the run's. Nothing else runs beside the engine: no gateway,
harness, sandbox or trainer.

Prints JSON: the run's generated tokens a second over the phase's span (first call's start
to last call's end) and the replay's over its own, their ratio (`run_over_replay`: 1.0
means the run costs its engine nothing), and both engines' counters (per decode step
milliseconds and mean live batch, prefill tokens a second; the run's from the phase's
row in metrics.jsonl). `--at-once` starts every session at the start instead, so that the
engine's pace, not the run's schedule, sets the replay's length (the run's re-rolled
groups waited for their first roll's grades).

    .venv/bin/python bench/engine_replay.py runs/real --phase rl-3 [--at-once] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidal.engine.base import Engine, SamplingParams
from tidal.engine.embedded import EmbeddedEngine
from tidal.engine.tiny import resolve_model
from tidal.ledger.store import LedgerStore
from tidal.run.config import load_config


@dataclass(frozen=True)
class ReplayCall:
    delay_s: float  # after the previous call's answer (the first: after the phase began)
    appended: tuple[int, ...]  # tokens after the previous call's prompt and output
    restart: bool  # the prompt does not extend the previous one: `appended` is all of it
    max_tokens: int
    seed: int


def phase_sessions(store: LedgerStore, phase: str) -> tuple[list[list[ReplayCall]], float, int]:
    """The phase's sessions as replay calls, its span in the run (seconds) and the tokens
    the run generated in it."""
    prefix = f"{phase}-"
    logs = [store.call_log(s) for s in store.session_ids() if s.startswith(prefix)]
    if not logs:
        raise SystemExit(f"no session of phase {phase!r} in the ledger (ids start with "
                         "'<phase>-', e.g. rl-3, evalstart-0, eval-6)")
    calls = [[log.full_call(c.call_id) for c in log.calls] for log in logs]
    t0 = min(c[0].started_at for c in calls)
    t1 = max(c.ended_at for cs in calls for c in cs)
    sessions = []
    for cs in calls:
        out, prev_end, prev_ctx = [], t0, np.zeros(0, np.int32)
        for c in sorted(cs, key=lambda c: c.started_at):
            prompt = np.asarray(c.prompt_ids)
            extends = prompt.shape[0] >= prev_ctx.shape[0] > 0 and np.array_equal(
                prompt[: prev_ctx.shape[0]], prev_ctx)
            rest = prompt[prev_ctx.shape[0]:] if extends else prompt
            out.append(ReplayCall(max(0.0, c.started_at - prev_end),
                                  tuple(int(x) for x in rest), not extends,
                                  int(c.output_ids.shape[0]), int(c.sampling.get("seed") or 0)))
            prev_end, prev_ctx = c.ended_at, np.concatenate([prompt, c.output_ids])
        sessions.append(out)
    generated = sum(int(c.output_ids.shape[0]) for cs in calls for c in cs)
    return sessions, t1 - t0, generated


@dataclass(frozen=True)
class Replayed:
    seconds: float
    generated: int
    prompt_lengths: list[list[int]]  # per session, per call: the prompt sent


def replay(engine: Engine, sessions: list[list[ReplayCall]], *,
           at_once: bool = False) -> Replayed:
    """Run the sessions against `engine` with their recorded timing (`at_once`: every
    session's first call at the start, the later calls' gaps as recorded)."""
    start = threading.Event()
    t0 = [0.0]

    def run(calls: list[ReplayCall]) -> tuple[int, list[int]]:
        start.wait()
        ctx: list[int] = []
        generated, ready, lengths = 0, t0[0], []
        for k, c in enumerate(calls):
            delay = 0.0 if at_once and k == 0 else c.delay_s
            time.sleep(max(0.0, ready + delay - time.perf_counter()))
            prompt = list(c.appended) if c.restart else ctx + list(c.appended)
            params = SamplingParams(max_tokens=c.max_tokens, temperature=1.0, seed=c.seed)
            out = engine.generate([prompt], params)[0].output_ids.tolist()
            generated += len(out)
            lengths.append(len(prompt))
            ctx, ready = prompt + out, time.perf_counter()
        return generated, lengths

    with ThreadPoolExecutor(len(sessions)) as pool:
        futures = [pool.submit(run, s) for s in sessions]
        t0[0] = time.perf_counter()
        start.set()
        done = [f.result() for f in futures]
    return Replayed(time.perf_counter() - t0[0], sum(g for g, _ in done),
                    [lengths for _, lengths in done])


def engine_figures(m: dict[str, Any]) -> dict[str, float]:
    """The engine's counters: prefills run apart (`prefills`, `prefill_s`) and folded into
    decode steps (`folded_prefills`, their seconds in `decode_s`)."""
    return {"decode_ms": round(1000 * m["decode_s"] / max(1, m["decode_steps"]), 1),
            "mean_batch": round(m["mean_batch"], 1),
            "decode_s": round(m["decode_s"], 1), "prefill_s": round(m["prefill_s"], 1),
            "prefills": m["prefills"], "folded_prefills": m.get("folded_prefills", 0),
            "prompt_tokens_run": m["prompt_tokens"] - m["cached_tokens"],
            "busy_s": round(m["busy_s"], 1)}


def run_row(run: Path, phase: str) -> dict[str, Any] | None:
    """The phase's row in the run's metrics.jsonl (its engine counters), if any."""
    kind, _, step = phase.rpartition("-")
    want = {"rl": "rl", "eval": "eval", "evalstart": "eval"}.get(kind)
    path = run / "metrics.jsonl"
    if want is None or not path.is_file():
        return None
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("phase") == want and str(r.get("step")) == step and "decode_s" in (
                r.get("engine") or r):
            return r.get("engine") or r
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run directory (ledger.db, config.toml)")
    ap.add_argument("--phase", default="rl-1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--at-once", action="store_true",
                    help="start every session at once (the engine's pace, not the run's "
                         "schedule: a re-rolled group no longer waits for its first roll)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.run / "config.toml")
    with LedgerStore(args.run / "ledger.db", readonly=True) as store:
        sessions, span, run_tokens = phase_sessions(store, args.phase)
    eng = EmbeddedEngine(resolve_model(cfg.model.name), max_batch_size=cfg.engine.max_batch_size,
                         seed=0, prefix_cache_mb=cfg.rollout.prefix_cache_mb,
                         matmul_dtype=cfg.engine.matmul_dtype, kv_dtype=cfg.engine.kv_dtype)
    try:
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # build the kernels' caches
        eng.metrics()
        r = replay(eng, sessions, at_once=args.at_once)
        m = eng.metrics()
    finally:
        eng.close()
    row = run_row(args.run, args.phase)
    print(json.dumps({
        "run": str(args.run), "phase": args.phase, "at_once": args.at_once,
        "sessions": len(sessions),
        "calls": sum(len(s) for s in sessions),
        "run_seconds": round(span, 1), "run_generated": run_tokens,
        "run_tokens_per_s": round(run_tokens / span, 1),
        "replay_seconds": round(r.seconds, 1), "replay_generated": r.generated,
        "replay_tokens_per_s": round(r.generated / r.seconds, 1),
        "run_over_replay": round((run_tokens / span) / (r.generated / r.seconds), 2),
        "replay_engine": engine_figures(m),
        "run_engine": engine_figures(row) if row else None,
    }))


if __name__ == "__main__":
    main()
