"""Pack `TrainTree`s into DFS-ordered token streams for tree training.

Each tree is laid out in depth-first pre-order of its segments: every token then appears
once, its ancestors come before it, and the tokens of its subtree form one contiguous
range right after it. So "key j is visible to query i" is the interval test
`pre[j] <= pre[i] < end[j]` (same tree), and the position id of a token is its depth on
its path. The attention backends (`tidal.train.attention`) use either this interval
test (dense 4D mask, FlexAttention block mask) or the `blocks` precomputed here: maximal
chains of the stream, each attending to its gathered ancestors plus itself causally.

Trees no larger than `max_tokens` are packed whole, several per stream (first-fit
decreasing). A larger tree is cut into consecutive DFS ranges of at most `max_tokens`
tokens, one stream each. The ancestor context of such a partition is *not* re-included
as tokens: its keys and values come from the no-grad recompute pass (cached per layer)
and receive their gradient back from the later partitions (see `tidal.train.trainer`).
That costs one cached K/V pair per layer per token of a partitioned tree (and as much
again for their gradients) instead of recomputing context tokens, and it makes a single
path longer than `max_tokens` trainable too.

A trained token is predicted at its predecessor's position (the parent's last token for
the first token of a branch), so a fork position predicts several targets, each exact.
The loss bookkeeping is a list of (target, branch) pairs: PPO's clip is not linear, so a
shared token contributes once per branch that carries it, with that branch's advantage.

Shape letters: U tokens of one tree (DFS order), T tokens of a stream, C context tokens
of a stream (ancestors held in earlier streams), N trained targets, P (target, branch)
loss pairs, B branches of the batch, S segments of a tree, K keys of an attention block.

Deliberately simplified: partitions are equal cuts of the DFS order, not aligned to
segment boundaries (alignment would only save a few attention blocks); a partitioned
tree's streams hold nothing else.
"""

# ruff: noqa: N815 - shape-suffix field names (token_ids_U) are the project convention
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tidal.tree.types import TrainTree

I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]


class TreeTrainingError(ValueError):
    """A tree that cannot be trained; the message names the tree (session)."""


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """One tree in DFS order. Token arrays are indexed by DFS position (length U)."""

    tree_id: str
    token_ids_U: I64
    depth_U: I64  # position id: depth of the token on its path
    pred_U: I64  # DFS index of the token's predecessor on its path, -1 for the root token
    end_U: I64  # exclusive end of the token's subtree in DFS order
    seg_U: I64  # segment index of the token
    off_U: I64  # offset of the token inside its segment
    seg_start_S: I64  # DFS index of each segment's first token
    target_dfs_N: I64  # DFS index of each trained target (model token on a branch)
    pair_target_P: I64  # index into target_dfs_N
    pair_branch_P: I64  # index into tree.branches
    segment_order_offset_S: I64  # offset of each segment in segment-index order
    rollout_U: F32  # the engine's log-probability of each token (0 for non-model tokens)

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids_U.shape[0])


@dataclass(frozen=True, eq=False)
class AttentionBlock:
    """Queries [q_start, q_end) of a stream; keys = `key_idx_K` into cat(context, stream).

    The first `n_full` keys are fully visible (ancestors); the last q_end - q_start keys
    are the queries themselves, causal.
    """

    q_start: int
    q_end: int
    key_idx_K: I64
    n_full: int


@dataclass(frozen=True, eq=False)
class PackedStream:
    """One forward pass: T tokens of one or more trees plus C context keys."""

    input_ids_T: I64
    position_ids_T: I64
    tree_T: I64  # index of the token's tree in the batch
    pre_T: I64  # DFS index inside its tree
    end_T: I64  # DFS subtree end inside its tree
    ctx_tree: int  # tree of the context keys (-1 when C == 0)
    ctx_pre_C: I64  # DFS indices of context keys (ancestors in earlier streams)
    ctx_end_C: I64
    blocks: tuple[AttentionBlock, ...]
    target_pred_N: I64  # stream index of the position predicting each target
    target_ids_N: I64
    target_dfs_N: I64  # DFS index of each target inside its tree
    target_offset: int  # global index of this stream's first target
    pair_target_P: I64  # stream-local target index
    pair_branch_P: I64  # global branch index
    tree_ids: tuple[str, ...]  # trees with tokens in this stream (for error messages)
    partition: tuple[int, int] | None  # (tree, DFS start) when part of a partitioned tree

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])

    @property
    def n_context(self) -> int:
        return int(self.ctx_pre_C.shape[0])

    @property
    def n_targets(self) -> int:
        return int(self.target_ids_N.shape[0])


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """Streams plus the batch-level per-target and per-branch arrays of the loss."""

    trees: tuple[TrainTree, ...]
    layouts: tuple[TreeLayout, ...]
    streams: tuple[PackedStream, ...]
    target_tree_N: I64  # global target arrays, concatenated in stream order
    target_dfs_N: I64
    rollout_logprobs_N: F32
    branch_advantage_B: F32
    branch_coef_B: F32
    branch_group_B: I64  # index into group_names
    branch_tree_B: I64
    group_names: tuple[str, ...]

    @property
    def n_targets(self) -> int:
        return int(self.target_tree_N.shape[0])

    @property
    def unique_tokens(self) -> int:
        return sum(t.unique_tokens for t in self.trees)

    @property
    def path_tokens(self) -> int:
        return sum(t.path_tokens for t in self.trees)

    def to_segment_arrays(self, values_N: npt.ArrayLike) -> list[list[F32]]:
        """Scatter per-target values back to per-tree, per-segment arrays (0 elsewhere)."""
        v_N = np.asarray(values_N, dtype=np.float32)
        out: list[list[F32]] = [
            [np.zeros(len(s), dtype=np.float32) for s in t.segments] for t in self.trees
        ]
        for n in range(self.n_targets):
            lay = self.layouts[int(self.target_tree_N[n])]
            d = int(self.target_dfs_N[n])
            out[int(self.target_tree_N[n])][int(lay.seg_U[d])][int(lay.off_U[d])] = v_N[n]
        return out

    def from_segment_arrays(self, values: Sequence[Sequence[npt.ArrayLike]]) -> F32:
        """Gather per-tree, per-segment arrays into the global target order."""
        out_N = np.zeros(self.n_targets, dtype=np.float32)
        for ti, lay in enumerate(self.layouts):
            flat = (
                np.concatenate([np.asarray(a, dtype=np.float32).reshape(-1) for a in values[ti]])
                if len(values[ti])
                else np.zeros(0, dtype=np.float32)
            )
            sel = self.target_tree_N == ti
            d = self.target_dfs_N[sel]
            out_N[sel] = flat[lay.segment_order_offset_S[lay.seg_U[d]] + lay.off_U[d]]
        return out_N


# long by design: one DFS pass laying out a tree: segments, targets and loss pairs together
def layout_tree(tree: TrainTree) -> TreeLayout:  # noqa: PLR0915
    """Validate a tree and lay it out in DFS order with its targets and loss pairs."""
    name = f"tree {tree.tree_id!r}"
    segs = tree.segments
    S = len(segs)
    if S == 0:
        raise TreeTrainingError(f"{name}: no segments")
    children: list[list[int]] = [[] for _ in range(S)]
    roots = []
    for i, s in enumerate(segs):
        n = len(s)
        if s.model_mask.shape != (n,) or s.logprobs.shape != (n,):
            raise TreeTrainingError(
                f"{name}: segment {i} has token_ids/model_mask/logprobs of different lengths"
            )
        if s.parent == -1:
            roots.append(i)
        elif not 0 <= s.parent < i:
            raise TreeTrainingError(
                f"{name}: segment {i} has parent {s.parent}; parents must come first"
            )
        else:
            children[s.parent].append(i)
    if len(roots) != 1:
        raise TreeTrainingError(f"{name}: expected one root segment, found {len(roots)}")
    if not tree.branches:
        raise TreeTrainingError(f"{name}: no branches to train")

    size_S = np.array([len(s) for s in segs], dtype=np.int64)
    sub_S = size_S.copy()
    for i in range(S - 1, 0, -1):
        if segs[i].parent >= 0:
            sub_S[segs[i].parent] += sub_S[i]
    order: list[int] = []
    stack = [roots[0]]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(children[i]))
    start_S = np.zeros(S, dtype=np.int64)
    pos = 0
    for i in order:
        start_S[i] = pos
        pos += int(size_S[i])
    U = pos
    depth0_S = np.zeros(S, dtype=np.int64)
    last_S = np.full(S, -1, dtype=np.int64)
    for i in range(S):  # topological: parents first
        p = segs[i].parent
        if p >= 0:
            depth0_S[i] = depth0_S[p] + size_S[p]
        last_S[i] = start_S[i] + size_S[i] - 1 if size_S[i] > 0 else (last_S[p] if p >= 0 else -1)

    ids_U = np.zeros(U, dtype=np.int64)
    depth_U = np.zeros(U, dtype=np.int64)
    pred_U = np.zeros(U, dtype=np.int64)
    end_U = np.zeros(U, dtype=np.int64)
    seg_U = np.zeros(U, dtype=np.int64)
    off_U = np.zeros(U, dtype=np.int64)
    model_U = np.zeros(U, dtype=bool)
    rollout_U = np.zeros(U, dtype=np.float32)
    for i, s in enumerate(segs):
        a, n = int(start_S[i]), int(size_S[i])
        if n == 0:
            continue
        r = np.arange(n, dtype=np.int64)
        ids_U[a : a + n] = s.token_ids
        depth_U[a : a + n] = depth0_S[i] + r
        pred_U[a : a + n] = a - 1 + r
        pred_U[a] = last_S[s.parent] if s.parent >= 0 else -1
        end_U[a : a + n] = start_S[i] + sub_S[i]
        seg_U[a : a + n] = i
        off_U[a : a + n] = r
        model_U[a : a + n] = s.model_mask
        rollout_U[a : a + n] = s.logprobs
    if U > 0 and model_U[pred_U < 0].any():
        raise TreeTrainingError(
            f"{name}: the first token is marked as a model token; "
            "nothing precedes it, so it cannot be trained"
        )

    on_branch_S = np.zeros(S, dtype=bool)
    paths: list[list[int]] = []
    for bi, b in enumerate(tree.branches):
        if not 0 <= b.leaf < S:
            raise TreeTrainingError(f"{name}: branch {bi} has leaf {b.leaf} out of range")
        path = tree.path_segments(b)
        paths.append(path)
        on_branch_S[path] = True
    target_U = model_U & on_branch_S[seg_U] if U else model_U
    target_dfs_N = np.flatnonzero(target_U).astype(np.int64)
    if target_dfs_N.size == 0:
        raise TreeTrainingError(f"{name}: no model tokens on any branch; nothing to train")
    tgt_index_U = np.full(U, -1, dtype=np.int64)
    tgt_index_U[target_dfs_N] = np.arange(target_dfs_N.size)
    seg_targets = [tgt_index_U[start_S[i] : start_S[i] + size_S[i]] for i in range(S)]
    seg_targets = [t[t >= 0] for t in seg_targets]
    pt, pb = [], []
    for bi, path in enumerate(paths):
        tg = np.concatenate([seg_targets[i] for i in path])
        pt.append(tg)
        pb.append(np.full(tg.size, bi, dtype=np.int64))
    seg_order_off = np.concatenate([[0], np.cumsum(size_S)[:-1]]).astype(np.int64)
    return TreeLayout(
        tree_id=tree.tree_id,
        token_ids_U=ids_U,
        depth_U=depth_U,
        pred_U=pred_U,
        end_U=end_U,
        seg_U=seg_U,
        off_U=off_U,
        seg_start_S=start_S,
        target_dfs_N=target_dfs_N,
        pair_target_P=np.concatenate(pt),
        pair_branch_P=np.concatenate(pb),
        segment_order_offset_S=seg_order_off,
        rollout_U=rollout_U,
    )


def _ancestors_before(lay: TreeLayout, j: int, limit: int, marked: npt.NDArray[np.bool_]) -> None:
    """Mark j (if < limit) and all its ancestors with DFS index < limit."""
    while j >= 0:
        a = int(lay.seg_start_S[lay.seg_U[j]])
        if a < limit:
            hi = min(j, limit - 1)
            if marked[hi]:
                return
            marked[a : hi + 1] = True
        j = int(lay.pred_U[a])


@dataclass(frozen=True)
class _Part:
    tree: int
    start: int  # DFS range [start, end) of the tree
    end: int
    partitioned: bool


def _heads(lay: TreeLayout, start: int, end: int) -> I64:
    """DFS indices in [start, end) that start a chain (predecessor is not the previous token)."""
    r = np.arange(start, end, dtype=np.int64)
    h = r[lay.pred_U[start:end] != r - 1]
    return h if h.size and h[0] == start else np.concatenate([[start], h]).astype(np.int64)


# long by design: one pass building a packed stream's arrays from its trees' layouts
def _build_stream(  # noqa: PLR0915
    parts: Sequence[_Part],
    layouts: Sequence[TreeLayout],
    target_offset: int,
    branch_offset_per_tree: Sequence[int],
    q_chunk: int,
) -> PackedStream:
    ctx_pre = np.zeros(0, dtype=np.int64)
    ctx_tree = -1
    if len(parts) == 1 and parts[0].partitioned and parts[0].start > 0:
        p = parts[0]
        lay = layouts[p.tree]
        marked = np.zeros(p.start, dtype=bool)
        for h in _heads(lay, p.start, p.end):
            _ancestors_before(lay, int(lay.pred_U[h]), p.start, marked)
        ctx_pre = np.flatnonzero(marked).astype(np.int64)
        ctx_tree = p.tree
    C = int(ctx_pre.size)

    ids, pos, tree, pre, end = [], [], [], [], []
    blocks: list[AttentionBlock] = []
    t_pred, t_ids, t_dfs, p_tgt, p_br = [], [], [], [], []
    offset = 0
    n_tgt = 0
    for p in parts:
        lay = layouts[p.tree]
        sl = slice(p.start, p.end)
        ids.append(lay.token_ids_U[sl])
        pos.append(lay.depth_U[sl])
        tree.append(np.full(p.end - p.start, p.tree, dtype=np.int64))
        pre.append(np.arange(p.start, p.end, dtype=np.int64))
        end.append(lay.end_U[sl])
        base = C + offset - p.start  # key index of in-stream DFS index d is base + d

        heads = _heads(lay, p.start, p.end)
        for h_i, h in enumerate(heads.tolist()):
            e = int(heads[h_i + 1]) if h_i + 1 < heads.size else p.end
            pieces: list[I64] = []
            j = int(lay.pred_U[h])
            while j >= 0:  # walk up segment by segment, collecting ancestor key ranges
                a = int(lay.seg_start_S[lay.seg_U[j]])
                if j >= p.start:
                    pieces.append(base + np.arange(max(a, p.start), j + 1, dtype=np.int64))
                    if a < p.start:
                        pieces.append(np.searchsorted(ctx_pre, np.arange(a, p.start)))
                else:
                    pieces.append(np.searchsorted(ctx_pre, np.arange(a, j + 1)))
                j = int(lay.pred_U[a])
            anc_K = (
                np.concatenate(pieces[::-1]).astype(np.int64)
                if pieces
                else np.zeros(0, dtype=np.int64)
            )
            for qs in range(h, e, q_chunk):
                qe = min(qs + q_chunk, e)
                blocks.append(
                    AttentionBlock(
                        q_start=qs - p.start + offset,
                        q_end=qe - p.start + offset,
                        key_idx_K=np.concatenate([anc_K, base + np.arange(h, qe, dtype=np.int64)]),
                        n_full=int(anc_K.size) + qs - h,
                    )
                )
        # targets predicted from this part's positions
        tg = lay.target_dfs_N
        tpred = lay.pred_U[tg]
        sel = np.flatnonzero((tpred >= p.start) & (tpred < p.end))
        local = np.full(tg.size, -1, dtype=np.int64)
        local[sel] = n_tgt + np.arange(sel.size)
        t_pred.append(offset + tpred[sel] - p.start)
        t_ids.append(lay.token_ids_U[tg[sel]])
        t_dfs.append(tg[sel])
        psel = local[lay.pair_target_P] >= 0
        p_tgt.append(local[lay.pair_target_P[psel]])
        p_br.append(lay.pair_branch_P[psel] + branch_offset_per_tree[p.tree])
        n_tgt += sel.size
        offset += p.end - p.start

    return PackedStream(
        input_ids_T=np.concatenate(ids),
        position_ids_T=np.concatenate(pos),
        tree_T=np.concatenate(tree),
        pre_T=np.concatenate(pre),
        end_T=np.concatenate(end),
        ctx_tree=ctx_tree,
        ctx_pre_C=ctx_pre,
        ctx_end_C=layouts[ctx_tree].end_U[ctx_pre] if C else np.zeros(0, dtype=np.int64),
        blocks=tuple(blocks),
        target_pred_N=np.concatenate(t_pred).astype(np.int64),
        target_ids_N=np.concatenate(t_ids).astype(np.int64),
        target_dfs_N=np.concatenate(t_dfs).astype(np.int64),
        target_offset=target_offset,
        pair_target_P=np.concatenate(p_tgt).astype(np.int64),
        pair_branch_P=np.concatenate(p_br).astype(np.int64),
        tree_ids=tuple(dict.fromkeys(layouts[p.tree].tree_id for p in parts)),
        partition=(parts[0].tree, parts[0].start) if parts[0].partitioned else None,
    )


def pack_trees(trees: Sequence[TrainTree], max_tokens: int, q_chunk: int = 2048) -> PackedBatch:
    """Lay out trees in DFS order and pack them into streams of at most `max_tokens`.

    `q_chunk` bounds the query length of one attention block (its mask is q_chunk x keys).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if not trees:
        raise ValueError("pack_trees needs at least one tree")
    layouts = tuple(layout_tree(t) for t in trees)
    br_off = np.concatenate([[0], np.cumsum([len(t.branches) for t in trees])]).astype(int)

    whole = [i for i, lay in enumerate(layouts) if lay.n_tokens <= max_tokens]
    big = [i for i, lay in enumerate(layouts) if lay.n_tokens > max_tokens]
    groups: list[list[_Part]] = []
    for i in big:  # partitioned trees: equal DFS cuts, one stream each, in DFS order
        U = layouts[i].n_tokens
        k = -(-U // max_tokens)
        cuts = [round(j * U / k) for j in range(k + 1)]
        groups.extend([_Part(i, cuts[j], cuts[j + 1], True)] for j in range(k))
    bins: list[tuple[int, list[_Part]]] = []  # first-fit decreasing
    for i in sorted(whole, key=lambda i: -layouts[i].n_tokens):
        n = layouts[i].n_tokens
        for bi, (used, parts) in enumerate(bins):
            if used + n <= max_tokens:
                parts.append(_Part(i, 0, n, False))
                bins[bi] = (used + n, parts)
                break
        else:
            bins.append((n, [_Part(i, 0, n, False)]))
    groups.extend(parts for _, parts in bins)

    streams = []
    t_off = 0
    for parts in groups:
        st = _build_stream(parts, layouts, t_off, list(br_off), q_chunk)
        streams.append(st)
        t_off += st.n_targets

    tt, td, roll = [], [], []
    for st in streams:
        ti = st.tree_T[st.target_pred_N]
        tt.append(ti)
        td.append(st.target_dfs_N)
        r_N = np.zeros(st.n_targets, dtype=np.float32)
        for tr in np.unique(ti).tolist():
            sel = ti == tr
            r_N[sel] = layouts[tr].rollout_U[st.target_dfs_N[sel]]
        roll.append(r_N)

    names: dict[str, int] = {}
    adv, coef, grp, btree = [], [], [], []
    for tree_i, t in enumerate(trees):
        for b in t.branches:
            adv.append(b.advantage)
            coef.append(b.coef)
            grp.append(names.setdefault(b.norm_group, len(names)))
            btree.append(tree_i)
    return PackedBatch(
        trees=tuple(trees),
        layouts=layouts,
        streams=tuple(streams),
        target_tree_N=np.concatenate(tt).astype(np.int64),
        target_dfs_N=np.concatenate(td).astype(np.int64),
        rollout_logprobs_N=np.concatenate(roll).astype(np.float32),
        branch_advantage_B=np.asarray(adv, dtype=np.float32),
        branch_coef_B=np.asarray(coef, dtype=np.float32),
        branch_group_B=np.asarray(grp, dtype=np.int64),
        branch_tree_B=np.asarray(btree, dtype=np.int64),
        group_names=tuple(names),
    )
