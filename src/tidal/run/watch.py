"""`python -m tidal.run.watch`: nothing a run started outlives it, SIGKILL included.

Under SIGKILL the run itself does nothing more, and not everything it starts ends by
itself: a local Ray instance (`ray.init()`, for trainer ranks on Ray actors or the Ray
scheduler backend) leaves its dashboard and runtime-env agents running, parented to
init once the run is gone. `tidal run` therefore starts this watcher first
(`watch_this_process`): a child of the run in a session of its own that, every `POLL_S`,
notes every process in the run's tree (pid and start time, so a reused pid is never
mistaken for one of them). When the run is gone, by any exit, it SIGKILLs every noted
process still alive, and what each has started since, then exits. After a clean exit
there is nothing left to kill; after a SIGKILL, what the run had started ends within
about a second.

What it cannot see: a process that leaves the tree (double fork) within `POLL_S` of its
start. The per-part guarantees stay: sandboxes die with their parent (bubblewrap's
`--die-with-parent`), trainer ranks by PR_SET_PDEATHSIG, vLLM servers under
`tidal.engine.guard`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil

POLL_S = 0.5


def watch_this_process() -> subprocess.Popen[bytes]:
    """Start the watcher for this process (see the module doc)."""
    return subprocess.Popen([sys.executable, "-m", "tidal.run.watch", str(os.getpid())],
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _noted(run: psutil.Process, me: int) -> dict[int, float]:
    out = {}
    with contextlib.suppress(psutil.Error):
        for c in run.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if c.pid != me:
                    out[c.pid] = c.create_time()
    return out


def _still_ours(noted: dict[int, float]) -> list[psutil.Process]:
    procs: dict[int, psutil.Process] = {}
    for pid, started in noted.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == started:
                procs[pid] = p
                for c in p.children(recursive=True):
                    procs[c.pid] = c
    return list(procs.values())


def watch(run_pid: int) -> int:
    """Note `run_pid`'s tree until it exits; then kill what is left of it. Returns how
    many processes were killed."""
    me = os.getpid()
    try:
        run = psutil.Process(run_pid)
    except psutil.NoSuchProcess:
        return 0
    noted: dict[int, float] = {}
    while os.getppid() == run_pid:
        alive = set(psutil.pids())
        noted = {p: t for p, t in noted.items() if p in alive} | _noted(run, me)
        time.sleep(POLL_S)
    left = _still_ours(noted)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=5.0)
    return len(left)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        sys.stderr.write("usage: python -m tidal.run.watch PID (the run, this one's parent)\n")
        return 2
    killed = watch(int(argv[0]))
    if killed:
        sys.stderr.write(f"tidal.run.watch: the run {argv[0]} is gone; killed {killed} "
                         "process(es) it had started\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
