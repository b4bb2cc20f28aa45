"""DFS layout, position ids, ancestor masks, partitions and bad-tree errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.train.synthetic import random_tree
from tidal.train.attention import StreamPlan
from tidal.train.packing import PackedBatch, TreeTrainingError, pack_trees
from tidal.tree.types import Branch, Segment, TrainTree


def _trees(seed: int, n: int = 4) -> list[TrainTree]:
    rng = np.random.default_rng(seed)
    return [
        random_tree(rng, f"s{seed}-{i}", n_segments=int(rng.integers(1, 14)), max_len=12)
        for i in range(n)
    ]


def _token_paths(tree: TrainTree) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(segment, offset) -> list of (segment, offset) ancestors including itself, root first."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, seg in enumerate(tree.segments):
        prefix: list[tuple[int, int]] = []
        p = seg.parent
        chain = []
        while p != -1:
            chain.append(p)
            p = tree.segments[p].parent
        for j in reversed(chain):
            prefix += [(j, o) for o in range(len(tree.segments[j]))]
        for o in range(len(seg)):
            out[(i, o)] = [*prefix, *[(i, q) for q in range(o + 1)]]
    return out


def _check_batch(batch: PackedBatch) -> None:
    """Positions, keys visible to each query (all backends' masks) vs the ancestor relation."""
    seen_targets = 0
    for st in batch.streams:
        plan = StreamPlan(st, torch.device("cpu"), backend="dense", max_mask_bytes=1 << 30)
        dense = plan.dense_mask()[0, 0].numpy()
        # the blocks backend: key sets per query
        block_keys: dict[int, set[int]] = {}
        covered = np.zeros(st.n_tokens, dtype=int)
        for blk in st.blocks:
            keys = blk.key_idx_K
            for q in range(blk.q_start, blk.q_end):
                covered[q] += 1
                own = q - blk.q_start + blk.n_full
                block_keys[q] = set(keys[: own + 1].tolist())
        assert (covered == 1).all()
        key_refs = [(st.ctx_tree, int(d)) for d in st.ctx_pre_C] + list(
            zip(st.tree_T.tolist(), st.pre_T.tolist(), strict=True)
        )
        for q in range(st.n_tokens):
            ti, d = int(st.tree_T[q]), int(st.pre_T[q])
            lay = batch.layouts[ti]
            tree = batch.trees[ti]
            seg, off = int(lay.seg_U[d]), int(lay.off_U[d])
            anc = _token_paths(tree)[(seg, off)]
            assert st.position_ids_T[q] == len(anc) - 1
            assert st.input_ids_T[q] == tree.segments[seg].token_ids[off]
            expect = set()
            for k, (kt, kd) in enumerate(key_refs):
                klay = batch.layouts[kt]
                if kt == ti and (int(klay.seg_U[kd]), int(klay.off_U[kd])) in anc:
                    expect.add(k)
            assert set(np.flatnonzero(dense[q]).tolist()) == expect
            assert block_keys[q] == expect
        # every target is predicted at the position of its predecessor on the path
        for n in range(st.n_targets):
            p = int(st.target_pred_N[n])
            ti, d = int(st.tree_T[p]), int(st.target_dfs_N[n])
            assert batch.layouts[ti].pred_U[d] == st.pre_T[p]
        seen_targets += st.n_targets
        assert st.n_tokens <= max(1, st.n_tokens)
    assert seen_targets == batch.n_targets
    n_pairs = sum(s.pair_target_P.size for s in batch.streams)
    want = sum(
        sum(int(t.segments[i].model_mask.sum()) for i in t.path_segments(b))
        for t in batch.trees
        for b in t.branches
    )
    assert n_pairs == want


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_tokens", [1000, 23, 5])
def test_masks_and_positions_match_the_ancestor_relation(seed: int, max_tokens: int) -> None:
    batch = pack_trees(_trees(seed), max_tokens, q_chunk=4)
    for st in batch.streams:
        assert st.n_tokens <= max_tokens
    _check_batch(batch)


def test_small_trees_share_a_stream_and_big_ones_are_partitioned() -> None:
    rng = np.random.default_rng(5)
    small = [random_tree(rng, f"a{i}", n_segments=3, max_len=5, root_len=4) for i in range(3)]
    big = random_tree(rng, "big", n_segments=12, max_len=20)
    batch = pack_trees([*small, big], 60)
    whole = [s for s in batch.streams if s.partition is None]
    parts = [s for s in batch.streams if s.partition is not None]
    assert len(whole) == 1 and set(whole[0].tree_ids) == {"a0", "a1", "a2"}
    assert len(parts) == -(-big.unique_tokens // 60)
    assert parts[0].n_context == 0 and all(p.n_context > 0 for p in parts[1:])
    # a single path longer than max_tokens
    path = TrainTree(
        "long",
        (
            Segment(
                -1,
                np.arange(50, dtype=np.int32),
                np.arange(50) > 3,
                np.full(50, -1.0, np.float32),
                np.zeros(50, np.int32),
            ),
        ),
        (Branch(0, 1.0, 1.0, "g"),),
    )
    b2 = pack_trees([path], 8)
    assert len(b2.streams) == 7
    assert [s.n_context for s in b2.streams] == [0, 7, 14, 21, 29, 36, 43]
    _check_batch(b2)


def _seg(parent: int, n: int, model: bool) -> Segment:
    return Segment(
        parent,
        np.arange(n, dtype=np.int32),
        np.full(n, model),
        np.full(n, -0.5 if model else 0.0, np.float32),
        np.zeros(n, np.int32),
    )


def test_segment_arrays_round_trip() -> None:
    trees = _trees(7)
    batch = pack_trees(trees, 30)
    vals = [
        [np.random.default_rng(i).normal(size=len(s)) for s in t.segments]
        for i, t in enumerate(trees)
    ]
    flat = batch.from_segment_arrays(vals)
    back = batch.to_segment_arrays(flat)
    for ti, t in enumerate(trees):
        for si, s in enumerate(t.segments):
            np.testing.assert_allclose(
                back[ti][si][s.model_mask & (np.arange(len(s)) + (si > 0 or 0) > 0)],
                np.asarray(vals[ti][si], np.float32)[
                    s.model_mask & (np.arange(len(s)) + (si > 0 or 0) > 0)
                ],
                rtol=1e-6,
            )
    np.testing.assert_allclose(
        batch.rollout_logprobs_N,
        batch.from_segment_arrays([[s.logprobs for s in t.segments] for t in trees]),
    )


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            TrainTree(
                "sess-nomodel", (_seg(-1, 4, False), _seg(0, 3, False)), (Branch(1, 1.0, 1.0, "g"),)
            ),
            r"sess-nomodel.*no model tokens",
        ),
        (
            TrainTree("sess-nobranch", (_seg(-1, 4, False), _seg(0, 3, True)), ()),
            r"sess-nobranch.*no branches",
        ),
        (
            TrainTree("sess-first", (_seg(-1, 4, True),), (Branch(0, 1.0, 1.0, "g"),)),
            r"sess-first.*first token",
        ),
        (
            TrainTree(
                "sess-roots", (_seg(-1, 4, False), _seg(-1, 3, True)), (Branch(1, 1.0, 1.0, "g"),)
            ),
            r"sess-roots.*one root",
        ),
        (
            TrainTree(
                "sess-order",
                (_seg(-1, 4, False), _seg(2, 3, True), _seg(0, 2, True)),
                (Branch(1, 1.0, 1.0, "g"),),
            ),
            r"sess-order.*parents must come first",
        ),
        (
            TrainTree(
                "sess-leaf", (_seg(-1, 4, False), _seg(0, 3, True)), (Branch(7, 1.0, 1.0, "g"),)
            ),
            r"sess-leaf.*out of range",
        ),
    ],
)
def test_untrainable_trees_are_named(tree: TrainTree, message: str) -> None:
    with pytest.raises(TreeTrainingError, match=message):
        pack_trees([tree], 100)


def test_mask_memory_guard_names_the_session() -> None:
    tree = TrainTree(
        "sess-huge",
        (_seg(-1, 40, False), _seg(0, 30, True), _seg(0, 30, True)),
        (Branch(1, 1.0, 0.5, "g"), Branch(2, 1.0, 0.5, "g")),
    )
    batch = pack_trees([tree], 1000)
    with pytest.raises(TreeTrainingError, match=r"sess-huge.*bytes"):
        StreamPlan(batch.streams[0], torch.device("cpu"), backend="dense", max_mask_bytes=1000)
    with pytest.raises(TreeTrainingError, match=r"sess-huge.*bytes"):
        StreamPlan(batch.streams[0], torch.device("cpu"), backend="blocks", max_mask_bytes=1000)
