"""Consistent numerics end to end: what the engine sampled is what the trainer computes.

Sessions run concurrently on the embedded engine (so their calls share changing
batches), each with a follow-up turn and a branch; their trees are packed several to a
stream and recomputed by the trainer. With `numerics="consistent"` on both sides every
trained token's log-probability is the rollout's, bit for bit; with the standard
kernels most differ in the last bits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.reference import causal_lists
from tests.train.conftest import tiny_qwen3
from tidal.engine.base import SamplingParams
from tidal.engine.consistent import ConsistentModel
from tidal.engine.embedded import EmbeddedEngine
from tidal.engine.tiny import ensure_tiny
from tidal.train import LossConfig, TreeTrainer, pack_trees, recompute_logprobs
from tidal.train.packing import TreeTrainingError
from tidal.tree.types import Branch, Segment, TrainTree

SESSIONS = 5


def _segment(parent: int, ids: object, lp: object = None) -> Segment:
    ids = np.asarray(ids, dtype=np.int32)
    n = ids.shape[0]
    model = lp is not None
    return Segment(
        parent,
        ids,
        np.full(n, model),
        np.asarray(lp, dtype=np.float32) if model else np.zeros(n, np.float32),
        np.full(n, 0 if model else -1, dtype=np.int32),
    )


def rollout_trees(numerics: str, device: str = "cpu") -> tuple[list[TrainTree], Path]:
    """Concurrent sessions: prompt -> answer -> (tool result A -> answer | B -> answer)."""
    tiny = ensure_tiny()
    params = SamplingParams(max_tokens=24, seed=None)
    trees: list[TrainTree] = []
    lock = threading.Lock()
    with EmbeddedEngine(tiny, numerics=numerics, seed=0, batch_wait_s=0.0,
                        device=device) as eng:

        def session(i: int) -> None:
            rng = np.random.default_rng(i)
            prompt = rng.integers(0, 5000, size=20 + 23 * i).tolist()
            first = eng.generate([prompt], params)[0]
            ctx = prompt + first.output_ids.tolist()
            a, b = [11, 12, 13], [21, 22]
            second, third = eng.generate([ctx + a, ctx + b], params)
            segs = (
                _segment(-1, prompt), _segment(0, first.output_ids, first.logprobs),
                _segment(1, a), _segment(2, second.output_ids, second.logprobs),
                _segment(1, b), _segment(4, third.output_ids, third.logprobs),
            )
            tree = TrainTree(f"s{i}", segs, (Branch(3, 1.0, 1.0, f"g{i % 2}"),
                                               Branch(5, -1.0, 1.0, f"g{i % 2}")))
            with lock:
                trees.append(tree)

        threads = [threading.Thread(target=session, args=(i,)) for i in range(SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return sorted(trees, key=lambda t: t.tree_id), tiny


@pytest.fixture(scope="module")
def consistent_rollouts() -> Iterator[tuple[list[TrainTree], Path]]:
    yield rollout_trees("consistent")


def policy(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def test_trainer_recomputes_the_rollout_logprobs_exactly(
    consistent_rollouts: tuple[list[TrainTree], Path],
) -> None:
    trees, tiny = consistent_rollouts
    batch = pack_trees(trees, 4096)
    assert len(batch.streams) == 1 and batch.n_targets > 200  # all trees in one stream
    old = recompute_logprobs(policy(tiny), batch, attention="consistent").numpy()
    assert np.array_equal(old, batch.rollout_logprobs_N)

    standard, _ = rollout_trees("standard")
    sb = pack_trees(standard, 4096)
    diff = np.abs(recompute_logprobs(policy(tiny), sb).numpy() - sb.rollout_logprobs_N)
    assert diff.max() < 1e-4 and (diff > 0).mean() > 0.2  # the mismatch being removed


def test_consistent_step_reads_no_mismatch_and_trains_like_standard(
    consistent_rollouts: tuple[list[TrainTree], Path],
) -> None:
    trees, tiny = consistent_rollouts
    updates = {}
    for attention in ("consistent", "blocks"):
        model = policy(tiny)
        before = [p.detach().clone() for p in model.parameters()]
        trainer = TreeTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0),
                              LossConfig(), attention=attention, max_grad_norm=None)
        m = trainer.step(trees)
        if attention == "consistent":
            assert m.max_abs_logprob_diff == 0.0 and m.token_kl == 0.0 and m.chi2 == 0.0
            assert m.is_clipped_fraction == 0.0 and m.ess == pytest.approx(1.0)
        else:
            assert m.max_abs_logprob_diff > 0.0
        updates[attention] = [p.detach() - b for p, b in zip(model.parameters(), before,
                                                            strict=True)]
    for a, b in zip(updates["consistent"], updates["blocks"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    assert any(float(u.abs().max()) > 1e-4 for u in updates["consistent"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trainer_recomputes_the_rollout_logprobs_exactly() -> None:
    """The same on a GPU: concurrent sessions sampled by the CUDA engine in consistent
    numerics, recomputed by the trainer on CUDA, equal bit for bit; a step there reads no
    mismatch. (cuBLAS picks kernels by shape, so `tile_sizes` decides there which tiles
    agree with the reference one.)"""
    trees, tiny = rollout_trees("consistent", device="cuda")
    batch = pack_trees(trees, 4096)
    model = policy(tiny).cuda()
    old = recompute_logprobs(model, batch, attention="consistent").cpu().numpy()
    diff = np.abs(old - batch.rollout_logprobs_N)
    assert np.array_equal(old, batch.rollout_logprobs_N), (
        f"{int((diff > 0).sum())} of {diff.size} targets differ, max {diff.max():.3g}")
    trainer = TreeTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0), LossConfig(),
                          attention="consistent", max_grad_norm=None)
    m = trainer.step(trees)
    assert m.max_abs_logprob_diff == 0.0 and m.token_kl == 0.0


def test_a_tree_over_one_stream_is_refused(
    consistent_rollouts: tuple[list[TrainTree], Path],
) -> None:
    trees, tiny = consistent_rollouts
    big = max(trees, key=lambda t: t.unique_tokens)
    batch = pack_trees([big], 128)  # partitioned
    with pytest.raises(TreeTrainingError, match="consistent numerics need each tree in one"):
        recompute_logprobs(policy(tiny), batch, attention="consistent")


def test_tree_stream_equals_each_path_alone_on_qwen3() -> None:
    """A Qwen3 tree (GQA, per-head q/k norms) packed with ancestors across KEY_BLOCK
    boundaries: each target's log-probability equals its path's own forward, exactly."""
    model = tiny_qwen3(seed=3)
    rng = np.random.default_rng(0)

    def ids(n: int) -> np.ndarray:
        return rng.integers(0, 512, size=n)

    segs = (
        _segment(-1, ids(70)),
        _segment(0, ids(30), -np.ones(30)),
        _segment(0, ids(5), -np.ones(5)),
        _segment(1, ids(40), -np.ones(40)),
    )
    tree = TrainTree("q3", segs, (Branch(2, 1.0, 1.0, "g"), Branch(3, -1.0, 1.0, "g")))
    batch = pack_trees([tree], 4096)
    got = recompute_logprobs(model, batch, attention="consistent").numpy()
    cm = ConsistentModel(model)
    want = np.zeros_like(got)
    for path in ([0, 2], [0, 1, 3]):
        seq = np.concatenate([segs[s].token_ids for s in path]).astype(np.int64)
        n = seq.shape[0]
        with torch.no_grad():
            lp = cm.logits(cm.hidden(torch.as_tensor(seq), torch.arange(n), causal_lists(n)))
            lp = lp.log_softmax(-1)[:-1].gather(1, torch.as_tensor(seq[1:])[:, None])[:, 0]
        # targets of this path: its model tokens, located by (tree, DFS index)
        lay = batch.layouts[0]
        dfs = np.concatenate([lay.seg_start_S[s] + np.arange(len(segs[s])) for s in path])
        for n_i in range(batch.n_targets):
            d = int(batch.target_dfs_N[n_i])
            hit = np.flatnonzero(dfs == d)
            if hit.size:
                want[n_i] = lp[int(hit[0]) - 1].item()
    assert np.array_equal(got, want)
