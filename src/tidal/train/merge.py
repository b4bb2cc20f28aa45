"""Merging trees that start alike, so that tokens they share are computed once.

The processor emits one tree per episode (`tidal.tree.process`), and episodes are never
merged there: the trees of a GRPO group, and in `tidal run` the trees of every task,
begin with the same system prompt and tool list, and sessions that sampled the same
first turn share more. `merge_trees` lays such trees over one another before packing:
a token is stored once when it is equal in every field the loss reads (token id, model
flag, rollout log-probability bit for bit, policy version) and all its predecessors on
the path are too. Every branch keeps its path token for token, its advantage, coef and
norm group, so the loss L of `tidal.tree.types` and its gradient are unchanged; a shared
trained token simply carries the branches of several trees, which the trainer already
handles (the sum over its branches). Only the forward and backward work shrinks: on
`tidal run`'s trees, 4x fewer tokens and a 1.5x faster step (`bench/merge.py`).

Size bound: a tree joins a merged tree only while the result stays within `max_tokens`
(the packer's stream size). A merged tree over that size would be partitioned, and a
partition caches its ancestors' keys and values for the whole tree; trees that each fit
a stream pack without any such cache. A tree already larger than `max_tokens` is left
as it is.

Deliberately simplified: trees are taken in the order given, and each joins the latest
merged tree that starts with its first token or, when that one is full, starts the next
(no search for the grouping that shares most).

Shape letters: T tokens of a segment; each node's `rows_T4` holds, per token, its id,
model flag, log-probability bits and policy version.
"""

# ruff: noqa: N815 - shape-suffix field names (rows_T4) are the project convention
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from tidal.train.packing import layout_tree
from tidal.tree.types import Branch, Segment, TrainTree

Rows = npt.NDArray[np.int64]
Key = tuple[int, int, int, int]


def _rows(seg: Segment) -> Rows:
    """The fields a token is compared on, one row per token (log-probability as bits)."""
    return np.stack(
        [
            seg.token_ids.astype(np.int64),
            seg.model_mask.astype(np.int64),
            np.ascontiguousarray(seg.logprobs, dtype=np.float32).view(np.int32).astype(np.int64),
            seg.policy_versions.astype(np.int64),
        ],
        axis=1,
    )


def _key(rows_T4: Rows) -> Key:
    a, b, c, d = (int(x) for x in rows_T4[0])
    return a, b, c, d


def _common(x_T4: Rows, y_T4: Rows) -> int:
    """Length of the common prefix of two row arrays."""
    n = min(len(x_T4), len(y_T4))
    diff = np.flatnonzero((x_T4[:n] != y_T4[:n]).any(axis=1))
    return int(diff[0]) if diff.size else n


@dataclass
class _Node:
    rows_T4: Rows
    parent: int  # node index, -1 for the root
    kids: dict[Key, int] = field(default_factory=dict)
    branches: list[Branch] = field(default_factory=list)  # branches ending at its last token


class _Merged:
    """One merged tree under construction: nodes are runs of tokens, as segments are."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self.root = 0
        self.trees: list[TrainTree] = []  # inserted so far
        self.size = 0  # unique tokens

    def copy(self) -> _Merged:
        out = _Merged()
        out.nodes = [
            _Node(n.rows_T4, n.parent, dict(n.kids), list(n.branches)) for n in self.nodes
        ]
        out.root, out.trees, out.size = self.root, list(self.trees), self.size
        return out

    def _new(self, rows_T4: Rows, parent: int) -> int:
        self.nodes.append(_Node(rows_T4, parent))
        i = len(self.nodes) - 1
        if parent >= 0:
            self.nodes[parent].kids[_key(rows_T4)] = i
        self.size += len(rows_T4)
        return i

    def _split(self, i: int, n: int) -> int:
        """Cut node i after its first n tokens (0 < n < its length); the head becomes a
        new node, and node i keeps the tail, its children and its branches, so anything
        that refers to the end of node i still does. Returns the head."""
        node = self.nodes[i]
        head = _Node(node.rows_T4[:n], node.parent)
        self.nodes.append(head)
        h = len(self.nodes) - 1
        if node.parent >= 0:
            self.nodes[node.parent].kids[_key(head.rows_T4)] = h
        else:
            self.root = h
        node.rows_T4, node.parent = node.rows_T4[n:], h
        head.kids[_key(node.rows_T4)] = i
        return h

    def insert(self, tree: TrainTree) -> None:
        """Lay `tree` (checked by `layout_tree`) over this one, whose root it must share
        unless this one is empty."""
        self.trees.append(tree)
        kids: list[list[int]] = [[] for _ in tree.segments]
        root = 0
        for s, seg in enumerate(tree.segments):
            if seg.parent >= 0:
                kids[seg.parent].append(s)
            else:
                root = s
        ends_at: list[list[Branch]] = [[] for _ in tree.segments]
        for b in tree.branches:
            ends_at[b.leaf].append(b)
        stack: list[tuple[int, int]] = [(root, -1)]  # (segment, node it follows)
        while stack:
            s, at = stack.pop()
            rows_T4 = _rows(tree.segments[s])
            end = self._place(rows_T4, at)
            self.nodes[end].branches.extend(ends_at[s])
            stack.extend((k, end) for k in reversed(kids[s]))

    def _place(self, rows_T4: Rows, at: int) -> int:
        """Add the tokens `rows_T4` after the end of node `at` (-1: at the root), sharing
        what is already there; returns the node that ends where they end."""
        if at == -1 and not self.nodes:
            return self._new(rows_T4, -1)
        while len(rows_T4):
            if at == -1:
                c: int | None = self.root  # the caller checked its first token
            else:
                c = self.nodes[at].kids.get(_key(rows_T4))
            if c is None:
                return self._new(rows_T4, at)
            n = _common(self.nodes[c].rows_T4, rows_T4)
            if n < len(self.nodes[c].rows_T4):
                c = self._split(c, n)
            at, rows_T4 = c, rows_T4[n:]
        return at

    def tree(self) -> TrainTree:
        """The merged tree: segments in DFS order (parents first)."""
        order: list[int] = []
        stack = [self.root]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(reversed(list(self.nodes[i].kids.values())))
        index = {node: k for k, node in enumerate(order)}
        segs = []
        for i in order:
            r = self.nodes[i].rows_T4
            p = self.nodes[i].parent
            segs.append(
                Segment(
                    parent=index[p] if p >= 0 else -1,
                    token_ids=r[:, 0].astype(np.int32),
                    model_mask=r[:, 1].astype(np.bool_),
                    logprobs=r[:, 2].astype(np.int32).view(np.float32),
                    policy_versions=r[:, 3].astype(np.int32),
                )
            )
        branches = tuple(
            replace(b, leaf=index[i]) for i in order for b in self.nodes[i].branches
        )
        tid = f"{self.trees[0].tree_id} (+{len(self.trees) - 1} merged)"
        return TrainTree(tid, tuple(segs), branches)


def merge_trees(trees: Sequence[TrainTree], max_tokens: int) -> list[TrainTree]:
    """The same branches in fewer tokens: trees whose roots begin with an equal token are
    merged, each merged tree at most `max_tokens` tokens (see the module docstring).

    A tree is checked as the packer checks it (`layout_tree`) before it is merged with
    another, so a tree that cannot be trained is refused under its own name, never
    hidden inside a merged one. A tree merged with no other is returned unchanged (and
    checked by the packer)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    merged: list[_Merged | TrainTree] = []  # a lone tree stays a TrainTree
    current: dict[Key, int] = {}  # root's first token -> the entry being filled
    for t in trees:
        roots = [s for s in t.segments if s.parent == -1]
        if len(roots) != 1 or len(roots[0]) == 0 or t.unique_tokens > max_tokens:
            merged.append(t)  # nothing to merge (the packer refuses a malformed tree)
            continue
        key = _key(_rows(roots[0]))
        m = current.get(key)
        if m is not None:
            target = merged[m]
            layout_tree(t)
            if isinstance(target, TrainTree):  # its first partner: lay it out now
                layout_tree(target)
                trial = _Merged()
                trial.insert(target)
            # else it fits for sure when all its tokens would; if not, try it on a copy
            # (cheap: nodes hold views of the arrays) and keep that only if it fits
            elif target.size + t.unique_tokens <= max_tokens:
                trial = target
            else:
                trial = target.copy()
            trial.insert(t)
            if trial.size <= max_tokens:
                merged[m] = trial
                continue
        current[key] = len(merged)
        merged.append(t)
    return [m if isinstance(m, TrainTree) else m.tree() for m in merged]
