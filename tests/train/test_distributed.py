"""Training across ranks (FSDP2 on gloo, real processes) equals one rank.

With partitioned trees, trees merged from several episodes and norm groups spanning
ranks in the batch, 2 ranks give 1 rank's gradients (fp32, relative 1e-6 per parameter)
and the whole batch's metrics; sharded checkpoints load at another world size.

The parameters after AdamW's first step agree to 1e-4, not 1e-6: Adam divides each
gradient by its own magnitude, so a gradient that is 0 in exact arithmetic (a key
projection's bias: softmax ignores a constant shift) turns its summation-order noise
(~1e-13) into a step of up to lr. Measured here: k_proj.bias 6e-5, up_proj 8e-6, every
other parameter below 1e-6; with SGD the parameters agree as the gradients do.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.train.conftest import adam_close, tiny_qwen2, with_rollout
from tests.train.synthetic import random_tree
from tidal.train.distributed import (
    Ranks,
    assign_trees,
    checkpoint_activations,
    full_state_dict,
    load_state,
    save_state,
    shard_policy,
)
from tidal.train.loss import LossConfig
from tidal.train.packing import pack_trees
from tidal.train.trainer import TargetLM, TreeTrainer, recompute_logprobs
from tidal.tree.types import TrainTree

MAX_TOKENS = 48  # small enough that the larger trees are partitioned


def _trees() -> list[TrainTree]:
    """Six episodes, two of each prompt (their trees merge), in three norm groups that
    span trees; rollout log-probabilities near the model's."""
    rng = np.random.default_rng(3)
    trees: list[TrainTree] = []
    for i in range(6):
        t = random_tree(rng, f"ep{i}", n_segments=int(rng.integers(2, 9)),
                        max_len=int(rng.choice([4, 20])))
        root = trees[-1].segments[0] if i % 2 else t.segments[0]
        trees.append(dataclasses.replace(
            t, segments=(root, *t.segments[1:]),
            branches=tuple(dataclasses.replace(b, norm_group=f"g{(i + j) % 3}")
                           for j, b in enumerate(t.branches))))
    model = TargetLM(tiny_qwen2(0))
    batch = pack_trees(trees, MAX_TOKENS)
    true = recompute_logprobs(model, batch)
    noisy = true + 0.1 * torch.randn(true.shape, generator=torch.Generator().manual_seed(2))
    return with_rollout(trees, batch.to_segment_arrays(noisy.numpy()))


def _train(ranks: Ranks, trees: list[TrainTree], out: Path, resume: Path | None = None,
           sgd: bool = False) -> None:
    torch.set_num_threads(1)
    model: torch.nn.Module = TargetLM(tiny_qwen2(0))
    if ranks.distributed:
        model = shard_policy(model, ranks, torch.device("cpu"))
    opt = (torch.optim.SGD(model.parameters(), lr=1e-2) if sgd else
           torch.optim.AdamW(model.parameters(), lr=ADAM_LR, weight_decay=0.0))
    if resume is not None:
        load_state(resume, model, opt)
    trainer = TreeTrainer(model, opt, LossConfig(correction="tis"), max_tokens=MAX_TOKENS,
                          ranks=ranks)
    metrics = trainer.step(trees)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        grads[n.removeprefix("lm.")] = full.detach().clone()
    params = full_state_dict(model, ranks)
    save_state(out / "dcp", model, opt)
    if ranks.rank == 0:
        torch.save({"grads": grads, "params": params, "metrics": metrics.as_dict()},
                   out / "result.pt")


def _rank_main(rank: int, world: int, trees: list[TrainTree], out: Path,
               opts: tuple[Path | None, bool]) -> None:
    resume, sgd = opts
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank,
                            world_size=world)
    try:
        _train(Ranks(rank, world), trees, out, resume, sgd)
    finally:
        dist.destroy_process_group()


def _run(world: int, trees: list[TrainTree], out: Path, resume: Path | None = None,
         sgd: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    out.mkdir(parents=True, exist_ok=True)
    if world == 1:
        _train(Ranks(), trees, out, resume, sgd)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_rank_main, args=(world, trees, out, (resume, sgd)), nprocs=world)
    result: dict[str, dict[str, torch.Tensor]] = torch.load(out / "result.pt")
    return result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    trees = _trees()
    base = tmp_path_factory.mktemp("ranks")
    out = {w: _run(w, trees, base / f"w{w}") for w in (1, 2)}
    out[1]["dir"] = str(base)  # type: ignore[assignment]
    return out


def test_batch_is_spread_and_partitioned() -> None:
    """The fixture's batch exercises what the equality must hold for."""
    trees = _trees()
    assert any(s.partition is not None for s in pack_trees(trees, MAX_TOKENS).streams)
    shares = assign_trees(trees, 2)
    assert all(shares) and sorted(t.tree_id for s in shares for t in s) == sorted(
        t.tree_id for t in trees)
    assert len({b.norm_group for t in trees for b in t.branches}) == 3


ADAM_LR = 1e-3


def _adam_close(name: str, got: torch.Tensor, want: torch.Tensor, steps: int = 1) -> bool:
    return adam_close(name, got, want, lr=ADAM_LR, steps=steps)


def test_two_ranks_equal_one_rank(runs: dict[int, dict[str, dict[str, torch.Tensor]]]) -> None:
    one, two = runs[1], runs[2]
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        assert _rel(two["grads"][name], g) <= 1e-6, (name, _rel(two["grads"][name], g))
    start = tiny_qwen2(0).state_dict()
    for name, p in one["params"].items():
        assert _adam_close(name, two["params"][name], p), name  # AdamW: the module's doc
        if "norm" not in name:  # the step moved every weight the batch reaches
            assert not torch.equal(p, start[name]), name
    m1, m2 = one["metrics"], two["metrics"]
    for key in ("loss", "token_kl", "seq_kl", "k3_kl", "ess", "masked_fraction",
                "is_clipped_fraction", "ppo_clip_fraction", "max_abs_logprob_diff",
                "grad_norm"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-9), key
    assert m2["tokens"] >= m1["tokens"]  # each rank merges its own trees' prefixes
    assert m1["path_tokens"] == m2["path_tokens"]


def test_two_ranks_equal_one_rank_after_an_sgd_step(tmp_path: Path) -> None:
    """The parameters after one optimizer step, 2 ranks against 1, to relative 1e-6 on
    every parameter, where the step is linear in the gradient (SGD)."""
    trees = _trees()
    one, two = (_run(w, trees, tmp_path / f"w{w}", sgd=True) for w in (1, 2))
    start = tiny_qwen2(0).state_dict()
    for name, p in one["params"].items():
        assert _rel(two["params"][name], p) <= 1e-6, (name, _rel(two["params"][name], p))
        if "norm" not in name:
            assert not torch.equal(p, start[name]), name


def test_sharded_checkpoint_resumes_at_another_world_size(
        runs: dict[int, dict[str, dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    """The 2-rank step's checkpoint (model + AdamW state, sharded) continues on 1 rank
    exactly as the 1-rank run's own checkpoint does, and vice versa."""
    trees = _trees()
    base = Path(runs[1]["dir"])
    from_two = _run(1, trees, tmp_path / "two-then-one", resume=base / "w2" / "dcp")
    from_one = _run(2, trees, tmp_path / "one-then-two", resume=base / "w1" / "dcp")
    for name, p in from_one["params"].items():
        assert _adam_close(name, from_two["params"][name], p, steps=2), name
        if "norm" not in name:  # a second step, from the first one's weights and moments
            assert not torch.equal(p, runs[1]["params"][name]), name


def test_activation_checkpointing_keeps_the_gradients() -> None:
    """Each layer recomputed in backward (partitioned trees included: their keys and
    values are captured in the first forward and receive gradients from later streams)
    gives the same gradients, and the parameter names are unchanged."""
    trees = _trees()
    grads, calls = [], []
    for checkpointed in (False, True):
        model = TargetLM(tiny_qwen2(0))
        if checkpointed:
            checkpoint_activations(model)
        names = [n for n, _ in model.named_parameters()]
        n_calls: list[int] = []  # the layer's first module: recomputation stops early
        model.lm.model.layers[0].input_layernorm.register_forward_hook(
            lambda *_, c=n_calls: c.append(1))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        TreeTrainer(model, opt, LossConfig(correction="tis"), max_tokens=MAX_TOKENS).step(trees)
        calls.append(len(n_calls))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        assert names == [n for n, _ in TargetLM(tiny_qwen2(0)).named_parameters()]
    assert calls[1] > calls[0]  # the layers did run again in backward
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[0].items():
        assert _rel(grads[1][n], g) <= 1e-6, n


@dataclasses.dataclass(frozen=True)
class _GroupOfOne(Ranks):
    """One rank that still goes through the process group (FSDP2 over a mesh of one,
    every collective the trainer makes across ranks)."""

    @property
    def distributed(self) -> bool:
        return True


def _nccl_one_rank(rank: int, out: Path) -> None:
    dist.init_process_group("nccl", init_method=f"file://{out}/pg", rank=rank, world_size=1)
    try:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        trees = _trees()
        res: dict[str, object] = {}
        for name, ranks in (("plain", Ranks()), ("group", _GroupOfOne(0, 1))):
            model: torch.nn.Module = TargetLM(tiny_qwen2(0)).to(dev)
            if ranks.distributed:
                model = shard_policy(model, ranks, dev)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            m = TreeTrainer(model, opt, LossConfig(correction="tis"), max_tokens=MAX_TOKENS,
                            ranks=ranks).step(trees)
            params = {k: v.detach().cpu() for k, v in full_state_dict(model, ranks).items()}
            res[name] = {"metrics": m.as_dict(), "params": params}
            if ranks.distributed:
                save_state(out / "dcp", model, opt)
                other = shard_policy(TargetLM(tiny_qwen2(5)).to(dev), ranks, dev)
                load_state(out / "dcp", other, torch.optim.SGD(other.parameters(), lr=1e-2))
                res["loaded"] = {k: v.detach().cpu()
                                 for k, v in full_state_dict(other, ranks).items()}
        torch.save(res, out / "nccl.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA device")
def test_nccl_one_rank_on_cuda_trains_like_no_group(tmp_path: Path) -> None:
    """FSDP2 and the trainer's collectives over NCCL (world size 1, one GPU) give the step
    a plain trainer gives (SGD: relative 1e-6), and the sharded checkpoint loads back."""
    mp.spawn(_nccl_one_rank, args=(tmp_path,), nprocs=1)
    res = torch.load(tmp_path / "nccl.pt")
    plain, group = res["plain"], res["group"]
    for key in ("loss", "token_kl", "max_abs_logprob_diff", "grad_norm", "tokens"):
        assert group["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-5,
                                                      abs=1e-9), key
    for name, p in plain["params"].items():
        assert _rel(group["params"][name], p) <= 1e-6, name
        assert torch.equal(res["loaded"][name], group["params"][name]), name
