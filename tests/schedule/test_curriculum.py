"""Task sampling for RL batches: uniform, or weighted by the chance of a learning signal."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest

from tidal.run.checkpoint import RunState, load_state
from tidal.schedule.curriculum import has_signal, record_groups, sample_batch, task_weight


def test_signal_is_a_difference_of_rewards() -> None:
    assert has_signal([1.0, 0.0]) and has_signal([1 / 3, 2 / 3, 2 / 3])
    assert not has_signal([1.0] * 4) and not has_signal([1 / 3] * 4) and not has_signal([])


def test_record_and_weight() -> None:
    s = record_groups({}, [("a", [1, 1, 1, 1]), ("b", [0, 1, 0, 0]), ("a", [1, 1, 1, 1])])
    assert s == {"a": (2, 0), "b": (1, 1)}
    assert task_weight("a", s) == pytest.approx(1 / 4)
    assert task_weight("b", s) == pytest.approx(2 / 3)
    assert task_weight("unseen", s) == pytest.approx(1 / 2)
    assert record_groups(s, []) == s and s == {"a": (2, 0), "b": (1, 1)}  # not mutated


def test_uniform_is_plain_random_sample() -> None:
    tasks = [f"t{i}" for i in range(10)]
    got = sample_batch(random.Random(3), tasks, tasks, 4, sampling="uniform", signal={})
    assert got == random.Random(3).sample(tasks, 4)


def test_informative_draws_distinct_tasks_favouring_signal() -> None:
    tasks = [f"t{i}" for i in range(6)]
    signal = {"t0": (10, 10), "t1": (10, 0), "t2": (10, 0), "t3": (10, 0)}
    rng = random.Random(0)
    counts: Counter[str] = Counter()
    for _ in range(2000):
        batch = sample_batch(rng, tasks, tasks, 3, sampling="informative", signal=signal)
        assert len(set(batch)) == 3
        counts.update(batch)
    # t0 (always informative) > unseen t4, t5 > t1..t3 (never), which are still drawn
    assert counts["t0"] > counts["t4"] > counts["t1"] > 0
    assert counts["t0"] > counts["t5"] > counts["t2"] > 0
    assert sample_batch(rng, tasks[:2], tasks[:2], 5, sampling="informative", signal={}) in (
        ["t0", "t1"], ["t1", "t0"])  # k above the pool: all of it


def test_balanced_spreads_each_batch_over_the_families() -> None:
    fams = ["a"] * 10 + ["b"] * 10 + ["c"] * 3 + ["d"] * 1
    tasks = [f"{f}{i}" for i, f in enumerate(fams)]
    rng = random.Random(0)
    firsts: Counter[str] = Counter()
    for _ in range(300):
        batch = sample_batch(rng, tasks, tasks, 6, sampling="balanced", signal={},
                             families=fams)
        assert len(set(batch)) == 6
        per = Counter(t[0] for t in batch)
        assert set(per) == {"a", "b", "c", "d"} and max(per.values()) - min(per.values()) <= 1
        firsts[batch[0][0]] += 1
    assert set(firsts) == {"a", "b", "c", "d"}  # the families' order is shuffled
    # a family runs out: the others fill the batch
    batch = sample_batch(rng, tasks, tasks, 12, sampling="balanced", signal={}, families=fams)
    per = Counter(t[0] for t in batch)
    assert per["d"] == 1 and per["c"] == 3 and per["a"] + per["b"] == 8 and len(set(batch)) == 12
    # all of them when k is above the pool
    assert sorted(sample_batch(rng, tasks, tasks, 99, sampling="balanced", signal={},
                               families=fams)) == sorted(tasks)
    with pytest.raises(ValueError, match="families"):
        sample_batch(rng, tasks, tasks, 3, sampling="balanced", signal={})


def test_bad_sampling_name() -> None:
    with pytest.raises(ValueError, match="task sampling"):
        sample_batch(random.Random(0), ["a"], ["a"], 1, sampling="hardest", signal={})


def test_task_signal_survives_a_checkpoint(tmp_path: Path) -> None:
    st = RunState(task_signal={"a": (3, 1)})
    (tmp_path / "state.json").write_text(json.dumps(asdict(st)))
    assert load_state(tmp_path).task_signal == {"a": (3, 1)}
