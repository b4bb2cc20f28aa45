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
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tidal.agent.environment import Environments
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="swe-mini", help="a directory of tasks, or swe-mini")
    ap.add_argument("--n", type=int, default=3, help="tasks to measure (the first n)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--image", action="append", default=[], help="REF=DIR (repeatable)")
    args = ap.parse_args()
    images = dict(pair.split("=", 1) for pair in args.image)
    tasks = load_tasks(args.tasks)[: args.n]
    with tempfile.TemporaryDirectory(prefix="tidal-bench-envs-") as d:
        rows = [bench_task(t, images, Path(d) / "envs", args.repeat) for t in tasks]
    medians = [r["overhead_total"]["median_ms"] for r in rows]
    print(json.dumps({
        "tasks": rows,
        "overhead_total_median_ms": round(statistics.median(medians), 2),
        "target_ms": 200.0,
        "meets_target": max(medians) < 200.0,
    }, indent=1))


if __name__ == "__main__":
    main()
