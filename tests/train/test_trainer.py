"""TreeTrainer.step: the update equals per-path SGD, and the metrics are what they say."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.train.conftest import tiny_qwen3, with_rollout
from tests.train.synthetic import random_tree
from tidal.train.loss import LossConfig, path_logprobs, per_path_loss
from tidal.train.packing import TreeTrainingError, pack_trees
from tidal.train.trainer import (
    KVCache,
    StepMetrics,
    TreeTrainer,
    build_pair_terms,
    mismatch_metrics,
    one_pass,
    recompute_logprobs,
    tree_loss_backward,
)
from tidal.tree.types import TrainTree


def _setup(seed: int) -> tuple[torch.nn.Module, list[TrainTree], torch.Tensor]:
    model = tiny_qwen3(seed)
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, f"e{i}", n_segments=int(rng.integers(2, 9))) for i in range(3)]
    batch = pack_trees(trees, 10_000)
    true = recompute_logprobs(model, batch)
    gen = torch.Generator().manual_seed(seed)
    rollout = true + 0.3 * torch.randn(true.shape, generator=gen)
    return model, with_rollout(trees, batch.to_segment_arrays(rollout.numpy())), true


@pytest.mark.parametrize("max_tokens", [10_000, 13])
def test_step_equals_per_path_sgd(max_tokens: int) -> None:
    model, trees, true = _setup(0)
    ref = copy.deepcopy(model)
    cfg = LossConfig(correction="tis", C=1.2)
    trainer = TreeTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        cfg,
        max_tokens=max_tokens,
        max_grad_norm=None,
    )
    metrics = trainer.step(trees)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    batch = pack_trees(trees, 10_000)
    loss = per_path_loss(ref, trees, batch.to_segment_arrays(true.numpy()), cfg)
    loss.backward()
    opt.step()
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
    moved = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, (p - tiny_qwen3(0).get_parameter(name)).abs().max().item())
    assert moved > 1e-4


def test_trees_without_signal_are_skipped_with_the_same_update() -> None:
    """Trees whose groups hold only zero advantages are not trained, yet the update is
    exactly per-path SGD over the whole batch (G still counts their groups)."""
    model, trees, true = _setup(5)
    quiet = TrainTree(trees[1].tree_id, trees[1].segments,
                      tuple(replace(b, advantage=0.0) for b in trees[1].branches))
    trees = [trees[0], quiet, trees[2]]
    ref = copy.deepcopy(model)
    cfg = LossConfig(correction="tis", C=1.2)
    trainer = TreeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5), cfg,
                          max_grad_norm=None)
    m = trainer.step(trees)
    assert m.trees_skipped == 1
    assert m.tokens == trees[0].unique_tokens + trees[2].unique_tokens
    batch = pack_trees(trees, 10_000)
    loss = per_path_loss(ref, trees, batch.to_segment_arrays(true.numpy()), cfg)
    loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)

    before = copy.deepcopy(model.state_dict())
    m = trainer.step([quiet])
    assert m.trees_skipped == 1 and m.tokens == 0 and m.grad_norm == 0.0
    for name, p in model.state_dict().items():
        assert torch.equal(p, before[name]), name  # no signal: no optimizer step


def test_metrics_match_direct_computation() -> None:
    model, trees, _ = _setup(1)
    cfg = LossConfig(correction="mis", C=1.3)
    trainer = TreeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
    m = trainer.step(trees)
    assert isinstance(m, StepMetrics)
    # direct: per unique trained token and per branch, from plain per-path forwards
    deltas: dict[tuple[int, int, int], float] = {}
    seq, pairs, masked, branches = [], 0, 0, 0
    for ti, t in enumerate(trees):
        for b in t.branches:
            path = t.path_segments(b)
            ids = np.concatenate([t.segments[i].token_ids for i in path]).astype(np.int64)
            mask = np.concatenate([t.segments[i].model_mask for i in path])
            roll = np.concatenate([t.segments[i].logprobs for i in path])
            keys = [(ti, i, o) for i in path for o in range(len(t.segments[i]))]
            sel = np.flatnonzero(mask[1:]) + 1
            new = path_logprobs(model, torch.as_tensor(ids), torch.as_tensor(sel)).detach().numpy()
            d = new - roll[sel]
            for k, v in zip(sel, d, strict=True):
                deltas[keys[k]] = float(v)
            seq.append(float(-d.sum()))
            pairs += sel.size
            masked += int((np.exp(d) > 1.3).sum())
            branches += 1
    d_all = np.array(list(deltas.values()))
    rho = np.exp(d_all)
    assert m.token_kl == pytest.approx(float(np.mean(-d_all)), rel=1e-4)
    assert m.k3_kl == pytest.approx(float(np.mean(rho - d_all - 1)), rel=1e-4)
    assert m.chi2 == pytest.approx(float(np.mean(rho**2) - 1), rel=1e-4)
    assert m.ess == pytest.approx(float(rho.sum() ** 2 / (rho.size * (rho**2).sum())), rel=1e-4)
    assert m.seq_kl == pytest.approx(float(np.mean(seq)), rel=1e-4)
    assert m.max_abs_logprob_diff == pytest.approx(float(np.abs(d_all).max()), rel=1e-4)
    assert m.mean_abs_logprob_diff == pytest.approx(float(np.abs(d_all).mean()), rel=1e-4)
    assert m.masked_fraction == pytest.approx(masked / pairs)
    assert 0 < m.masked_fraction < 1
    assert m.tree_token_ratio == pytest.approx(
        sum(t.path_tokens for t in trees) / sum(t.unique_tokens for t in trees)
    )
    assert m.tree_token_ratio > 1
    assert m.tokens == sum(t.unique_tokens for t in trees)
    assert m.ppo_clip_fraction == 0.0  # r == 1 at the single on-batch step
    assert set(m.as_dict()) >= {"loss", "token_kl", "ess", "seconds"}


def test_step_with_kl_reference_and_errors() -> None:
    model, trees, _ = _setup(2)
    with pytest.raises(ValueError, match="ref_model"):
        TreeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    LossConfig(kl_coef=0.1)).step(trees)
    ref = tiny_qwen3(3)
    trainer = TreeTrainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        LossConfig(kl_coef=0.1),
        ref_model=ref,
    )
    before = trainer.step(trees)
    after = trainer.step(trees)
    assert np.isfinite(before.loss) and np.isfinite(after.loss)
    assert before.grad_norm > 0
    assert after.token_kl != before.token_kl  # the policy moved
    bad = [TrainTree("sess-bad", trees[0].segments, ())]
    with pytest.raises(TreeTrainingError, match="sess-bad"):
        trainer.step(bad)


def test_plain_generate_still_works_after_switching_attention() -> None:
    model, trees, _ = _setup(4)
    TreeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), LossConfig())
    ids = torch.as_tensor(trees[0].segments[0].token_ids[:5], dtype=torch.int64)[None]
    out = model(input_ids=ids).logits
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(out, model(input_ids=ids).logits)


def test_a_rank_loads_its_kl_reference_from_a_checkpoint() -> None:
    """`RankTrainer.set_reference`: without one a KL step fails; with the policy's own
    checkpoint as the reference, the first step is the step without KL (the k3 term and
    its gradient are 0 where policy = reference) and ref_kl is 0; the next step, the
    policy has moved off it. Another checkpoint as reference changes the first step."""
    from tidal.engine.tiny import ensure_tiny
    from tidal.train.distributed import Ranks
    from tidal.train.group import RankTrainer, TrainerSpec

    rng = np.random.default_rng(0)
    trees = [random_tree(rng, f"t{i}", n_segments=5, vocab=200, max_len=12) for i in range(4)]

    def rank(kl: float) -> RankTrainer:
        return RankTrainer(TrainerSpec(weights_dir=str(ensure_tiny(seed=0)), device="cpu",
                                       lr=1e-3, loss=LossConfig(kl_coef=kl), max_tokens=64),
                           Ranks())

    plain = rank(0.0).step(trees)
    same = rank(0.5)
    with pytest.raises(ValueError, match="ref_model"):
        same.step(trees)
    same.set_reference(str(ensure_tiny(seed=0)))
    first = same.step(trees)
    assert first.loss == pytest.approx(plain.loss, rel=1e-6) and first.ref_kl == 0.0
    assert first.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    assert same.step(trees).ref_kl != 0.0
    other = rank(0.5)
    other.set_reference(str(ensure_tiny(seed=1)))
    moved = other.step(trees)
    assert moved.ref_kl != 0.0 and moved.loss != pytest.approx(plain.loss, rel=1e-3)


@pytest.mark.parametrize("correction", ["tis", "none"])
@pytest.mark.parametrize("max_tokens", [10_000, 13])
def test_one_pass_step_equals_the_two_pass_step(correction: str, max_tokens: int) -> None:
    """A mask-free token-level correction skips the no-grad pass (`one_pass`): the old
    log-probabilities are the grad pass's own, detached. The update and the mismatch
    metrics are those of a no-grad pass followed by the grad pass, bit for bit, with
    unpartitioned trees (max_tokens 10_000) and partitioned ones (13), whose no-grad pass
    still runs for their keys/values."""
    model, trees, _ = _setup(6)
    ref = copy.deepcopy(model)
    cfg = LossConfig(correction=correction, C=1.2)  # type: ignore[arg-type]
    assert one_pass(cfg) and not one_pass(LossConfig(correction="mis"))
    m = TreeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5), cfg,
                    max_tokens=max_tokens, max_grad_norm=None, merge=False).step(trees)

    batch = pack_trees(trees, max_tokens)
    assert (max_tokens == 13) == any(s.partition is not None for s in batch.streams)
    cache = KVCache()
    old = recompute_logprobs(ref, batch, kv_cache=cache)
    terms = build_pair_terms(batch, old, cfg)
    loss, clip = tree_loss_backward(ref, batch, terms, cfg, cache)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    assert m.loss == loss and m.ppo_clip_fraction == clip == 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    direct = mismatch_metrics(batch, terms, cfg)
    assert direct["token_kl"] != 0.0
    assert {k: getattr(m, k) for k in direct} == direct

    kept = (terms.old_N.clone(), terms.w_P.clone())
    with pytest.raises(ValueError, match="'mis' masks pairs"):
        terms.set_old(batch.streams[0], 0, old[: batch.streams[0].n_targets] + 1.0,
                      LossConfig(correction="mis"))
    assert torch.equal(terms.old_N, kept[0]) and torch.equal(terms.w_P, kept[1])  # untouched
