"""merge_trees: every branch keeps its path exactly, shared prefixes are stored once, and
a trainer step on merged trees equals one on the trees as given."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.train.conftest import tiny_qwen3
from tests.train.synthetic import random_tree
from tidal.train.loss import LossConfig
from tidal.train.merge import merge_trees
from tidal.train.packing import TreeTrainingError
from tidal.train.trainer import TreeTrainer
from tidal.tree.types import Branch, Segment, TrainTree


def _path(tree: TrainTree, b: Branch) -> tuple[np.ndarray, ...]:
    segs = [tree.segments[i] for i in tree.path_segments(b)]
    return tuple(
        np.concatenate([getattr(s, f) for s in segs])
        for f in ("token_ids", "model_mask", "logprobs", "policy_versions")
    )


def _branch_paths(trees: list[TrainTree]) -> dict[str, tuple[Branch, tuple[np.ndarray, ...]]]:
    out = {}
    for t in trees:
        for b in t.branches:
            assert b.session_id not in out
            out[b.session_id] = (dataclasses.replace(b, leaf=0), _path(t, b))
    return out


def _prompt(rng: np.random.Generator, n: int) -> Segment:
    return Segment(
        -1,
        rng.integers(0, 512, n).astype(np.int32),
        np.zeros(n, np.bool_),
        np.zeros(n, np.float32),
        np.full(n, -1, np.int32),
    )


def _under(prompt: Segment, tree: TrainTree) -> TrainTree:
    """`tree` with `prompt` prepended to its root segment."""
    root = tree.segments[0]
    new_root = Segment(
        -1,
        *(
            np.concatenate([getattr(prompt, f), getattr(root, f)])
            for f in ("token_ids", "model_mask", "logprobs", "policy_versions")
        ),
    )
    return dataclasses.replace(tree, segments=(new_root, *tree.segments[1:]))


def _group(seed: int, n: int) -> list[TrainTree]:
    """Trees that share a prompt; some are copies of others (the same sampled tokens,
    another advantage), some copies with one rollout log-probability changed."""
    rng = np.random.default_rng(seed)
    prompt = _prompt(rng, int(rng.integers(1, 40)))
    trees = [
        _under(prompt, random_tree(rng, f"g{seed}-{i}", n_segments=int(rng.integers(1, 8))))
        for i in range(n)
    ]
    for k in range(n // 2):  # copies: all tokens equal, so they share everything
        src = trees[int(rng.integers(0, len(trees)))]
        tid = f"g{seed}-copy{k}"
        segs = list(src.segments)
        if rng.random() < 0.5:  # one model token's logprob differs: sharing must stop there
            si = int(rng.integers(0, len(segs)))
            if segs[si].model_mask.any():
                lp = segs[si].logprobs.copy()
                lp[int(np.flatnonzero(segs[si].model_mask)[-1])] -= 0.5
                segs[si] = dataclasses.replace(segs[si], logprobs=lp)
        branches = tuple(
            dataclasses.replace(b, session_id=f"{tid}/{j}", advantage=float(rng.normal()))
            for j, b in enumerate(src.branches)
        )
        trees.append(TrainTree(tid, tuple(segs), branches))
    return trees


@pytest.mark.parametrize("seed", range(30))
def test_every_branch_keeps_its_path(seed: int) -> None:
    trees = _group(seed, 5)
    max_tokens = [10**6, 60][seed % 2]
    merged = merge_trees(trees, max_tokens)
    before, after = _branch_paths(trees), _branch_paths(merged)
    assert before.keys() == after.keys()
    for sid, (b, path) in before.items():
        b2, path2 = after[sid]
        assert b2 == b
        for x, y in zip(path, path2, strict=True):
            np.testing.assert_array_equal(x, y)
        assert path2[2].dtype == np.float32 and path2[0].dtype == np.int32
    assert sum(t.unique_tokens for t in merged) <= sum(t.unique_tokens for t in trees)
    for t in merged:
        assert t.unique_tokens <= max_tokens or t in trees  # only unmerged trees exceed it
        assert sum(s.parent == -1 for s in t.segments) == 1
        assert all(s.parent < i for i, s in enumerate(t.segments))


def test_a_shared_prompt_is_stored_once() -> None:
    rng = np.random.default_rng(0)
    prompt = _prompt(rng, 50)
    trees = []
    for i in range(4):
        t = random_tree(rng, f"t{i}", n_segments=3)
        # a distinct first token after the prompt, so that exactly the prompt is shared
        root = t.segments[0]
        ids = root.token_ids.copy()
        ids[0] = 600 + i
        trees.append(_under(prompt, dataclasses.replace(
            t, segments=(dataclasses.replace(root, token_ids=ids), *t.segments[1:])
        )))
    (merged,) = merge_trees(trees, 10**6)
    assert merged.unique_tokens == sum(t.unique_tokens for t in trees) - 3 * 50
    assert len(merged.branches) == sum(len(t.branches) for t in trees)
    assert merged.tree_id == "t0 (+3 merged)"


def test_identical_sessions_share_everything_and_a_logprob_difference_splits() -> None:
    rng = np.random.default_rng(1)
    t = random_tree(rng, "a", n_segments=1, root_len=6)  # 6 tokens, the last 3 sampled
    copy = dataclasses.replace(t, tree_id="b", branches=tuple(
        dataclasses.replace(b, session_id="b") for b in t.branches
    ))
    (merged,) = merge_trees([t, copy], 10**6)
    assert merged.unique_tokens == 6 and len(merged.branches) == 2
    lp = t.segments[0].logprobs.copy()
    lp[4] += 0.25  # the second sampled token: same id, another rollout logprob
    other = dataclasses.replace(copy, segments=(dataclasses.replace(t.segments[0], logprobs=lp),))
    (merged,) = merge_trees([t, other], 10**6)
    assert merged.unique_tokens == 6 + 2  # shared up to token 4, then two tails
    assert [len(s) for s in merged.segments] == [4, 2, 2]


def test_the_size_bound_and_unmergeable_trees() -> None:
    rng = np.random.default_rng(2)
    prompt = _prompt(rng, 30)
    trees = [_under(prompt, random_tree(rng, f"t{i}", n_segments=2, max_len=5)) for i in range(6)]
    sizes = [t.unique_tokens for t in trees]
    bound = sizes[0] + sizes[1] - 30  # the first two fit together, no third
    merged = merge_trees(trees, bound)
    assert all(t.unique_tokens <= bound for t in merged)
    assert len(merged) < len(trees)
    alone = [_prompt(rng, 5)]  # a different first token: nothing to merge with
    other = TrainTree("x", (*alone, dataclasses.replace(trees[0].segments[1], parent=0)),
                      (dataclasses.replace(trees[0].branches[0], session_id="x"),))
    out = merge_trees([trees[0], other], 10**6)
    assert out[1] is other and out[0] is trees[0]  # a tree merged with nothing is unchanged
    big = merge_trees(trees, 10)  # every tree is over the bound: all unchanged
    assert all(a is b for a, b in zip(big, trees, strict=True))


def test_a_tree_that_cannot_be_trained_is_named() -> None:
    rng = np.random.default_rng(3)
    prompt = _prompt(rng, 8)
    good = _under(prompt, random_tree(rng, "good", n_segments=3))
    bad = TrainTree("bad-session", (prompt,), (Branch(0, 1.0, 1.0, "g"),))  # no model tokens
    with pytest.raises(TreeTrainingError, match="bad-session"):
        merge_trees([good, bad], 10**6)
    with pytest.raises(ValueError, match="max_tokens"):
        merge_trees([good], 0)


def _step_grads(trees: list[TrainTree], merge: bool) -> tuple[dict[str, torch.Tensor], dict]:
    model = tiny_qwen3(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = TreeTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        LossConfig(correction="tis"),
        max_tokens=256,
        attention="blocks",
        max_grad_norm=None,
        merge=merge,
    )
    metrics = trainer.step(trees).as_dict()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_step_on_merged_trees_equals_one_on_the_trees_given(seed: int) -> None:
    trees = _group(seed, 4)
    g_merged, m_merged = _step_grads(trees, merge=True)
    g_plain, m_plain = _step_grads(trees, merge=False)
    assert m_merged["tokens"] < m_plain["tokens"]  # fewer tokens computed
    assert m_merged["path_tokens"] == m_plain["path_tokens"]
    assert m_merged["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-7)
    for name, g in g_plain.items():
        torch.testing.assert_close(g_merged[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert any(bool(g.abs().sum() > 0) for g in g_plain.values())
