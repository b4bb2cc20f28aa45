"""`tidal.engine.guard`: a server started under it ends when its starter is killed with
SIGKILL (nothing of the starter runs then), its children included; SIGTERM to the guard
reaches the server, and the guard exits with the server's code. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

# the "server": a process with a child of its own, both sleeping; prints both pids
SERVER = ("import subprocess, sys, time; c = subprocess.Popen(['sleep', '300']); "
          "print(c.pid, flush=True); time.sleep(300)")
# the "run": starts the guard as tidal.engine.servers does, prints its pid, waits
STARTER = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-m', "
           "'tidal.engine.guard', '--', sys.executable, '-c', sys.argv[1]], "
           "start_new_session=True); print(p.pid, flush=True); p.wait()")


def gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_the_server_dies_with_a_sigkilled_starter() -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER, SERVER], stdout=subprocess.PIPE,
                               text=True)
    assert starter.stdout is not None
    guard = int(starter.stdout.readline())
    grandchild = int(starter.stdout.readline())
    tree = [guard, *(c.pid for c in psutil.Process(guard).children(recursive=True))]
    assert grandchild in tree and len(tree) == 3  # guard, server, the server's child
    starter.kill()  # SIGKILL: the starter runs nothing more
    starter.wait()
    assert gone(tree, within_s=10), [p for p in tree if psutil.pid_exists(p)]


def test_sigterm_reaches_the_server_and_its_code_comes_back() -> None:
    p = subprocess.Popen([sys.executable, "-m", "tidal.engine.guard", "--", sys.executable,
                          "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                          "lambda *a: sys.exit(7)); print('up', flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=30) == 7


def test_no_command_is_a_usage_error() -> None:
    r = subprocess.run([sys.executable, "-m", "tidal.engine.guard", "--"], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 2 and "usage" in r.stderr
