"""Per-episode overhead of a task in the Harbor format: what tidal adds around the harness.

For each task: the environment built cold (an empty cache), then found in the cache by a
fresh builder (the content hash over the Dockerfile and the context it copies: what a new
run or process pays), then the sandbox started on it (and closed), the task prepared,
and its test.sh grader run on the untouched environment (one file written, as an agent's
answer). The grade is timed three ways, alternating: `pristine` (what ships: the agent's
processes killed, a fresh sandbox from the task's image with the workdir carried over),
`shared` (processes killed, the same sandbox) and `in_place` (the grade before issue 51).
Each phase is timed `--repeat` times; medians and p90s are printed as JSON. Target:
cached build + start + grade (pristine) under 200 ms beyond the harness's own time.

    .venv/bin/python bench/workload.py                 # swe-mini's first tasks
    .venv/bin/python bench/workload.py --tasks DIR --image ubuntu:24.04=default

With `--container REF=IMAGE` (repeatable; e.g. `python:3.11-slim-bookworm=localhost/tidal-
base:bookworm` for the built-in sets, the image .ci/podman.sh builds), the same tasks also
on the container runtime (`tidal.agent.containers`, a Docker-API engine), in the same
run: the image built cold by the engine and found by a fresh builder, the container
started, prepared and removed, one `exec` of `true`, a snapshot (a commit and the command
log), a restore from it (a container from the committed image, the log replayed: the
`exec` answered from it), and the grade (pristine: a fresh container carrying the
workdir); bubblewrap's exec, snapshot and restore are timed beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tidal.agent.containers import (
    ContainerEnvironments,
    ContainerRuntime,
    connect,
    container_runtime,
    remove_snapshot,
)
from tidal.agent.environment import Environments, SandboxRuntimes
from tidal.agent.harbor import load_tasks
from tidal.agent.sandboxed import sandboxed_runtime
from tidal.agent.tasks import Task, prepare
from tidal.sandbox import Limits, SandboxConfig


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": round(1000 * statistics.median(xs), 2),
            "p90_ms": round(1000 * xs[min(len(xs) - 1, int(0.9 * len(xs)))], 2),
            "min_ms": round(1000 * xs[0], 2)}


# how the verifier's environment is made (ToolRuntime.end_agent): "in_place" is the grade
# before issue 51 (the agent's sandbox as it was, its processes still running)
MODES = ("in_place", "shared", "pristine")


def bench_task(task: Task, images: dict[str, str], cache: Path, repeat: int) -> dict[str, Any]:
    base = SandboxConfig(limits=Limits(cpu_s=600.0, wall_s=600.0))
    t0 = time.perf_counter()
    cold = Environments(images, None, cache).sandbox_config(task, base)
    cold_s = time.perf_counter() - t0
    cached, start, rewards = [], [], []
    grade: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(repeat):
        t0 = time.perf_counter()
        config = Environments(images, None, cache).sandbox_config(task, base)  # a new process
        cached.append(time.perf_counter() - t0)
        assert config == cold
        for mode in MODES[i % 3:] + MODES[:i % 3]:  # each mode first in turn
            t0 = time.perf_counter()
            with sandboxed_runtime(config) as rt:
                prepare(task, rt)
                rt.write_file("tidal-bench-answer.txt", "what the agent left\n")
                t1 = time.perf_counter()
                if mode != "in_place":
                    rt.end_agent(None if mode == "shared" else task.verifier_carry or ())
                g = task.grader.grade(rt)
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            grade[mode].append(t2 - t1)
            if mode == "pristine":
                start.append((t1 - t0) + (t3 - t2))  # start + prepare + close
                rewards.append(g.reward)
    total = [a + b + c for a, b, c in zip(cached, start, grade["pristine"], strict=True)]
    return {
        "task": task.task_id, "build_cold_ms": round(1000 * cold_s, 1),
        "build_cached": _stats(cached), "sandbox_start_close": _stats(start),
        "grade": _stats(grade["pristine"]),
        "grade_by_verifier_env": {m: _stats(v) for m, v in grade.items()},
        "overhead_total": _stats(total), "untouched_reward": rewards[0],
    }


def bench_container(task: Task, images: dict[str, str], repeat: int,
                    tmp: Path) -> dict[str, Any]:
    """The container runtime's overheads on `task` (see the module docstring)."""
    client = connect()
    t0 = time.perf_counter()
    ContainerEnvironments(client, images).spec(task)
    cold_s = time.perf_counter() - t0
    cached, start, execs, snaps, restores, grades, rewards = [], [], [], [], [], [], []
    for i in range(repeat):
        t0 = time.perf_counter()
        spec = ContainerEnvironments(client, images).spec(task)  # a new process's builder
        cached.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with container_runtime(spec, client) as rt:
            prepare(task, rt)
            t1 = time.perf_counter()
            rt.exec("true", 30.0)
            t2 = time.perf_counter()
            snap = tmp / f"snap-{i}.json"
            rt.snapshot(snap)
            t3 = time.perf_counter()
            snaps.append(t3 - t2)
            with contextlib.closing(ContainerRuntime.restore(snap, client)) as back:
                assert back.exec("true", 30.0).replayed
            restores.append(time.perf_counter() - t3)
            t3 = time.perf_counter()
            rt.write_file("tidal-bench-answer.txt", "what the agent left\n")
            t4 = time.perf_counter()
            rt.end_agent(task.verifier_carry or ())
            g = task.grader.grade(rt)
            t5 = time.perf_counter()
        t6 = time.perf_counter()
        remove_snapshot(snap, client)
        start.append((t1 - t0) + (t6 - t5))
        execs.append(t2 - t1)
        grades.append(t5 - t4)
        rewards.append(g.reward)
    return {"build_cold_ms": round(1000 * cold_s, 1), "build_cached": _stats(cached),
            "start_close": _stats(start), "exec_true": _stats(execs),
            "snapshot": _stats(snaps), "restore": _stats(restores), "grade": _stats(grades),
            "overhead_total": _stats([a + b + c for a, b, c in zip(cached, start, grades,
                                                                     strict=True)]),
            "untouched_reward": rewards[0]}


def bench_bwrap_exec_snapshot(task: Task, images: dict[str, str], cache: Path, repeat: int,
                              tmp: Path) -> dict[str, Any]:
    """Bubblewrap's `exec` of `true`, snapshot and restore (the log replayed: the `exec`
    answered from it) on the same task, for the comparison."""
    runtimes = SandboxRuntimes(sandboxed_runtime, SandboxConfig(
        limits=Limits(cpu_s=600.0, wall_s=600.0)), Environments(images, None, cache))
    execs, snaps, restores = [], [], []
    with runtimes.runtime(task) as rt:
        prepare(task, rt)
        for i in range(repeat):
            t0 = time.perf_counter()
            rt.exec("true", 30.0)
            t1 = time.perf_counter()
            rt.snapshot(tmp / f"bwrap-snap-{i}")
            t2 = time.perf_counter()
            with runtimes.restored(task, tmp / f"bwrap-snap-{i}") as back:
                assert back.exec("true", 30.0).replayed
            execs.append(t1 - t0)
            snaps.append(t2 - t1)
            restores.append(time.perf_counter() - t2)
    return {"exec_true": _stats(execs), "snapshot": _stats(snaps), "restore": _stats(restores)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="swe-mini", help="a directory of tasks, or swe-mini")
    ap.add_argument("--n", type=int, default=3, help="tasks to measure (the first n)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--image", action="append", default=[], help="REF=DIR (repeatable)")
    ap.add_argument("--container", action="append", default=[],
                    help="REF=IMAGE: also on the container runtime, FROM REF mapped to the "
                         "engine's IMAGE (repeatable)")
    args = ap.parse_args()
    images = dict(pair.split("=", 1) for pair in args.image)
    engine_images = dict(pair.split("=", 1) for pair in args.container)
    tasks = load_tasks(args.tasks)[: args.n]
    with tempfile.TemporaryDirectory(prefix="tidal-bench-envs-") as d:
        rows = [bench_task(t, images, Path(d) / "envs", args.repeat) for t in tasks]
        if engine_images:
            for t, row in zip(tasks, rows, strict=True):
                row["bwrap_exec_snapshot"] = bench_bwrap_exec_snapshot(
                    t, images, Path(d) / "envs", args.repeat, Path(d))
                row["container"] = bench_container(t, engine_images, args.repeat, Path(d))
    medians = [r["overhead_total"]["median_ms"] for r in rows]
    print(json.dumps({
        "tasks": rows,
        "overhead_total_median_ms": round(statistics.median(medians), 2),
        "target_ms": 200.0,
        "meets_target": max(medians) < 200.0,
    }, indent=1))


if __name__ == "__main__":
    main()
