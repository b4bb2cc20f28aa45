"""Random `TrainTree`s for tests and benchmarks (not for training real models).

`random_tree` grows a tree by attaching segments to random parents, mixing prompt/tool
tokens (model_mask False) with model tokens; every leaf segment ends a branch with its
own advantage. `agent_tree` builds the agent-like shape of the benchmark: a shared
trunk (system prompt, task, first turns), a few sub-trunks (a retry or parallel call
forks), then one tail per leaf; `shared_fraction` of each path sits above the first fork.
"""

from __future__ import annotations

import numpy as np

from tidal.tree.types import Branch, Segment, TrainTree


def _segment(rng: np.random.Generator, parent: int, n: int, vocab: int, model: str) -> Segment:
    ids = rng.integers(0, vocab, size=n).astype(np.int32)
    if model == "none":
        mask = np.zeros(n, dtype=bool)
    elif model == "all":
        mask = np.ones(n, dtype=bool)
    else:  # a model turn followed by a tool result
        cut = int(rng.integers(0, n + 1))
        mask = np.arange(n) < cut
    lp = np.where(mask, -rng.exponential(2.0, size=n), 0.0).astype(np.float32)
    pv = np.where(mask, 0, -1).astype(np.int32)
    return Segment(parent=parent, token_ids=ids, model_mask=mask, logprobs=lp, policy_versions=pv)


def random_tree(
    rng: np.random.Generator,
    tree_id: str,
    *,
    n_segments: int = 8,
    vocab: int = 512,
    min_len: int = 1,
    max_len: int = 20,
    root_len: int = 10,
    n_groups: int = 2,
) -> TrainTree:
    segs = [_segment(rng, -1, root_len, vocab, "none")]
    for i in range(1, n_segments):
        parent = (
            int(rng.integers(max(0, i - 3), i)) if rng.random() < 0.7 else int(rng.integers(0, i))
        )
        n = int(rng.integers(min_len, max_len + 1))
        segs.append(_segment(rng, parent, n, vocab, str(rng.choice(["mixed", "all", "none"]))))
    if not any(s.model_mask.any() for s in segs[1:]):  # keep the tree trainable
        if len(segs) == 1:
            root = segs[0]
            segs[0] = Segment(
                -1,
                root.token_ids,
                np.arange(len(root)) >= root_len // 2,
                np.full(len(root), -1.0, np.float32),
                root.policy_versions,
            )
        else:
            segs[-1] = _segment(rng, segs[-1].parent, len(segs[-1]), vocab, "all")
    has_child = {s.parent for s in segs}
    leaves = [i for i in range(len(segs)) if i not in has_child]
    branches = tuple(
        Branch(
            leaf=leaf,
            advantage=float(rng.normal()),
            coef=1.0 / len(leaves),
            norm_group=f"{tree_id}/g{int(rng.integers(0, n_groups))}",
            session_id=f"{tree_id}/s{leaf}",
        )
        for leaf in leaves
    )
    return TrainTree(tree_id=tree_id, segments=tuple(segs), branches=branches)


def agent_tree(
    rng: np.random.Generator,
    tree_id: str,
    *,
    n_leaves: int = 16,
    path_len: int = 1024,
    shared_fraction: float = 0.75,
    n_mid: int = 4,
    vocab: int = 512,
) -> TrainTree:
    """A trunk of shared_fraction * path_len, `n_mid` sub-trunks, `n_leaves` tails."""
    trunk = int(path_len * shared_fraction)
    rest = path_len - trunk
    mid = rest // 3
    tail = rest - mid
    segs = [
        _segment(rng, -1, trunk // 2, vocab, "none"),
        _segment(rng, 0, trunk - trunk // 2, vocab, "mixed"),
    ]
    mids = []
    for _ in range(n_mid):
        segs.append(_segment(rng, 1, mid, vocab, "mixed"))
        mids.append(len(segs) - 1)
    leaves = []
    for j in range(n_leaves):
        segs.append(_segment(rng, mids[j % n_mid], tail, vocab, "mixed"))
        leaves.append(len(segs) - 1)
    branches = tuple(
        Branch(leaf=leaf, advantage=float(rng.normal()), coef=1.0 / n_leaves, norm_group=tree_id)
        for leaf in leaves
    )
    return TrainTree(tree_id=tree_id, segments=tuple(segs), branches=branches)
