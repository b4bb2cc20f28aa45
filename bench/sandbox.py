"""Sandbox benchmark: start-to-first-exec, exec round trip, snapshot and restore of a 10 MB
writable layer, pause/resume. p50 (and p90) over N runs each. Prints JSON.

Targets (issue 6): start < 100 ms, snapshot < 50 ms, restore < 100 ms.
Anchors: DeltaBox checkpoint 10.8 ms / rollback 1.9 ms; E2B pause ~4 s per GB of RAM.

Needs root, bubblewrap and overlayfs (see .ci/sandbox-deps.sh). Timings on a shared
machine are noisy: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tidal.sandbox import Sandbox, SandboxConfig

TARGETS_MS = {"start_to_first_exec": 100.0, "snapshot_10mb": 50.0, "restore_10mb": 100.0}
ANCHORS = {
    "DeltaBox (arXiv 2605.22781)": "checkpoint 10.8 ms, rollback 1.9 ms",
    "E2B": "pause ~4 s per GB of RAM, resume ~1 s",
}


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": round(statistics.median(s) * 1e3, 2),
        "p90_ms": round(s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3, 2),
        "min_ms": round(s[0] * 1e3, 2),
        "n": len(s),
    }


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fill_layer(sb: Sandbox, mb: int) -> None:
    """mb MiB of incompressible data in the writable layer: 1 MiB files plus 200 small ones."""
    r = sb.exec(f"mkdir -p /root/data && for i in $(seq {mb}); do "
                f"head -c 1048576 /dev/urandom > /root/data/f$i; done && mkdir -p /root/src && "
                "for i in $(seq 200); do echo line$i > /root/src/s$i.py; done")
    assert r.ok, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--layer-mb", type=int, default=10)
    ap.add_argument("--image", default=None, help="a custom image directory (default image)")
    args = ap.parse_args()
    n = args.runs
    work = Path(tempfile.mkdtemp(prefix="tidal-bench-sandbox-"))
    cfg = SandboxConfig(image=args.image, state_dir=str(work / "state"))
    out: dict[str, object] = {"runs": n, "layer_mb": args.layer_mb,
                              "loadavg_before": os.getloadavg()}

    with Sandbox(cfg):
        pass  # builds the default image once, outside the timings

    starts, firsts, closes = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = Sandbox(cfg).start()
        t1 = time.perf_counter()
        r = sb.exec(["true"])
        t2 = time.perf_counter()
        assert r.ok, r
        starts.append(t1 - t0)
        firsts.append(t2 - t0)
        closes.append(timed(sb.close))
    out["start"] = stats(starts)
    out["start_to_first_exec"] = stats(firsts)
    out["close"] = stats(closes)

    with Sandbox(cfg) as sb:
        for _ in range(3):
            sb.exec(["true"])
        out["exec_roundtrip_argv"] = stats([timed(lambda: sb.exec(["true"])) for _ in range(n)])
        out["exec_roundtrip_shell"] = stats([timed(lambda: sb.exec("echo hi")) for _ in range(n)])
        out["write_file_4k"] = stats([timed(lambda: sb.write_file("f.txt", "x" * 4096))
                                      for _ in range(n)])
        out["read_file_4k"] = stats([timed(lambda: sb.read_file("f.txt")) for _ in range(n)])

        fill_layer(sb, args.layer_mb)
        sb.exec("(while :; do sleep 0.05; done) >/dev/null 2>&1 &")  # a process to freeze
        pauses, resumes = [], []
        for _ in range(n):
            pauses.append(timed(sb.pause))
            resumes.append(timed(sb.resume))
        out["pause"] = stats(pauses)
        out["resume"] = stats(resumes)
        mem = getattr(sb.box, "memory_usage", lambda: None)()
        out["pause_sandbox_memory_mb"] = round(mem / 2**20, 1) if mem else None

        snaps = []
        for i in range(n):
            p = work / f"snap{i}.tar"
            snaps.append(timed(lambda p=p: sb.snapshot(p)))
        out["snapshot_10mb"] = stats(snaps)
        durable = []
        for i in range(min(n, 10)):
            p = work / f"dsnap{i}.tar"
            durable.append(timed(lambda p=p: sb.snapshot(p, durable=True)))
        out["snapshot_10mb_fsync"] = stats(durable)
        snap_path = work / "snap0.tar"
        out["snapshot_file_mb"] = round(snap_path.stat().st_size / 2**20, 2)

    restores, restore_first = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = Sandbox.restore(snap_path, strict=False)
        t1 = time.perf_counter()
        r = sb.exec(["true", "not-in-the-log"])  # runs live
        t2 = time.perf_counter()
        assert r.ok, r
        restores.append(t1 - t0)
        restore_first.append(t2 - t0)
        sb.close()
    out["restore_10mb"] = stats(restores)
    out["restore_10mb_to_first_exec"] = stats(restore_first)
    out["loadavg_after"] = os.getloadavg()

    out["targets_ms"] = TARGETS_MS
    out["meets_targets"] = {k: out[k]["p50_ms"] < v  # type: ignore[index]
                            for k, v in TARGETS_MS.items()}
    out["anchors"] = ANCHORS
    for p in work.glob("*.tar"):
        p.unlink()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
