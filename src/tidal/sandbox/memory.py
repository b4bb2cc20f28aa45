"""Process-memory snapshots: where CRIU would come in, and why it does not here.

A snapshot always carries the writable layer and the command log; restoring replays
the log, so every command's effect on files happens exactly once and every earlier
observation is returned unchanged. What it does not carry is the state of processes
still running (a server started in the background, a REPL's variables): that needs a
checkpoint of process memory, which on Linux means CRIU.

CRIU 3.17 from Debian 12 fails on this kernel (`criu check`: "vdso: Unexpected rt vDSO
area bounds", kerndat initialization fails), so `criu_status()` reports it unusable and
a snapshot asked for memory falls back, loudly, to layer + log. The probe runs
`criu check` once per process; tidal does not yet drive CRIU even where the check
passes (a dump of a bubblewrap sandbox needs its external mounts and namespaces
described to CRIU, and nothing here can test that), so memory snapshots are reported as
unavailable there too, with the reason.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess


@functools.lru_cache(maxsize=1)
def criu_status() -> tuple[bool, str]:
    """(usable, reason). Never raises."""
    exe = shutil.which("criu")
    if exe is None:
        return False, "criu is not installed"
    try:
        out = subprocess.run([exe, "check"], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"`criu check` could not run: {e}"
    if out.returncode != 0:
        errors = [re.sub(r"^Error \([^)]*\):\s*", "", ln.strip())
                  for ln in (out.stderr + out.stdout).splitlines() if ln.startswith("Error")]
        errors = [e for e in errors if not e.startswith("exited, status")]
        why = "; ".join(errors[:2]) or (out.stderr.strip().splitlines() or ["failed"])[-1]
        return False, f"`criu check` fails on this kernel: {why}"
    return False, ("criu check passes, but tidal does not drive CRIU dumps of bubblewrap "
                   "sandboxes yet")
