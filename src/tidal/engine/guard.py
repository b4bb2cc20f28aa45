"""`python -m tidal.engine.guard -- COMMAND...`: COMMAND ends when its starter dies.

A server process (vLLM's) outlives a `tidal run` killed with SIGKILL: nothing in the
run gets to stop it, and each holds gigabytes. The guard runs COMMAND as its child, in
its own process group (start the guard with `start_new_session=True`, as
`tidal.engine.servers` does, so that COMMAND's own children share it), and watches
its parent: once the parent is gone it sends the group SIGTERM, then SIGKILL after
`GRACE_S`, and exits. SIGTERM to the guard is passed to COMMAND. The guard exits with
COMMAND's exit code.

Watching the parent's pid, rather than PR_SET_PDEATHSIG on COMMAND, because the death
signal fires when the *thread* that started the process ends, and servers are restarted
from worker threads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from types import FrameType

POLL_S = 0.25
GRACE_S = 5.0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python -m tidal.engine.guard -- COMMAND [ARGS...]\n")
        return 2
    parent = os.getppid()
    child = subprocess.Popen(argv)

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while child.poll() is None:
        if os.getppid() != parent:  # the starter died (SIGKILL included)
            _end_group(child)
            break
        time.sleep(POLL_S)
    return child.wait()


def _end_group(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the guard's process group (COMMAND and its children), SIGKILL to what
    is left after GRACE_S; the guard itself ignores both until then."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)  # the guard too: nothing of the group is left


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
