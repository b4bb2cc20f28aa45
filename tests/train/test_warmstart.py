"""The warm start's own checks (its training runs in tests/run/test_loop.py and
tests/engine/test_smollm2.py)."""

from __future__ import annotations

import pytest
import torch

from tidal.train.distributed import Ranks
from tidal.train.warmstart import Example, warm_start

EXAMPLES = [Example((1, 2, 3), (False, True, True)), Example((4, 5), (False, True))]


def test_a_batch_index_outside_the_demonstrations_is_named() -> None:
    with pytest.raises(ValueError, match="index 2 is outside the 2 demonstrations"):
        warm_start(torch.nn.Linear(1, 1), EXAMPLES, batches=[(0, 1), (1, 2)], lr=1e-3, pad_id=0)


def test_a_batch_smaller_than_the_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="batch of 1 demonstrations cannot give each of 2"):
        warm_start(torch.nn.Linear(1, 1), EXAMPLES, batches=[(0, 1), (1,)], lr=1e-3,
                   pad_id=0, ranks=Ranks(rank=0, world=2))
