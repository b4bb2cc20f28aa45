"""Task sampling for RL batches: uniform, or weighted by the chance of a learning signal."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest

from tidal.run.checkpoint import RunState, load_state
from tidal.schedule.curriculum import (
    family_weights,
    has_signal,
    record_groups,
    sample_batch,
    task_weight,
)


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


def test_family_weights_pool_the_tasks_evidence() -> None:
    ids = ["a0", "a1", "b0", "b1", "c0"]
    fams = ["a", "a", "b", "b", "c"]
    signal = {"a0": (3, 3), "a1": (1, 1), "b0": (4, 0), "b1": (2, 0), "zz": (9, 9)}
    assert family_weights(ids, fams, signal) == pytest.approx(
        {"a": 5 / 6, "b": 1 / 8, "c": 1 / 2})  # pooled; unseen c at the prior; zz not ours


def test_informative_families_favour_skills_still_learning() -> None:
    fams = ["solved"] * 10 + ["learning"] * 10 + ["hopeless"] * 10 + ["new"] * 2
    tasks = [f"{f}{i}" for i, f in enumerate(fams)]
    signal = {**{f"solved{i}": (2, 0) for i in range(5)},        # 10 groups, none differed
              **{f"learning{i}": (2, 2) for i in range(10, 15)},  # 10 groups, all differed
              **{f"hopeless{i}": (1, 0) for i in range(20, 30)}}  # 10 groups, none differed
    rng = random.Random(0)
    counts: Counter[str] = Counter()
    for _ in range(1000):
        batch = sample_batch(rng, tasks, tasks, 6, sampling="informative_families",
                             signal=signal, families=fams)
        assert len(set(batch)) == 6
        counts.update(t.rstrip("0123456789") for t in batch)
    # weights 11/12 (learning), 1/2 (new, 2 tasks), 1/12 (solved, hopeless): still drawn
    assert counts["learning"] > 4 * counts["solved"] and counts["solved"] > 0
    assert counts["hopeless"] > 0 and counts["new"] > counts["solved"]
    assert abs(counts["solved"] - counts["hopeless"]) < 0.4 * counts["solved"]
    # each batch within one slot of the families' shares (systematic sampling)
    for _ in range(200):
        per = Counter(t.rstrip("0123456789") for t in sample_batch(
            rng, tasks, tasks, 6, sampling="informative_families", signal=signal,
            families=fams))
        assert per["learning"] in (3, 4) and per["new"] in (1, 2)  # shares 3.47, 1.89
    # without evidence: one task of each family, as balanced
    for _ in range(20):
        batch = sample_batch(rng, tasks, tasks, 4, sampling="informative_families",
                             signal={}, families=fams)
        assert sorted(t.rstrip("0123456789") for t in batch) == [
            "hopeless", "learning", "new", "solved"]
    # a family that runs out leaves the draw to the others
    batch = sample_batch(rng, tasks, tasks, 32, sampling="informative_families", signal={},
                         families=fams)
    assert sorted(batch) == sorted(tasks)
    with pytest.raises(ValueError, match="families"):
        sample_batch(rng, tasks, tasks, 3, sampling="informative_families", signal={})


def test_bad_sampling_name() -> None:
    with pytest.raises(ValueError, match="task sampling"):
        sample_batch(random.Random(0), ["a"], ["a"], 1, sampling="hardest", signal={})


def test_task_signal_survives_a_checkpoint(tmp_path: Path) -> None:
    st = RunState(task_signal={"a": (3, 1)})
    (tmp_path / "state.json").write_text(json.dumps(asdict(st)))
    assert load_state(tmp_path).task_signal == {"a": (3, 1)}
