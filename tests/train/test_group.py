"""The trainer group: ranks as Ray actors in a placement group (one local Ray node here),
equal to one rank; a rank killed is named by the next operation, which fails cleanly."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from tests.train.conftest import adam_close  # noqa: E402
from tests.train.synthetic import random_tree  # noqa: E402
from tidal.engine.tiny import ensure_tiny  # noqa: E402
from tidal.train.group import TrainerGroup, TrainerRankError, TrainerSpec  # noqa: E402
from tidal.train.loss import LossConfig  # noqa: E402
from tidal.tree.types import TrainTree  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    tmp = tempfile.mkdtemp(prefix="tray", dir="/tmp")  # short: Ray's socket paths
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
    yield
    ray.shutdown()


def _trees() -> list[TrainTree]:
    rng = np.random.default_rng(0)
    return [random_tree(rng, f"t{i}", n_segments=5, vocab=200, max_len=12) for i in range(4)]


def _spec(world: int) -> TrainerSpec:
    return TrainerSpec(weights_dir=str(ensure_tiny(seed=0)), device="cpu", lr=1e-3,
                       loss=LossConfig(), max_tokens=64, world_size=world, threads=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def test_ray_ranks_train_as_one_rank_and_a_killed_actor_is_named() -> None:
    trees = _trees()
    one = TrainerGroup(_spec(1)).start()
    m1 = one.step(trees)
    sd1 = {k: v.clone() for k, v in one.state_dict().items()}
    group = TrainerGroup(_spec(2), launch="ray").start()
    try:
        assert ray.available_resources().get("CPU", 0) <= 1  # rank 1 holds its bundle
        m2 = group.step(trees)
        assert m2.tokens > 0 and m2.loss == pytest.approx(m1.loss, rel=1e-5)
        sd2 = group.state_dict()
        assert sd2.keys() == sd1.keys()
        for k, v in sd1.items():  # AdamW's first step (tests/train/conftest.py)
            assert adam_close(k, sd2[k], v, lr=1e-3), k
        assert group.metrics()["world_size"] == 2
        ray.kill(group.workers[0].handle)
        with pytest.raises(TrainerRankError, match=r"trainer rank 1 .*(before|during) step"):
            for _ in range(50):  # the actor's death reaches the driver within moments
                group.step(trees)
    finally:
        group.close()


def test_process_ranks_start_from_the_checkpoint_exactly() -> None:
    """Ranks built on the meta device and filled from rank 0's copy (each allocating its
    shards only) hold exactly the checkpoint's weights, buffers included (the rotary
    frequencies decide every logit: a step's loss equals one rank's)."""
    from safetensors.torch import load_file

    base = load_file(ensure_tiny(seed=0) / "model.safetensors")
    trees = _trees()
    group = TrainerGroup(_spec(2)).start()
    try:
        sd = group.state_dict()
        assert sd.keys() >= base.keys()
        for k, v in base.items():
            assert torch.equal(sd[k], v), k
        m2 = group.step(trees)
    finally:
        group.close()
    m1 = TrainerGroup(_spec(1)).start().step(trees)
    assert m2.loss == pytest.approx(m1.loss, rel=1e-6)
    assert m2.token_kl == pytest.approx(m1.token_kl, rel=1e-6)
