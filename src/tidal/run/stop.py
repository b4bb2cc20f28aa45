"""Clean stops: SIGTERM and SIGINT end `tidal run` in order, within a grace period.

What Slurm and Kubernetes send before they kill is SIGTERM; a user's Ctrl-C is SIGINT.
Under `stop_on_signals(grace_s)` the first of them:
1. raises `RunStopped` in the main thread, at once, or when the section it is in ends
   (`deferred()`: a checkpoint being written, the engine's weights being replaced), so
   what the last finished step trained is checkpointed and nothing is half written;
2. starts a watchdog: if the process has not ended `grace_s` seconds after the signal,
   it kills every process the run started (its process tree) and exits with 128+signal.

The run then unwinds as after any failure (`tidal.run.loop.run`): its live episodes are
saved where they are (`LiveEpisodes.stop_all`: their sandboxes snapshotted, to resume
with `--resume`), and everything it started is stopped. `tidal run` exits with 128+signal
(143 for SIGTERM, 130 for SIGINT). Further signals while stopping are ignored: the
watchdog bounds the stop.

Under SIGKILL nothing runs, so what the run starts must end without it: sandboxes
(bubblewrap's --die-with-parent), trainer ranks (PR_SET_PDEATHSIG) and vLLM servers
(`tidal.engine.guard`) end when they lose their parent, and `tidal.run.watch`, started
first, kills whatever else of the run's process tree is left (a local Ray instance's
agents).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import psutil

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(BaseException):
    """The run was asked to stop by `signum`; `exit_code` is what `tidal run` exits with."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.installed = False
        self.depth = 0  # deferred() sections entered
        self.pending: int | None = None  # a signal that arrived inside one
        self.stopping = False


_state = _State()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A section that a stop does not cut: a signal that arrives inside raises
    `RunStopped` when the section ends. Without `stop_on_signals` it does nothing."""
    with _state.lock:
        _state.depth += 1
    try:
        yield
    finally:
        with _state.lock:
            _state.depth -= 1
            signum = _state.pending if _state.depth == 0 else None
            if signum is not None:
                _state.pending = None
        if signum is not None:
            raise RunStopped(signum)


def kill_tree(pid: int, *, timeout_s: float = 5.0) -> None:
    """SIGKILL every descendant of `pid`; waits for them up to `timeout_s`."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for c in children:
        with contextlib.suppress(psutil.Error):
            c.kill()
    psutil.wait_procs(children, timeout=timeout_s)


def _watchdog(grace_s: float, signum: int) -> None:
    time.sleep(grace_s)
    # a closed stderr (its reader gone: a pipe to a parent that died) must not stop the kill
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"tidal run: not stopped {grace_s:g} s after "
                         f"{signal.Signals(signum).name}: killing what it started\n")
        sys.stderr.flush()
    kill_tree(os.getpid())
    os._exit(128 + signum)


@contextlib.contextmanager
def stop_on_signals(grace_s: float) -> Iterator[None]:
    """SIGTERM and SIGINT stop the run in order (module doc); only from the main thread
    (elsewhere, and when already installed, it changes nothing)."""
    if threading.current_thread() is not threading.main_thread() or _state.installed:
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        with _state.lock:
            if _state.stopping:
                return
            _state.stopping = True
            threading.Thread(target=_watchdog, args=(grace_s, signum), name="tidal-stop",
                             daemon=True).start()
            if _state.depth:
                _state.pending = signum
                return
        raise RunStopped(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    _state.installed = True
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _state.installed = False
