"""The trainer's linear layers in bf16 (train/precision.py): each linear multiplies as
the engine's bf16 linear does and answers in fp32, the gradients reach the fp32
parameters in fp32, and outside the context nothing changes, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from tests.train.conftest import adam_close
from tests.train.synthetic import random_tree
from tidal.engine.fused import bf16_matmuls
from tidal.engine.tiny import ensure_tiny
from tidal.train.group import TrainerGroup, TrainerSpec
from tidal.train.loss import LossConfig
from tidal.train.precision import matmuls, resolve_matmul_dtype


def test_a_linear_multiplies_in_bf16_and_answers_in_fp32() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40)
    x = torch.randn(3, 24, requires_grad=True)
    plain = lin(x).detach()
    with matmuls(torch.bfloat16):
        y = lin(x)
    w, b = lin.weight.detach(), lin.bias.detach()
    assert y.dtype == torch.float32
    assert torch.equal(y.detach(), F.linear(x.detach().bfloat16(), w.bfloat16(),
                                            b.bfloat16()).float())
    assert not torch.equal(y.detach(), plain)  # it did round
    y.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    assert lin.weight.dtype == lin.weight.grad.dtype == x.grad.dtype == torch.float32
    # the backward's products in bf16 too: a bf16 rounding from fp32's, not fp32's
    ones = torch.ones(3, 40)
    assert torch.allclose(x.grad, ones @ w, rtol=2e-2, atol=2e-2)
    assert not torch.equal(x.grad, ones @ w)
    assert torch.allclose(lin.weight.grad, ones.T @ x.detach(), rtol=2e-2, atol=2e-2)
    with matmuls(torch.float32):  # fp32: as it was
        assert torch.equal(lin(x).detach(), plain)
    assert torch.equal(lin(x).detach(), plain)  # and after the context


def test_auto_is_bf16_only_where_the_cpu_multiplies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_matmul_dtype("float32", cpu) == torch.float32
    want = torch.bfloat16 if bf16_matmuls() else torch.float32
    assert resolve_matmul_dtype("auto", cpu) == want
    # a CPU without oneDNN's bf16 matmuls (AVX2 alone): auto falls back, bfloat16 is refused
    monkeypatch.setattr("tidal.engine.fused.bf16_matmuls", lambda: False)
    assert resolve_matmul_dtype("auto", cpu) == torch.float32
    with pytest.raises(ValueError, match=r'train.matmul_dtype = "bfloat16": cpu multiplies'):
        resolve_matmul_dtype("bfloat16", cpu)


def test_a_trainer_step_in_bf16_is_a_rounding_of_fp32s() -> None:
    """The same step on the tiny model, fp32 and `train.matmul_dtype = "auto"`: where this
    CPU multiplies bf16, the loss and the updated weights are a bf16 rounding away from
    fp32's; elsewhere auto is fp32, bit for bit."""
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, f"t{i}", n_segments=5, vocab=200, max_len=12) for i in range(4)]
    runs = {}
    for dtype in ("float32", "auto"):
        spec = TrainerSpec(weights_dir=str(ensure_tiny(seed=0)), device="cpu", lr=1e-3,
                           loss=LossConfig(), max_tokens=64, matmul_dtype=dtype)
        group = TrainerGroup(spec).start()
        m = group.step(trees)
        runs[dtype] = (m, group.state_dict(), group.metrics()["train_matmul_dtype"])
    (m32, sd32, d32), (m16, sd16, d16) = runs["float32"], runs["auto"]
    assert d32 == "float32" and d16 == ("bfloat16" if bf16_matmuls() else "float32")
    assert m16.tokens == m32.tokens > 0
    diff = max(float((sd16[k] - sd32[k]).abs().max()) for k in sd32)
    if d16 == "float32":
        assert m16.loss == m32.loss and diff == 0.0
        return
    assert m16.loss == pytest.approx(m32.loss, rel=5e-2, abs=1e-3)
    assert m16.loss != m32.loss
    assert 0.0 < diff < 1e-2  # Adam moves each weight by ~lr: the rounding moves less


def test_recomputed_activations_multiply_in_bf16_too() -> None:
    """With activation checkpointing the backward recomputes each layer's forward: in the
    step's dtype too, so the update is the one without checkpointing, bit for bit."""
    rng = np.random.default_rng(1)
    trees = [random_tree(rng, f"t{i}", n_segments=5, vocab=200, max_len=12) for i in range(4)]
    states = []
    for checkpointing in (False, True):
        spec = TrainerSpec(weights_dir=str(ensure_tiny(seed=0)), device="cpu", lr=1e-3,
                           loss=LossConfig(), max_tokens=64, matmul_dtype="auto",
                           activation_checkpointing=checkpointing)
        group = TrainerGroup(spec).start()
        group.step(trees)
        states.append(group.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@pytest.mark.slow
def test_two_process_ranks_in_bf16_train_as_one_rank() -> None:
    """FSDP2 over two process ranks, `train.matmul_dtype = "auto"`: the spec reaches the
    other rank, which multiplies as rank 0 does, and the step is one bf16 rank's."""
    rng = np.random.default_rng(2)
    trees = [random_tree(rng, f"t{i}", n_segments=5, vocab=200, max_len=12) for i in range(4)]

    def spec(world: int) -> TrainerSpec:
        return TrainerSpec(weights_dir=str(ensure_tiny(seed=0)), device="cpu", lr=1e-3,
                           loss=LossConfig(), max_tokens=64, world_size=world, threads=1,
                           matmul_dtype="auto")

    one = TrainerGroup(spec(1)).start()
    m1 = one.step(trees)
    sd1 = one.state_dict()
    two = TrainerGroup(spec(2)).start()
    try:
        m2 = two.step(trees)
        sd2 = two.state_dict()
        assert two.metrics()["train_matmul_dtype"] == one.metrics()["train_matmul_dtype"]
    finally:
        two.close()
    assert m2.tokens == m1.tokens
    assert m2.loss == pytest.approx(m1.loss, rel=1e-5, abs=1e-7)
    # a bf16 gradient near 0 (a bias's) is rounding noise, and Adam's first step is
    # lr x its sign: the two sides differ by at most their two steps there
    assert all(float((sd2[k] - v).abs().max()) <= 2e-3 for k, v in sd1.items())
    close = [k for k, v in sd1.items() if adam_close(k, sd2[k], v, lr=1e-3)]
    assert len(close) >= len(sd1) - 4, set(sd1) - set(close)
