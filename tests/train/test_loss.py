"""Each importance-correction formula and the PPO term against direct computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tidal.train.loss import LossConfig, pair_correction, pair_loss

# three branches over five targets: branch 0 = {0,1,2}, branch 1 = {0,1,3}, branch 2 = {4}
TGT = torch.tensor([0, 1, 2, 0, 1, 3, 4])
BR = torch.tensor([0, 0, 0, 1, 1, 1, 2])
DELTA = torch.tensor([0.1, -0.9, 0.8, 0.05, 1.2], dtype=torch.float64)  # old - rollout


def _run(**kw: float | str) -> tuple[np.ndarray, np.ndarray]:
    w, m = pair_correction(DELTA, TGT, BR, 3, LossConfig(**kw))  # type: ignore[arg-type]
    return w.numpy(), m.numpy()


def test_none() -> None:
    w, m = _run(correction="none")
    assert (w == 1).all() and (m == 1).all()


def test_token_tis_truncates_at_c() -> None:
    w, m = _run(correction="tis", C=2.0)
    rho = [math.exp(d) for d in DELTA.tolist()]
    want = [min(rho[t], 2.0) for t in TGT.tolist()]
    np.testing.assert_allclose(w, want)
    assert (m == 1).all()
    assert w[TGT.tolist().index(2)] == 2.0 and w[-1] == 2.0  # rho = e^0.8, e^1.2 > 2


def test_token_mis_masks_above_c() -> None:
    w, m = _run(correction="mis", C=2.0)
    rho = np.exp(DELTA.numpy())[TGT.numpy()]
    np.testing.assert_array_equal(m, (rho <= 2.0).astype(float))
    np.testing.assert_allclose(w, np.where(rho <= 2.0, rho, 0.0))
    assert m.sum() == 5


def test_icepop_masks_outside_alpha_beta() -> None:
    w, m = _run(correction="icepop", alpha=0.5, beta=2.0)
    rho = np.exp(DELTA.numpy())[TGT.numpy()]
    keep = (rho >= 0.5) & (rho <= 2.0)
    np.testing.assert_array_equal(m, keep.astype(float))
    np.testing.assert_allclose(w, np.where(keep, rho, 0.0))
    assert not keep[1] and not keep[2]  # rho = e^-0.9 < 0.5 and e^0.8 > 2


def _seq() -> np.ndarray:
    d = DELTA.numpy()
    return np.array([d[0] + d[1] + d[2], d[0] + d[1] + d[3], d[4]])


def test_sequence_tis() -> None:
    w, m = _run(correction="seq_tis", C=1.5)
    s = _seq()  # 0.0, -0.75, 1.2
    want_b = np.minimum(np.exp(s), 1.5)
    np.testing.assert_allclose(w, want_b[BR.numpy()])
    assert (m == 1).all()


def test_sequence_mis() -> None:
    w, m = _run(correction="seq_mis", C=1.5)
    s = _seq()
    keep_b = np.exp(s) <= 1.5
    np.testing.assert_array_equal(m, keep_b[BR.numpy()].astype(float))
    np.testing.assert_allclose(w, np.where(keep_b, np.exp(s), 0.0)[BR.numpy()])
    assert m.tolist() == [1, 1, 1, 1, 1, 1, 0]


def test_geometric_mean_mis() -> None:
    w, m = _run(correction="geo_mis", geo_low=0.8, geo_high=1.1)
    g = np.exp(_seq() / np.array([3, 3, 1]))  # 1.0, 0.78, 3.3
    keep_b = (g >= 0.8) & (g <= 1.1)
    np.testing.assert_array_equal(m, keep_b[BR.numpy()].astype(float))
    np.testing.assert_array_equal(w, m)
    assert keep_b.tolist() == [True, False, False]


@pytest.mark.parametrize("adv", [1.5, -0.7])
def test_ppo_term_and_clip(adv: float) -> None:
    new = torch.tensor([0.0, 0.5, -0.5, 0.1], dtype=torch.float64)
    old = torch.zeros(4, dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=torch.float64)
    cfg = LossConfig(clip_low=0.2, clip_high=0.3)
    loss, clipped = pair_loss(new, old, torch.full((4,), adv, dtype=torch.float64), w, cfg=cfg)
    for i in range(4):
        r = math.exp(new[i].item())
        rc = min(max(r, 0.8), 1.3)
        assert loss[i].item() == pytest.approx(-w[i].item() * min(r * adv, rc * adv))
        assert clipped[i].item() == float(rc * adv < r * adv)
    assert clipped.sum() >= 1


def test_k3_kl_term() -> None:
    new = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    cfg = LossConfig(kl_coef=0.5)
    one = torch.ones(2, dtype=torch.float64)
    loss, _ = pair_loss(new, new, torch.zeros(2, dtype=torch.float64), one, cfg=cfg, ref=ref)
    d = (ref - new).numpy()
    np.testing.assert_allclose(loss.numpy(), 0.5 * (np.exp(d) - d - 1))
    with pytest.raises(ValueError, match="reference"):
        pair_loss(new, new, one, one, cfg=cfg)


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="correction"):
        LossConfig(correction="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bounds"):
        LossConfig(alpha=3.0, beta=2.0)
