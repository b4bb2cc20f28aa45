"""`tidal.run.stop` alone, in real processes: the watchdog ends a stop whose unwinding hangs,
even when nobody reads the run's stderr any more (its parent died: a closed pipe)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import psutil

STUCK = textwrap.dedent("""
    import subprocess, time
    from tidal.run.stop import RunStopped, stop_on_signals
    child = subprocess.Popen(["sleep", "300"])
    with stop_on_signals(1.0):
        try:
            print(child.pid, flush=True)  # the handler and the `except` are in place
            while True:
                time.sleep(0.05)
        except RunStopped:
            time.sleep(300)  # an unwinding that never ends
""")


def test_the_watchdog_kills_a_hung_stop_with_stderr_closed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    child = int(proc.stdout.readline())
    proc.stderr.close()  # the reader is gone: the watchdog's message cannot be written
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert code == 128 + signal.SIGTERM
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
