"""`tidal.run.watch`: what a run started dies with it, even a process that left its
parent for init (as a local Ray instance's agents do when the run is SIGKILLed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# a "run": starts the watcher, then a grandchild that is orphaned to init when its
# parent (a shell) exits a second later, then waits to be killed
RUN = """
import subprocess, sys, time
from tidal.run.watch import watch_this_process
watch_this_process()
subprocess.Popen(["sh", "-c", "sleep 300 & echo $! > {pidfile}.tmp; sleep 1; "
                  "mv {pidfile}.tmp {pidfile}"]).wait()
time.sleep(300)
"""


def test_the_watcher_kills_what_is_left_of_a_sigkilled_run(tmp_path: Path) -> None:
    pidfile = tmp_path / "orphan.pid"
    run = subprocess.Popen([sys.executable, "-c", RUN.format(pidfile=pidfile)])
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline and run.poll() is None
        time.sleep(0.05)
    orphan = psutil.Process(int(pidfile.read_text()))
    assert orphan.pid not in {c.pid for c in psutil.Process(run.pid).children(recursive=True)}
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    gone, alive = psutil.wait_procs([orphan], timeout=10)
    assert gone and not alive, "the run's orphan outlived it"
