"""The exact prefix trie: shapes, model masks, misleading deltas, random sessions."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tree.synth import SynthWriter, context
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Call
from tidal.tree.trie import SessionTrie, TreeError, build_trie

from .conftest import stored


def _shape(trie: SessionTrie) -> list[tuple[int, list[int], bool, int]]:
    """(parent, tokens, model, writer call) per node, in pre-order."""
    return [(n.parent, n.token_ids.tolist(), n.model, n.call) for n in trie.nodes]


def test_continuation_shares_earlier_output_as_model_tokens() -> None:
    calls = [
        stored(1, "s", "a", None, 0, [1, 2, 3], [4, 5], logprob=-0.1, version=3),
        stored(2, "s", "b", "a", 5, [6, 7], [8], logprob=-0.2, version=4),
    ]
    trie = build_trie("s", calls)
    assert _shape(trie) == [
        (-1, [1, 2, 3], False, 0),
        (0, [4, 5], True, 0),
        (1, [6, 7], False, 1),
        (2, [8], True, 1),
    ]
    assert trie.nodes[1].policy_version == 3
    assert trie.nodes[3].policy_version == 4
    assert trie.nodes[1].logprobs is not None
    assert trie.nodes[1].logprobs.tolist() == pytest.approx([-0.1, -0.1])
    assert [p.prefix_parent for p in trie.places] == [-1, 0]
    assert [(p.prompt_end, p.context_end) for p in trie.places] == [(0, 1), (2, 3)]
    assert trie.path_ids(3).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


def test_misleading_delta_is_matched_exactly() -> None:
    # b's delta shares nothing (as if the store had not looked at a), yet its prompt
    # starts with a's whole context: the trie must reuse a's nodes.
    calls = [
        stored(1, "s", "a", None, 0, [1, 2, 3], [4, 5]),
        stored(2, "s", "b", None, 0, [1, 2, 3, 4, 5, 6], [7]),
        # c's delta points at a's prompt only, but c's prompt also extends b's context.
        stored(3, "s", "c", "a", 3, [4, 5, 6, 7, 9], [10]),
    ]
    trie = build_trie("s", calls)
    assert _shape(trie) == [
        (-1, [1, 2, 3], False, 0),
        (0, [4, 5], True, 0),
        (1, [6], False, 1),
        (2, [7], True, 1),
        (3, [9], False, 2),
        (4, [10], True, 2),
    ]
    assert [p.prefix_parent for p in trie.places] == [-1, 0, 1]
    assert trie.unique_tokens == 9


def test_output_that_matches_a_prompt_is_upgraded_to_model() -> None:
    calls = [
        stored(1, "s", "a", None, 0, [1, 2, 3, 7, 8], [9]),
        stored(2, "s", "b", None, 0, [1, 2, 3], [7, 8, 5], logprob=-0.3),
    ]
    trie = build_trie("s", calls)
    assert _shape(trie) == [
        (-1, [1, 2, 3], False, 0),
        (0, [7, 8], True, 1),
        (1, [9], True, 0),
        (1, [5], True, 1),
    ]
    lp = trie.nodes[1].logprobs
    assert lp is not None and lp.tolist() == pytest.approx([-0.3, -0.3])
    # a's prompt now ends inside b's output: a branches off b's output.
    assert trie.places[0].prompt_end == 1


def test_retry_diverging_inside_output_splits_it() -> None:
    calls = [
        stored(1, "s", "a", None, 0, [1, 2], [3, 4, 5]),
        stored(2, "s", "b", None, 0, [1, 2], [3, 4, 6]),
        stored(3, "s", "c", None, 0, [1, 2], [3, 4, 5]),  # identical to a
    ]
    trie = build_trie("s", calls)
    assert _shape(trie) == [
        (-1, [1, 2], False, 0),
        (0, [3, 4], True, 0),
        (1, [5], True, 0),
        (1, [6], True, 1),
    ]
    assert [p.retry_of for p in trie.places] == [-1, 0, 0]
    assert trie.places[2].context_end == trie.places[0].context_end == 2
    assert sorted(trie.leaves) == [2, 3]
    assert trie.path_tokens == 10


def test_fork_inside_an_earlier_prompt() -> None:
    calls = [
        stored(1, "s", "a", None, 0, [1, 2, 3, 4], [5]),
        stored(2, "s", "b", None, 0, [1, 2, 9], [6]),
    ]
    trie = build_trie("s", calls)
    assert trie.places[1].prefix_parent == -1
    assert trie.places[1].fork_from == 0
    assert len(trie.roots) == 1


def test_shared_len_and_path_tails() -> None:
    calls = [
        stored(1, "s", "a", None, 0, [1, 2, 3, 4], [5, 6]),
        stored(2, "s", "b", None, 0, [1, 2, 9, 9], [7]),  # leaves a's path after 2
        stored(3, "s", "c", "a", 6, [8], [9]),  # extends a: nothing new before 8
        stored(4, "s", "d", None, 0, [1, 2, 3], [4]),  # a prefix of a's prompt
        stored(5, "s", "e", None, 0, [7, 7], [1]),  # a new root
    ]
    trie = build_trie("s", calls)
    assert [p.shared_len for p in trie.places] == [0, 2, 6, 3, 0]
    end = trie.places[2].context_end
    full = trie.path_ids(end)
    assert full.tolist() == [1, 2, 3, 4, 5, 6, 8, 9]
    for start in range(10):
        assert trie.path_ids(end, start).tolist() == full[start:].tolist()


def _brute_model_mask(ctx: np.ndarray, contexts: list[np.ndarray], plens: list[int]) -> list[bool]:
    """Position i of a context is a model token iff some call sampled the token at i
    with the same history: plen_c <= i < lcp(ctx, context_c)."""
    mask = [False] * len(ctx)
    for c, pl in zip(contexts, plens, strict=True):
        m = min(len(ctx), len(c))
        neq = np.nonzero(ctx[:m] != c[:m])[0]
        lcp = int(neq[0]) if len(neq) else m
        for i in range(pl, lcp):
            mask[i] = True
    return mask


@pytest.mark.parametrize("seed", range(6))
def test_random_sessions_are_rebuilt_exactly(store: LedgerStore, seed: int) -> None:
    """Random prompts over a 3-token vocabulary (many accidental shared prefixes),
    written through the real store (which picks its own bases)."""
    w = SynthWriter(store, seed=seed, vocab=4)
    rng = np.random.default_rng(seed)
    calls: list[Call] = []
    for i in range(25):
        if calls and rng.random() < 0.8:
            base = context(calls[int(rng.integers(len(calls)))])
            cut = int(rng.integers(0, len(base) + 1))
            prompt = np.concatenate([base[:cut], w.tokens(int(rng.integers(0, 4)))])
        else:
            prompt = w.tokens(int(rng.integers(1, 5)))
        calls.append(w.call("r", f"c{i}", "main", prompt, int(rng.integers(0, 4))))
    log = store.call_log("r")
    trie = build_trie("r", log.calls)
    contexts = [log.context_ids(c.call_id) for c in calls]
    prefixes = {tuple(ctx[: k + 1].tolist()) for ctx in contexts for k in range(len(ctx))}
    assert trie.unique_tokens == len(prefixes)
    plens = [len(c.prompt_ids) for c in calls]
    for p, ctx, c in zip(trie.places, contexts, calls, strict=True):
        assert np.array_equal(ctx, context(c))
        path = trie.path(p.context_end) if p.context_end >= 0 else []
        got = np.concatenate([trie.nodes[n].token_ids for n in path]) if path else ctx[:0]
        assert got.tolist() == ctx.tolist()
        mask = [bool(trie.nodes[n].model) for n in path for _ in range(len(trie.nodes[n]))]
        assert mask == _brute_model_mask(ctx, contexts, plens)
        if p.prompt_end >= 0:
            assert trie.path_ids(p.prompt_end).tolist() == c.prompt_ids.tolist()
            assert trie.path_ids(p.prompt_end, 2).tolist() == c.prompt_ids[2:].tolist()
        # shared_len: the prompt's longest common prefix with the earlier contexts
        earlier = [ctx[: p.prompt_len] for ctx in contexts[: p.index]]
        lcp = max((int(np.argmax(np.append(e[: len(e)] != c.prompt_ids[: len(e)], True)))
                   for e in earlier), default=0)
        assert p.shared_len == min(lcp, p.prompt_len)
    # every node is one run of one source: a single writer call
    for n in trie.nodes:
        assert len(n) > 0
        assert all(trie.nodes[ch].parent == n.index for ch in n.children)


def test_malformed_deltas_name_the_session_and_call() -> None:
    with pytest.raises(TreeError, match=r"session 's', call 'b'.*'ghost'.*missing prefix"):
        build_trie("s", [stored(1, "s", "a", None, 0, [1], [2]),
                         stored(2, "s", "b", "ghost", 1, [3], [4])])
    with pytest.raises(TreeError, match=r"session 's', call 'a'.*'b'.*not an earlier"):
        build_trie("s", [stored(1, "s", "a", "b", 1, [1], [2]),
                         stored(2, "s", "b", None, 0, [3], [4])])
    with pytest.raises(TreeError, match=r"session 's', call 'b': prefix length 9 exceeds"):
        build_trie("s", [stored(1, "s", "a", None, 0, [1], [2]),
                         stored(2, "s", "b", "a", 9, [3], [4])])
    with pytest.raises(TreeError, match=r"session 'empty' has no calls"):
        build_trie("empty", [])
    with pytest.raises(TreeError, match=r"session 's', call 'a': duplicate call id"):
        build_trie("s", [stored(1, "s", "a", None, 0, [1], [2]),
                         stored(2, "s", "a", None, 0, [1], [3])])
