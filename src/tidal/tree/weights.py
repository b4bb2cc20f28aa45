"""Token weights implied by a tree's branches (what the trainer's loss applies).

For a token t of a tree, w_t = model_mask[t] * sum over branches b through t of coef_b.
With the default two-level normalisation (coef_b = 1 / branches of the episode) this is
the share of the episode's sampled branches that carry t in their history; prompt,
tool-result and other non-model tokens weigh 0. Shape letters: T tokens of a segment.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import numpy.typing as npt

from tidal.tree.types import TrainTree


def segment_coefs(tree: TrainTree) -> list[float]:
    """Sum of coef over the branches whose path passes through each segment."""
    out = [0.0] * len(tree.segments)
    for b in tree.branches:
        for s in tree.path_segments(b):
            out[s] += b.coef
    return out


def token_weights(tree: TrainTree) -> list[npt.NDArray[np.float64]]:
    """w_T for each segment (see the module docstring)."""
    return [
        seg.model_mask.astype(np.float64) * c
        for seg, c in zip(tree.segments, segment_coefs(tree), strict=True)
    ]


def group_weight_sums(trees: list[TrainTree]) -> dict[str, float]:
    """Per norm group g: D_g = sum_{b in g} coef_b * (model tokens on b), taking m_t = 1.

    The denominator of the trainer's loss for each group (types.py docstring)."""
    out: dict[str, float] = defaultdict(float)
    for t in trees:
        for b in t.branches:
            n = sum(int(t.segments[s].model_mask.sum()) for s in t.path_segments(b))
            out[b.norm_group] += b.coef * n
    return dict(out)
