"""PPO-clip / GRPO loss with importance-ratio correction, on tree pairs and on plain paths.

Per (token t, branch b) pair, with new/old/rollout/reference log-probabilities:

    r      = exp(new - old)                       (trainer ratio, clipped by PPO)
    delta  = old - rollout, rho = exp(delta)      (train/inference mismatch)
    loss   = -w * min(r A_b, clip(r, 1 - eps_low, 1 + eps_high) A_b) + kl_coef * k3
    k3     = exp(ref - new) - (ref - new) - 1     (only when kl_coef > 0)

and the batch loss L = (1/G) sum_g N_g / D_g of `tidal.tree.types` with m = the
correction mask. Corrections (w, m), all computed without gradient:
- none:    w = 1, m = 1
- tis:     w = min(rho, C)                                  (token truncation)
- mis:     w = rho, m = [rho <= C]                          (token masking)
- icepop:  w = rho, m = [alpha <= rho <= beta]
- seq_tis: w = min(rho_b, C),  rho_b = exp(sum over the branch's trained tokens of delta)
- seq_mis: w = rho_b, m = [rho_b <= C]
- geo_mis: w = 1,   m = [geo_low <= exp(mean over the branch's trained tokens of delta) <= geo_high]
Sequence-level quantities are per branch, so a shared token may be kept on one branch
and masked on another. Masked pairs leave both N_g and D_g; a group whose D_g is 0
contributes 0 (G still counts it).

Shape letters: N targets, P (target, branch) pairs, B branches, L tokens of one path.

`per_path_loss` is the plain reference: every branch run as its own causal sequence
through the unmodified model, same formulas written per path. Deliberately simple and
slow; tests and the benchmark compare tree training against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from tidal.tree.types import TrainTree

Correction = Literal["none", "tis", "mis", "icepop", "seq_tis", "seq_mis", "geo_mis"]
CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis", "icepop", "seq_tis", "seq_mis", "geo_mis")


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    correction: Correction = "tis"
    C: float = 2.0
    alpha: float = 0.5
    beta: float = 5.0
    geo_low: float = 0.99
    geo_high: float = 1.01

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {CORRECTIONS}, got {self.correction!r}")
        if self.C <= 0 or self.alpha > self.beta or self.geo_low > self.geo_high:
            raise ValueError(f"inconsistent correction bounds in {self}")


def token_correction(
    delta: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(w, m) for token-level modes from delta = old - rollout; None for sequence modes."""
    rho = delta.exp()
    one = torch.ones_like(delta)
    if cfg.correction == "none":
        return one, one
    if cfg.correction == "tis":
        return rho.clamp(max=cfg.C), one
    if cfg.correction == "mis":
        m = (rho <= cfg.C).to(delta.dtype)
        return rho * m, m
    if cfg.correction == "icepop":
        m = ((rho >= cfg.alpha) & (rho <= cfg.beta)).to(delta.dtype)
        return rho * m, m
    return None


def sequence_correction(
    seq_log_ratio: torch.Tensor, n_tokens: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, m) per branch from the summed delta over its trained tokens (sequence modes)."""
    logC = math.log(cfg.C)
    if cfg.correction == "seq_tis":
        return seq_log_ratio.clamp(max=logC).exp(), torch.ones_like(seq_log_ratio)
    if cfg.correction == "seq_mis":
        m = (seq_log_ratio <= logC).to(seq_log_ratio.dtype)
        return seq_log_ratio.clamp(max=logC).exp() * m, m
    if cfg.correction == "geo_mis":
        g = (seq_log_ratio / n_tokens.clamp(min=1)).exp()
        m = ((g >= cfg.geo_low) & (g <= cfg.geo_high)).to(seq_log_ratio.dtype)
        return m, m
    raise ValueError(f"{cfg.correction!r} is not a sequence-level correction")


def pair_correction(
    delta_N: torch.Tensor,
    pair_target_P: torch.Tensor,
    pair_branch_P: torch.Tensor,
    n_branches: int,
    cfg: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_P, m_P) for every (target, branch) pair of a batch."""
    tok = token_correction(delta_N, cfg)
    if tok is not None:
        return tok[0][pair_target_P], tok[1][pair_target_P]
    s_B = torch.zeros(n_branches, dtype=delta_N.dtype, device=delta_N.device)
    s_B.index_add_(0, pair_branch_P, delta_N[pair_target_P])
    n_B = torch.zeros_like(s_B).index_add_(0, pair_branch_P, torch.ones_like(s_B[pair_branch_P]))
    w_B, m_B = sequence_correction(s_B, n_B, cfg)
    return w_B[pair_branch_P], m_B[pair_branch_P]


def pair_loss(
    new: torch.Tensor,
    old: torch.Tensor,
    advantage: torch.Tensor,
    w: torch.Tensor,
    *,
    cfg: LossConfig,
    ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair loss and a 0/1 tensor marking pairs where the PPO clip is active."""
    r = (new - old).exp()
    rc = r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    s1, s2 = r * advantage, rc * advantage
    loss = -w * torch.minimum(s1, s2)
    if cfg.kl_coef:
        if ref is None:
            raise ValueError("kl_coef > 0 needs reference log-probabilities")
        d = ref - new
        loss = loss + cfg.kl_coef * (d.exp() - d - 1)
    return loss, (s2 < s1).detach().to(new.dtype)


def path_logprobs(
    model: torch.nn.Module, ids_L: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities of ids_L[positions] given the tokens before them; plain causal.

    Logits are computed only at the predicting positions (as the tree trainer does), so
    the per-path baseline pays for no vocabulary projection it does not use.
    """
    decoder = model.get_decoder()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    hidden = decoder(input_ids=ids_L[None], use_cache=False).last_hidden_state[0]
    logits = head(hidden.index_select(0, positions - 1)).float()
    return logits.gather(1, ids_L[positions, None])[:, 0] - logits.logsumexp(-1)


def path_correction(delta: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One path's importance correction from its tokens' `delta` (old minus rollout
    logprobs): per token (`token_correction`), or one sequence-level weight and mask
    spread over the path's tokens. Returns (weights, mask), each shaped like `delta`."""
    tok = token_correction(delta, cfg)
    if tok is not None:
        return tok
    n = torch.tensor([float(delta.numel())], device=delta.device)
    w1, m1 = sequence_correction(delta.sum()[None], n, cfg)
    return w1.expand_as(delta), m1.expand_as(delta)


def per_path_loss(
    model: torch.nn.Module,
    trees: Sequence[TrainTree],
    old_logprobs: Sequence[Sequence[npt.ArrayLike]],
    cfg: LossConfig,
    ref_logprobs: Sequence[Sequence[npt.ArrayLike]] | None = None,
) -> torch.Tensor:
    """Reference loss: every branch of every tree as its own sequence (differentiable).

    `old_logprobs[tree][segment]` are the trainer's pre-update log-probabilities per
    token (only model tokens are read); the rollout ones come from the segments.
    """
    device = next(model.parameters()).device
    groups: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for ti, tree in enumerate(trees):
        for b in tree.branches:
            path = tree.path_segments(b)
            segs = [tree.segments[i] for i in path]
            ids = np.concatenate([s.token_ids for s in segs]).astype(np.int64)
            mask = np.concatenate([s.model_mask for s in segs])
            roll = np.concatenate([s.logprobs for s in segs]).astype(np.float32)
            old = np.concatenate([np.asarray(old_logprobs[ti][i], dtype=np.float32) for i in path])
            sel = np.flatnonzero(mask[1:]) + 1  # trained positions (never the first token)
            num, den = groups.setdefault(b.norm_group, ([], []))
            if sel.size == 0:
                continue
            new = path_logprobs(
                model, torch.as_tensor(ids, device=device), torch.as_tensor(sel, device=device)
            )
            old_t = torch.as_tensor(old[sel], device=device)
            delta = old_t - torch.as_tensor(roll[sel], device=device)
            w, m = path_correction(delta, cfg)
            ref = None
            if ref_logprobs is not None:
                ref_np = np.concatenate(
                    [np.asarray(ref_logprobs[ti][i], dtype=np.float32) for i in path]
                )
                ref = torch.as_tensor(ref_np[sel], device=device)
            adv = torch.full_like(new, b.advantage)
            loss, _ = pair_loss(new, old_t, adv, w, cfg=cfg, ref=ref)
            num.append(b.coef * (m * loss).sum())
            den.append(b.coef * m.sum())
    total = torch.zeros((), device=device)
    for num, den in groups.values():
        if not num:
            continue
        d = torch.stack(den).sum()
        if d > 0:
            total = total + torch.stack(num).sum() / d
    return total / max(len(groups), 1)
