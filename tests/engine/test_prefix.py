"""The prefix cache: longest-prefix lookup, superseded entries, LRU budget, collisions;
and the embedded engine reading its prompts' prefixes from it."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.engine.reference import forward_logprobs
from tidal.engine.base import SamplingParams, Weights
from tidal.engine.batch import SequenceRequest
from tidal.engine.embedded import EmbeddedEngine
from tidal.engine.prefix import PrefixCache

B = 4  # a small block, so hand-made sequences span several


def seq(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def SequenceRequestFor(prompt: list[int], *, seed: int) -> SequenceRequest:  # noqa: N802
    return SequenceRequest(tuple(prompt), SamplingParams(max_tokens=6), seed=seed)


def test_lookup_finds_the_longest_prefix_and_leaves_one_token() -> None:
    cache = PrefixCache(10**6, block=B)
    a, b = seq(10), [*seq(6), 7, 7, 7, 7, 7, 7]  # share 6 tokens, then diverge
    assert cache.insert(a, "A", 10) and cache.insert(b, "B", 10)
    assert cache.lookup([*seq(10), 1, 2]) == (10, "A")  # all of a
    assert cache.lookup(seq(10)) == (9, "A")  # never the whole prompt
    assert cache.lookup([*seq(9), 0]) == (9, "A")  # into the partial block
    assert cache.lookup([*seq(6), 7, 7, 7, 0, 0]) == (9, "B")
    assert cache.lookup(seq(3) + [0] * 10) == (0, None)  # under one block: no hit
    assert cache.lookup([5] * 20) == (0, None)
    stats = cache.stats
    assert (stats.lookups, stats.hits, stats.tokens_reused, stats.entries) == (6, 4, 37, 2)


def test_prompts_sharing_an_uncached_prefix_wait_for_the_first() -> None:
    """`waiting`: a prompt sharing at least `gain` tokens (whole blocks) more with an
    earlier one of the call than the cache holds waits; what the cache already holds, or
    a share under `gain`, does not make it wait."""
    cache = PrefixCache(10**6, block=B)
    a = seq(20)
    prompts = [a, a, [*seq(12), 1, 2, 3, 4, 5, 6], seq(20, start=500), [*seq(4), 9, 9, 9, 9, 9]]
    assert cache.waiting(prompts, gain=8) == [1, 2]  # 16 and 12 shared; 4 is under gain
    assert cache.waiting([seq(30, start=900), prompts[2], prompts[3]], gain=8) == []
    cache.insert(seq(16), "A", 16)
    assert cache.waiting(prompts, gain=8) == []  # the cache holds what they share
    assert cache.waiting([seq(40), seq(40)], gain=8) == [1]  # 36 shared, 16 held
    assert (cache.stats.lookups, cache.stats.hits) == (0, 0)  # it changed nothing


def test_a_groups_identical_prompts_are_prefilled_once(tiny_dir: Path) -> None:
    """Eight sessions of one task (a GRPO group) send their identical first prompt at once:
    one computes it, the seven others read it from the cache (all but its last block),
    and they sample what they would have alone."""
    from tidal.engine.batch import DecodeBatch
    from tidal.engine.embedded import EmbeddedEngine, batch_class

    prompt = [(t * 37) % 5000 + 100 for t in range(150)]
    with EmbeddedEngine(tiny_dir, batch_wait_s=0.0) as eng:
        model = eng.model
    kind: type[DecodeBatch] = batch_class(model)
    reqs = [SequenceRequestFor(prompt, seed=i) for i in range(8)]
    batch = kind(model, max_context=512, pad_id=0, prefix=PrefixCache(64 << 20))
    batch.admit(reqs, list(range(8)))
    done = {}
    while len(batch):
        batch.step()
        done.update(dict(batch.pop_finished()))
    cached = [done[i].cached_tokens for i in range(8)]
    assert cached[0] == 0 and all(c >= len(prompt) - 16 for c in cached[1:]), cached
    for i in range(8):
        alone = kind(model, max_context=512, pad_id=0)
        alone.admit([reqs[i]], [i])
        while len(alone):
            alone.step()
        [(_, want)] = alone.pop_finished()
        assert done[i].output_ids == want.output_ids
        np.testing.assert_allclose(done[i].logprobs, want.logprobs, atol=1e-4, rtol=0)


def test_an_extended_entry_is_dropped_and_a_covered_one_not_added() -> None:
    cache = PrefixCache(10**6, block=B)
    cache.insert(seq(8), "call 1", 8)
    cache.insert(seq(13), "call 2", 13)  # call 2's history extends call 1's
    assert len(cache) == 1 and cache.stats.nbytes == 13
    assert cache.lookup(seq(9)) == (8, "call 2")
    assert not cache.insert(seq(12), "shorter", 12)  # held already by call 2
    assert len(cache) == 1
    cache.insert(seq(8) + [1] * 8, "branch", 16)  # shares 8 tokens: both kept
    assert len(cache) == 2
    assert cache.lookup([*seq(13), 0]) == (13, "call 2")
    assert cache.lookup(seq(8) + [1] * 9) == (16, "branch")


def test_least_recently_used_entries_go_first_within_the_budget() -> None:
    cache = PrefixCache(100, block=B)
    for i in range(3):
        cache.insert(seq(8, start=1000 * i), i, 40)  # 120 bytes > 100: entry 0 goes
    assert cache.lookup(seq(9, start=0)) == (0, None)
    assert cache.lookup(seq(9, start=1000))[1] == 1  # 1 is now the most recent
    cache.insert(seq(8, start=5000), 5, 40)  # evicts 2, the least recent
    assert cache.lookup(seq(9, start=2000)) == (0, None)
    assert cache.lookup(seq(9, start=1000))[1] == 1
    assert cache.stats.evicted == 2 and cache.stats.nbytes == 80
    assert not cache.insert(seq(8, start=7000), "too big", 101)
    assert not cache.insert(seq(B - 1), "too short", 1)
    cache.clear()
    assert len(cache) == 0 and cache.stats.nbytes == 0
    assert cache.lookup(seq(9, start=1000)) == (0, None)
    with pytest.raises(ValueError, match="capacity_bytes"):
        PrefixCache(-1)


class CollidingCache(PrefixCache):
    """Every block at the same depth hashes alike: lookups must check the tokens."""

    @staticmethod
    def _chain(previous: int, block: bytes) -> int:
        return previous + 1


def test_a_hash_collision_is_a_miss_never_a_wrong_prefix() -> None:
    cache = CollidingCache(10**6, block=B)
    cache.insert(seq(12), "A", 12)
    assert cache.lookup([*seq(12, start=500), 0]) == (0, None)
    assert cache.lookup([*seq(12), 0]) == (12, "A")
    cache.insert(seq(12, start=500), "B", 12)  # collides with A on every block: both kept
    assert len(cache) == 2
    assert cache.lookup([*seq(12, start=500), 0]) == (12, "B")


# -- the engine -----------------------------------------------------------------------------


Call = tuple[list[int], list[int], np.ndarray, int]  # prompt, output, logprobs, cached


def agent_session(eng: EmbeddedEngine, first: list[int], calls: int, seed: int) -> list[Call]:
    """An agent's calls: each prompt is the last prompt, its output and a tool result.
    Returns (prompt, output, logprobs, cached tokens) per call."""
    rng = np.random.default_rng(seed)
    prompt, out = first, []
    for k in range(calls):
        gen = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0,
                                                    seed=seed * 100 + k))[0]
        out.append((prompt, gen.output_ids.tolist(), gen.logprobs,
                    int(gen.extra["cached_tokens"])))
        prompt = prompt + gen.output_ids.tolist() + rng.integers(1000, 9000, 20).tolist()
    return out


def run_sessions(eng: EmbeddedEngine, n: int, calls: int) -> list[list[Call]]:
    results: list[list[Call]] = [[] for _ in range(n)]

    def one(i: int) -> None:
        first = np.random.default_rng(1000 + i).integers(1000, 9000, 40 + 13 * i).tolist()
        results[i] = agent_session(eng, first, calls, seed=i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("numerics", ["standard", "consistent"])
def test_engine_calls_prefill_only_what_follows_the_last_call(
    tiny_dir: Path, numerics: str
) -> None:
    """Four concurrent agent sessions, then one call of three prompts prefilled together
    with different cached lengths (two continue a session, one is new). From a session's
    second call on, a call reads all of the previous call's context from the cache, and
    the logprobs are still the model's: in standard numerics to float noise, in
    consistent numerics exactly those of the same run without a cache."""
    runs, batched = {}, {}
    for mb in (0.0, 64.0):
        with EmbeddedEngine(tiny_dir, numerics=numerics, prefix_cache_mb=mb,
                            batch_wait_s=0.05) as eng:
            runs[mb] = sessions = run_sessions(eng, 4, 3)
            prompts = [sessions[i][-1][0] + sessions[i][-1][1] + [7, 8, 9] for i in (0, 1)]
            prompts.append(list(range(2000, 2050)))
            gens = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=1.0, seed=9))
            batched[mb] = [(p, g.output_ids.tolist(), g.logprobs, int(g.extra["cached_tokens"]))
                           for p, g in zip(prompts, gens, strict=True)]
            stats = eng.prefix_stats
            metrics, again = eng.metrics(), eng.metrics()
        every = [c for s in sessions for c in s] + batched[mb]
        assert metrics["requests"] == 4 * 3 + 3
        assert metrics["prompt_tokens"] == sum(len(p) for p, *_ in every)
        assert metrics["cached_tokens"] == sum(c for *_, c in every)
        assert metrics["generated_tokens"] == sum(len(o) for _, o, *_ in every)
        assert metrics["prefix_cache_hit_rate"] == pytest.approx(
            metrics["cached_tokens"] / metrics["prompt_tokens"])
        assert metrics["busy_s"] == pytest.approx(metrics["prefill_s"] + metrics["decode_s"])
        assert metrics["decode_steps"] > 0 and 1 <= metrics["mean_batch"] <= 4
        assert (again["requests"], again["generated_tokens"], again["busy_s"]) == (0, 0, 0.0)
        if mb == 0:
            assert metrics["cached_tokens"] == 0
            assert stats is None
            continue
        assert [c for *_, c in batched[mb]] == [len(p) - 4 for p in prompts[:2]] + [0]
        for session in sessions:
            assert session[0][3] == 0
            for (p0, o0, _, _), (*_, cached) in itertools.pairwise(session):
                assert cached == len(p0) + len(o0) - 1  # all but the last sampled token
        assert stats is not None and (stats.hits, stats.entries) == (10, 5)
    calls = [c for s in runs[64.0] for c in s] + batched[64.0]
    if numerics == "consistent":
        uncached = [c for s in runs[0.0] for c in s] + batched[0.0]
        for (p, o, lp, _), (p2, o2, lp2, _) in zip(calls, uncached, strict=True):
            assert (p, o) == (p2, o2)
            np.testing.assert_array_equal(lp, lp2)
    else:
        with EmbeddedEngine(tiny_dir, prefix_cache_mb=0) as ref:
            for p, o, lp, _ in calls:
                want = forward_logprobs(ref.model, p, o).numpy()
                np.testing.assert_allclose(lp, want, atol=1e-4, rtol=0)


def test_weight_updates_empty_the_cache(tiny_dir: Path) -> None:
    with EmbeddedEngine(tiny_dir) as eng:
        prompt = list(range(1000, 1100))
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
        first = eng.generate([prompt], params)[0]
        longer = prompt + first.output_ids.tolist() + [5, 6, 7]
        assert eng.generate([longer], params)[0].extra["cached_tokens"] == 107
        eng.update_weights(Weights.of_state_dict(dict(eng.model.state_dict())), version=1)
        assert eng.generate([longer], params)[0].extra["cached_tokens"] == 0
        stats = eng.prefix_stats
        assert stats is not None and stats.entries == 1
