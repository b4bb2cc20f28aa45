"""Which training tasks the next RL batch rolls out: uniformly, or where the signal is.

A GRPO group teaches only when its rewards differ: a task that every session solves, or
that every session fails the same way, gives all its sessions advantage 0 (about half of
the groups of a uniform `tidal run`). `informative` sampling draws each batch's tasks
(distinct, without replacement) with weight

    w(task) = (groups with differing rewards + 1) / (groups trained + 2)

over the task's groups trained so far: 1/2 for a task not yet seen, towards 0 for one
always solved (or always failed alike), towards 1 for one whose sessions disagree. It
is the idea of DAPO's dynamic sampling (drop such groups after rolling them out) and of
online difficulty filtering, applied before the rollout so no compute is spent on them.

Deliberately simplified: evidence is per task (tasks that share a skill share nothing)
and never ages, although the policy that produced it changes; the +1/+2 prior keeps
every task drawable, so a solved task is still revisited now and then.

`balanced` sampling spreads each batch over the task families (a Harbor task's
`metadata.family`, a built-in set's family): the families in a shuffled order, one task
of each in turn, each drawn uniformly from its family's tasks. When a set of many skills
is trained a few task groups at a time, a uniform batch often holds two of one skill
and none of three others, and the step pulls the policy towards the skills it happens to
hold (measured on `shell-skills`: docs/agent.md).

`informative_families` pools the evidence by family (MT-GRPO's idea of weighting task
kinds by where learning is): each family gets a share of the batch's slots in proportion
to

    w(family) = (its groups with differing rewards + 1) / (its groups + 2)

(systematic sampling: within one slot of the share; equal weights give `balanced`), each
slot a task of the family not yet in the batch, uniformly. A skill every session solves, or
every session fails alike, gives groups of advantage 0 that only dilute the step (the
loss counts them); its weight falls towards 0 and the batch's groups go to the skills
whose sessions disagree. The +1/+2 prior keeps every family drawable. With many tasks
and few groups a step, per-task evidence (`informative`) is mostly unseen tasks at 1/2;
per-family evidence is what a step's groups share.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

TaskSignal = Mapping[str, tuple[int, int]]  # task id -> (groups trained, with differing rewards)
SAMPLINGS = ("uniform", "informative", "balanced", "informative_families")

T = TypeVar("T")


def has_signal(rewards: Sequence[float]) -> bool:
    """Do a group's rewards differ (so that some advantage is not zero)?"""
    return bool(rewards) and max(rewards) - min(rewards) > 1e-9


def record_groups(
    signal: TaskSignal, groups: Iterable[tuple[str, Sequence[float]]]
) -> dict[str, tuple[int, int]]:
    """`signal` with the trained groups (task id, the rewards of its sessions) added."""
    out = dict(signal)
    for task_id, rewards in groups:
        n, k = out.get(task_id, (0, 0))
        out[task_id] = (n + 1, k + has_signal(rewards))
    return out


def task_weight(task_id: str, signal: TaskSignal) -> float:
    n, k = signal.get(task_id, (0, 0))
    return (k + 1) / (n + 2)


def sample_batch(
    rng: random.Random, tasks: Sequence[T], ids: Sequence[str], k: int, *,
    sampling: str, signal: TaskSignal, families: Sequence[str] = (),
) -> list[T]:
    """k distinct tasks (all of them if fewer): uniformly (`rng.sample`), weighted by
    `task_weight` (`ids[i]` is the id of `tasks[i]`), or spread over `families`
    (`families[i]` is the family of `tasks[i]`; see `balanced`), or weighted by their
    family's evidence (`by_family_signal`)."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"task sampling must be one of {SAMPLINGS}, got {sampling!r}")
    k = min(k, len(tasks))
    if sampling == "uniform":
        return rng.sample(list(tasks), k)
    if sampling == "balanced":
        return [tasks[i] for i in balanced(rng, families, k)]
    if sampling == "informative_families":
        return [tasks[i] for i in by_family_signal(rng, ids, families, k, signal)]
    pool = list(range(len(tasks)))
    weights = [task_weight(ids[i], signal) for i in pool]
    chosen: list[T] = []
    for _ in range(k):
        j = rng.choices(range(len(pool)), weights=weights)[0]
        chosen.append(tasks[pool.pop(j)])
        weights.pop(j)
    return chosen


def balanced(rng: random.Random, families: Sequence[str], k: int) -> list[int]:
    """k distinct indices into `families`, one family at a time: the families in an
    order shuffled by `rng`, cycled while k is not reached, each turn drawing a task
    not yet drawn of that family uniformly. Each of F families gets floor(k / F) or one
    more (fewer only when it has no tasks left)."""
    if len(families) < k:
        raise ValueError(f"balanced sampling: {k} tasks asked of {len(families)} with families")
    by: dict[str, list[int]] = {}
    for i, fam in enumerate(families):
        by.setdefault(fam, []).append(i)
    order = sorted(by)
    rng.shuffle(order)
    chosen: list[int] = []
    while len(chosen) < k:
        for fam in order:
            left = by[fam]
            if left and len(chosen) < k:
                chosen.append(left.pop(rng.randrange(len(left))))
    return chosen


def family_weights(ids: Sequence[str], families: Sequence[str],
                   signal: TaskSignal) -> dict[str, float]:
    """Each family's (groups with differing rewards + 1) / (groups + 2), its tasks'
    evidence pooled (`ids[i]` is of family `families[i]`)."""
    totals: dict[str, tuple[int, int]] = {}
    for task_id, fam in zip(ids, families, strict=True):
        n, k = signal.get(task_id, (0, 0))
        tn, tk = totals.get(fam, (0, 0))
        totals[fam] = (tn + n, tk + k)
    return {fam: (k + 1) / (n + 2) for fam, (n, k) in totals.items()}


def by_family_signal(rng: random.Random, ids: Sequence[str], families: Sequence[str],
                     k: int, signal: TaskSignal) -> list[int]:
    """k distinct indices, spread over the families in proportion to `family_weights`:
    family f's share of the k slots is q_f = k * w_f / sum(w); it gets floor(q_f) of them
    and the slots left go one at a time to a family drawn with weight q_f - its slots so
    far (systematic sampling: the counts stay within one of the shares, so equal weights
    give `balanced`'s one task a family). A family's tasks are drawn uniformly without
    replacement; one that runs out leaves the rest to the others. The batch is shuffled."""
    if len(families) < k:
        raise ValueError(f"informative_families sampling: {k} tasks asked of "
                         f"{len(families)} with families")
    weight = family_weights(ids, families, signal)
    by: dict[str, list[int]] = {}
    for i, fam in enumerate(families):
        by.setdefault(fam, []).append(i)
    order = sorted(by)
    total = sum(weight[f] for f in order)
    share = {f: k * weight[f] / total for f in order}
    slots = {f: min(int(share[f]), len(by[f])) for f in order}
    while sum(slots.values()) < k:
        open_ = [f for f in order if slots[f] < len(by[f])]
        owed = [max(share[f] - slots[f], 0.0) for f in open_]
        if sum(owed) <= 0:
            owed = [1.0] * len(open_)
        slots[rng.choices(open_, weights=owed)[0]] += 1
    chosen = [i for f in order for i in rng.sample(by[f], slots[f])]
    rng.shuffle(chosen)
    return chosen
