"""Tree-packed loss and gradients equal per-path training (fp32, rtol 1e-5)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.train.conftest import tiny_qwen2, tiny_qwen3, with_rollout
from tidal.train.attention import enable_tree_attention
from tidal.train.loss import CORRECTIONS, LossConfig, path_logprobs, per_path_loss
from tidal.train.packing import pack_trees
from tidal.train.synthetic import random_tree
from tidal.train.trainer import (
    KVCache,
    build_pair_terms,
    recompute_logprobs,
    tree_loss_backward,
)
from tidal.tree.types import TrainTree


def _trees(seed: int, n: int = 3, max_segments: int = 10) -> list[TrainTree]:
    rng = np.random.default_rng(seed)
    return [
        random_tree(
            rng,
            f"s{seed}-{i}",
            n_segments=int(rng.integers(1, max_segments)),
            max_len=int(rng.choice([3, 16])),
            n_groups=2,
        )
        for i in range(n)
    ]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def _compare(
    model: torch.nn.Module,
    trees: list[TrainTree],
    cfg: LossConfig,
    max_tokens: int,
    *,
    attention: str = "blocks",
    old_noise: float = 0.3,
    ref_model: torch.nn.Module | None = None,
) -> float:
    """Tree loss/grads vs per-path; returns the loss.

    Rollout log-probabilities are set to the model's plus noise (a realistic mismatch),
    and the old ones perturbed too so that the PPO clip is active on some pairs.
    """
    enable_tree_attention(model)
    batch = pack_trees(trees, max_tokens, q_chunk=7)
    gen = torch.Generator().manual_seed(1)
    true = recompute_logprobs(model, batch, attention=attention)
    rollout = true + 0.2 * torch.randn(true.shape, generator=gen)
    trees = with_rollout(trees, batch.to_segment_arrays(rollout.numpy()))
    batch = pack_trees(trees, max_tokens, q_chunk=7)
    cache = KVCache()
    old = recompute_logprobs(model, batch, attention=attention, kv_cache=cache)
    torch.testing.assert_close(old, true, rtol=0, atol=0)
    old = old + old_noise * torch.randn(old.shape, generator=gen)
    ref = None
    ref_seg = None
    if ref_model is not None:
        ref = recompute_logprobs(ref_model, batch, attention=attention)
        ref_seg = batch.to_segment_arrays(ref.numpy())
    terms = build_pair_terms(batch, old, cfg, ref)
    model.zero_grad()
    loss, _ = tree_loss_backward(model, batch, terms, cfg, cache, attention=attention)
    g_tree = _grads(model)
    model.zero_grad()
    ref_loss = per_path_loss(model, trees, batch.to_segment_arrays(old.numpy()), cfg, ref_seg)
    ref_loss.backward()
    g_path = _grads(model)
    assert abs(ref_loss.item()) > 0
    np.testing.assert_allclose(loss, ref_loss.item(), rtol=1e-5, atol=1e-8)
    if cfg.correction in ("mis", "icepop", "seq_mis", "geo_mis"):
        masked = float((terms.m_P == 0).float().mean())
        assert 0 < masked < 1, masked  # the test exercises both kept and masked pairs
    for name, g in g_path.items():
        assert g.abs().max() > 0 or "q_norm" in name or "k_norm" in name, name
        # fp32, different summation order: rtol 1e-5 per element, with an absolute floor
        # of 1e-5 x the tensor's largest gradient; normwise error below 1e-5 as well
        scale = g.abs().max().item()
        torch.testing.assert_close(g_tree[name], g, rtol=1e-5, atol=1e-5 * scale)
        assert (g_tree[name] - g).norm() <= 1e-5 * g.norm(), name
    return loss


@pytest.mark.parametrize("attention", ["blocks", "dense"])
@pytest.mark.parametrize(("seed", "max_tokens"), [(0, 10_000), (2, 45), (3, 9)])
def test_grads_equal_per_path(attention: str, seed: int, max_tokens: int) -> None:
    _compare(
        tiny_qwen3(seed),
        _trees(seed),
        LossConfig(correction="tis"),
        max_tokens,
        attention=attention,
    )


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_every_correction_mode_matches_per_path(correction: str) -> None:
    bounds = {"C": 1.3, "alpha": 0.8, "beta": 1.25, "geo_low": 0.96, "geo_high": 1.04}
    cfg = LossConfig(correction=correction, **bounds)  # type: ignore[arg-type]
    _compare(tiny_qwen3(4), _trees(4, n=2), cfg, 40)


def test_kl_to_reference_matches_per_path() -> None:
    cfg = LossConfig(correction="none", kl_coef=0.1)
    _compare(tiny_qwen3(5), _trees(5, n=3), cfg, 10_000, ref_model=tiny_qwen3(99))


@pytest.mark.parametrize("factory", [tiny_qwen2, tiny_qwen3])
def test_qwen2_and_qwen3_partitioned(factory: Callable[[int], torch.nn.Module]) -> None:
    _compare(factory(6), _trees(6, n=2), LossConfig(correction="mis", C=1.5), 16)


@pytest.mark.parametrize("max_tokens", [10_000, 11])
def test_recomputed_logprobs_equal_plain_forward(max_tokens: int) -> None:
    model = tiny_qwen3(7)
    trees = _trees(7, n=3)
    batch = pack_trees(trees, max_tokens)
    lp = recompute_logprobs(model, batch).numpy()
    got = batch.to_segment_arrays(lp)
    for ti, t in enumerate(trees):
        for b in t.branches:
            path = t.path_segments(b)
            ids = np.concatenate([t.segments[i].token_ids for i in path]).astype(np.int64)
            mask = np.concatenate([t.segments[i].model_mask for i in path])
            sel = np.flatnonzero(mask[1:]) + 1
            want = path_logprobs(model, torch.as_tensor(ids), torch.as_tensor(sel)).detach()
            have = np.concatenate([got[ti][i] for i in path])[sel]
            np.testing.assert_allclose(have, want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention path needs CUDA")
def test_flex_on_cuda_matches_per_path() -> None:
    model = tiny_qwen3(8).cuda()
    _compare(model, _trees(8, n=3), LossConfig(), 30, attention="flex")


def test_grpo_group_is_batched_and_exact() -> None:
    """One prompt, equal-length responses: the responses share one batched SDPA call."""
    from tidal.train.attention import StreamPlan
    from tidal.tree.types import Branch, Segment

    rng = np.random.default_rng(9)

    def seg(parent: int, n: int, model: bool) -> Segment:
        return Segment(
            parent,
            rng.integers(0, 512, n).astype(np.int32),
            np.full(n, model),
            np.full(n, -6.0 if model else 0.0, np.float32),
            np.zeros(n, np.int32),
        )

    segs = (seg(-1, 20, False), *(seg(0, 9, True) for _ in range(5)))
    tree = TrainTree(
        "grpo",
        segs,
        tuple(Branch(1 + j, float(rng.normal()), 0.2, "grpo") for j in range(5)),
    )
    plan = StreamPlan(
        pack_trees([tree], 1000).streams[0],
        torch.device("cpu"),
        backend="blocks",
        max_mask_bytes=1 << 30,
    )
    # the first response continues the prompt's chain; the other four share one call
    assert [g.n_blocks for g in plan._groups] == [1, 4]
    _compare(tiny_qwen3(9), [tree], LossConfig(correction="icepop", alpha=0.85, beta=1.15), 1000)
