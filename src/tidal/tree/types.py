"""The seam between the trajectory processor (`tidal.tree`) and the trainer (`tidal.train`).

A `TrainTree` is one trainable tree of tokens: segments (runs of tokens with no branch
inside) linked to their parent segment, and the sampled root-to-leaf branches, each
with its own advantage and loss coefficient.

Shape letters used in names: S segments, T tokens of a segment, B branches.

The loss the trainer computes from a batch of trees (see docs/trees.md):

    L = (1 / G) * sum_g  N_g / D_g
    N_g = sum_{b in g} coef_b * sum_{t on b, model_mask[t]} m_t * loss_t(A_b)
    D_g = sum_{b in g} coef_b * sum_{t on b, model_mask[t]} m_t

where g ranges over the G distinct `norm_group`s of the batch's branches, m_t is 0 for
tokens that importance correction masks (else 1) and loss_t(A) the per-token PPO/GRPO
term with advantage A. `coef_b` and `norm_group` encode the processor's normalisation:
- two-level (default): norm_group = episode id, coef_b = 1 / (branches of the episode),
  so a token's weight is the share of sampled branches that carry it, the token mean is
  taken inside each episode, then the mean across episodes.
- token: one norm_group for the whole batch, coef_b = 1 / (branches of its episode).
- path: norm_group = the branch itself, coef_b = 1 (each path its own token mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, eq=False)
class Segment:
    """A run of tokens; its first token follows the last token of segment `parent`.

    `model_mask[t]` is True where the model sampled token t (only those are trained);
    `logprobs[t]` is the engine's rollout log-probability of it (0.0 elsewhere);
    `policy_versions[t]` the version that sampled it (-1 elsewhere).
    """

    parent: int  # index into TrainTree.segments, -1 for a root segment
    token_ids: npt.NDArray[np.int32]  # [T]
    model_mask: npt.NDArray[np.bool_]  # [T]
    logprobs: npt.NDArray[np.float32]  # [T]
    policy_versions: npt.NDArray[np.int32]  # [T]

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class Branch:
    """One sampled root-to-leaf path: ends at the last token of segment `leaf`."""

    leaf: int
    advantage: float
    coef: float
    norm_group: str
    role: str = "main"
    session_id: str = ""  # the (sub)session whose call ends this branch
    call_id: str = ""  # the call whose context (or summary output) ends this branch
    reward: float = 0.0  # the reward the advantage was computed from


@dataclass(frozen=True, eq=False)
class TrainTree:
    """One trainable tree. Segments are topologically ordered: parents come first.

    A tree has exactly one root segment (parent == -1).
    """

    tree_id: str  # the episode (root session id), or episode id + "/compaction/N"
    segments: tuple[Segment, ...]
    branches: tuple[Branch, ...]

    @property
    def unique_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def path_segments(self, branch: Branch) -> list[int]:
        """Segment indices from the root down to the branch's leaf."""
        out = []
        i = branch.leaf
        while i != -1:
            out.append(i)
            i = self.segments[i].parent
        return out[::-1]

    @property
    def path_tokens(self) -> int:
        """Sum over branches of their path length: what per-path training would process."""
        return sum(
            sum(len(self.segments[i]) for i in self.path_segments(b)) for b in self.branches
        )
