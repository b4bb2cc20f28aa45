"""Tree-packed loss and gradients equal per-path training (fp32, rtol 1e-5)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.train.conftest import (
    compare_to_paths,
    random_trees,
    tiny_llama,
    tiny_qwen2,
    tiny_qwen3,
)
from tidal.train.loss import CORRECTIONS, LossConfig, path_logprobs
from tidal.train.packing import pack_trees
from tidal.train.trainer import (
    recompute_logprobs,
)
from tidal.tree.types import TrainTree


@pytest.mark.parametrize("attention", ["blocks", "dense"])
@pytest.mark.parametrize(("seed", "max_tokens"), [(0, 10_000), (2, 45), (3, 9)])
def test_grads_equal_per_path(attention: str, seed: int, max_tokens: int) -> None:
    compare_to_paths(
        tiny_qwen3(seed),
        random_trees(seed),
        LossConfig(correction="tis"),
        max_tokens,
        attention=attention,
    )


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_every_correction_mode_matches_per_path(correction: str) -> None:
    bounds = {"C": 1.3, "alpha": 0.8, "beta": 1.25, "geo_low": 0.96, "geo_high": 1.04}
    cfg = LossConfig(correction=correction, **bounds)  # type: ignore[arg-type]
    compare_to_paths(tiny_qwen3(4), random_trees(4, n=2), cfg, 40)


def test_kl_to_reference_matches_per_path() -> None:
    cfg = LossConfig(correction="none", kl_coef=0.1)
    compare_to_paths(tiny_qwen3(5), random_trees(5, n=3), cfg, 10_000, ref_model=tiny_qwen3(99))


@pytest.mark.parametrize("factory", [tiny_qwen2, tiny_qwen3, tiny_llama])
def test_qwen2_qwen3_and_llama_partitioned(factory: Callable[[int], torch.nn.Module]) -> None:
    compare_to_paths(factory(6), random_trees(6, n=2), LossConfig(correction="mis", C=1.5), 16)


@pytest.mark.parametrize("factory", [tiny_qwen3, tiny_llama])
@pytest.mark.parametrize("max_tokens", [10_000, 11])
def test_recomputed_logprobs_equal_plain_forward(
        max_tokens: int, factory: Callable[[int], torch.nn.Module]) -> None:
    model = factory(7)
    trees = random_trees(7, n=3)
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
    compare_to_paths(model, random_trees(8, n=3), LossConfig(), 30, attention="flex")


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
    compare_to_paths(tiny_qwen3(9), [tree],
                     LossConfig(correction="icepop", alpha=0.85, beta=1.15), 1000)
