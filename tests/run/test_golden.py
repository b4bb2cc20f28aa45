"""Golden numbers of the RL main path: one small `tidal run` with rl.numerics =
"consistent" (a process of its own, as a user runs it) must reproduce, exactly, the
figures pinned in golden.json beside this file, taken at commit a07c393:

- per RL step: loss, grad_norm, reward_mean, trained tokens, max_abs_logprob_diff, and
  the sha256 of every call the step's sessions made (prompt token ids, output token ids,
  output logprobs' bytes), sessions ordered by seed key (the id without its random
  part), calls in each session's order; also the sessions' and calls' counts;
- the same call hash for the start and end evaluations, and their success and partial
  rates; the warm start's first and last loss;
- the sha256 of each file of the final checkpoint (the weights, the trainer state's
  shards and the model's config files), except state.json (it names sessions by their
  random ids) and torch.distributed.checkpoint's .metadata (a random save id).

Nothing else (timings, random ids, timestamps) is pinned. Three runs on one machine
gave the same bits, so floats are compared with ==. The numbers depend on the CPU's
kernels and on torch's version: CI's 2-core x86-64 machines come in more than one CPU
type (an AMD EPYC with AVX2 computes the warm start's first loss as 12.6196003, the type
of the first pin as 12.6196012, and the runs part from there). So golden.json holds one
pin per CPU type (`machine`: the CPU vendor and torch's kernel level, e.g. "AuthenticAMD
AVX2"; the first pin's type went unrecorded), each taken by running this test at
a07c393, and the run must reproduce one of them exactly. The run's processes are given
1 thread (OMP_NUM_THREADS), as on a `make test` worker of a 2-core machine, so that
`pytest tests/run/test_golden.py` alone and `make test` compute alike.

On a failure the message is the whole table, got against the pin of this machine's type
(or the nearest), differences marked. A change that is meant to change the numbers
regenerates them: `TIDAL_GOLDEN_UPDATE=1 .venv/bin/pytest tests/run/test_golden.py`
rewrites this machine type's pin in golden.json (then the test fails, saying so; review
the diff and commit it; the other types' pins must be regenerated on their machines, or
dropped). A new CPU type gets its pin the same way, from a checkout of a07c393 with this
file copied in, so that the pin says the redesigned path computes what the old one did.
The config is written out here, not taken from loop_runs.py, so that editing the other
tests' runs leaves these numbers alone. `TIDAL_GOLDEN_KEEP=DIR` runs into DIR (kept)
instead of tmp_path, for comparing a whole ledger and checkpoint with a reference run
(loop_runs.ledger_of, weights_of)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TypedDict

import numpy as np
import pytest

from tidal.ledger import LedgerStore
from tidal.run.config import dump_config, parse_config

GOLDEN = Path(__file__).with_name("golden.json")

# small_config(**REPRO) of loop_runs.py at a07c393, frozen here
CONFIG: dict[str, object] = {
    "tasks": {"name": "digits", "train_size": 4, "heldout_size": 1, "time_limit_s": 120},
    "rollout": {"group_size": 4, "tasks_per_step": 2, "max_turns": 3, "max_tokens": 64,
                "context_budget": 4096, "temperature": 1.0,
                "tools": ["bash", "read_file", "write_file", "spawn_subagent", "finish"],
                "sandbox": "bwrap", "snapshot_every": 1},
    # fewer warm-start steps leave every RL group without a reward to learn from
    "warmstart": {"steps": 20, "batch_size": 4, "lr": 0.003, "teacher": "mixed"},
    "rl": {"steps": 2, "max_tokens_per_stream": 2048, "numerics": "consistent"},
    "schedule": {"policy": "colocated", "devices": 2, "groups_per_device": 1},
    "eval": {"every": 5, "samples": 1},
}
THREADS = "1"

# what each metrics.jsonl row pins, by phase
PINNED = {"warmstart": ("loss_first", "loss_last"),
          "eval": ("success_rate", "partial_mean"),
          "rl": ("loss", "grad_norm", "reward_mean", "tokens", "max_abs_logprob_diff")}

# the random part `new_session_id` adds (rollout.seed_key at a07c393)
_RANDOM_PART = re.compile(r"-[0-9a-f]{6}(?=(?:-sub\d+)*$)")


def _sha(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:  # each part length-prefixed: no two lists hash alike by concatenation
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def calls_of(ledger: Path) -> dict[str, dict[str, object]]:
    """Per `{phase}-{step}` of the session ids: sessions, calls, and the sha256 of every
    call's prompt ids, output ids and logprobs, sessions in seed-key order."""
    by_key: dict[str, list[bytes]] = {}
    with LedgerStore(ledger, readonly=True) as store:
        for info in store.sessions():
            key = _RANDOM_PART.sub("", info.session_id, count=1)
            assert key not in by_key, f"two sessions of seed key {key}"
            log = store.call_log(info.session_id)
            by_key[key] = [b for sc in log.calls for b in (
                np.asarray(log.prompt_ids(sc.call_id), dtype="<i8").tobytes(),
                np.asarray(sc.call.output_ids, dtype="<i8").tobytes(),
                np.asarray(sc.call.output_logprobs, dtype="<f4").tobytes())]
    groups: dict[str, list[str]] = {}
    for key in sorted(by_key):
        groups.setdefault("-".join(key.split("-")[:2]), []).append(key)
    return {g: {"sessions": len(keys), "calls": sum(len(by_key[k]) for k in keys) // 3,
                "calls_sha256": _sha([k.encode() for k in keys]
                                     + [b for k in keys for b in by_key[k]])}
            for g, keys in groups.items()}


def golden_of(out: Path) -> dict[str, dict[str, object]]:
    """The pinned figures of the run in `out`, as rows: `{phase}-{step}` (metrics.jsonl's
    rows and the ledger's sessions; evalstart/evalend are the evaluations' sessions)
    and `checkpoint` (sha256 per file)."""
    rows: dict[str, dict[str, object]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["phase"] in PINNED:
            rows[f"{r['phase']}-{r['step']}"] = {k: r.get(k) for k in PINNED[r["phase"]]}
    for g, figures in calls_of(out / "ledger.db").items():
        rows.setdefault(g, {}).update(figures)
    ck = out / "checkpoint"
    rows["checkpoint"] = {str(f.relative_to(ck)): hashlib.sha256(f.read_bytes()).hexdigest()
                          for f in sorted(ck.rglob("*"))
                          if f.is_file() and f.name not in ("state.json", ".metadata")}
    return rows


class Pin(TypedDict):
    """One CPU type's figures in golden.json."""

    machine: str
    figures: dict[str, dict[str, object]]


def machine() -> str:
    """This machine's CPU type as the pins name it: the vendor and torch's kernel level."""
    import torch

    vendor = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo.read_text(), re.MULTILINE)
        vendor = found.group(1) if found else vendor
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()}"


def differences(got: dict[str, dict[str, object]], pinned: dict[str, dict[str, object]]) -> int:
    """How many figures of the two tables differ (for the nearest pin)."""
    return sum(got.get(r, {}).get(k) != pinned.get(r, {}).get(k)
               for r in got.keys() | pinned.keys()
               for k in got.get(r, {}).keys() | pinned.get(r, {}).keys())


def _short(v: object) -> str:
    """A figure as the table shows it: a sha256 by its first 16 digits."""
    return v[:16] if isinstance(v, str) and len(v) == 64 else repr(v)


def table(got: dict[str, dict[str, object]], pinned: dict[str, dict[str, object]]) -> str:
    lines = [f"{'':2}{'row':12} {'figure':40} {'got':>24}  pinned"]
    for row in sorted(got.keys() | pinned.keys()):
        g, p = got.get(row, {}), pinned.get(row, {})
        for k in sorted(g.keys() | p.keys()):
            a, b = g.get(k, "(none)"), p.get(k, "(none)")
            mark = "  " if a == b and k in g and k in p else "X "
            lines.append(f"{mark}{row:12} {k:40} {_short(a):>24}  {_short(b)}")
    return "\n".join(lines)


@pytest.mark.slow
def test_golden_numbers(tmp_path: Path) -> None:
    keep = os.environ.get("TIDAL_GOLDEN_KEEP")
    out = Path(keep) if keep else tmp_path / "out"
    conf = tmp_path / "golden.toml"  # the run writes the whole config to out/config.toml
    conf.write_text(dump_config(parse_config(CONFIG)))
    env = {**os.environ, "OMP_NUM_THREADS": THREADS, "MKL_NUM_THREADS": THREADS}
    done = subprocess.run([sys.executable, "-m", "tidal.cli", "run", str(conf), "--out",
                           str(out)], capture_output=True, text=True, timeout=600,
                          check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = golden_of(out)
    pins: list[Pin] = json.loads(GOLDEN.read_text())["pins"]
    here = machine()
    if os.environ.get("TIDAL_GOLDEN_UPDATE") == "1":
        pins = [p for p in pins if p["machine"] != here] + [Pin(machine=here, figures=got)]
        GOLDEN.write_text(json.dumps({"pins": pins}, indent=1, sort_keys=True) + "\n")
        pytest.fail(f"TIDAL_GOLDEN_UPDATE=1: wrote the pin of {here!r} in {GOLDEN}; review "
                    f"and commit it, then run again without it\n{table(got, got)}")
    assert pins, f"{GOLDEN} has no pins"
    if any(p["figures"] == got for p in pins):
        return
    own = [p for p in pins if p["machine"] == here]
    nearest = own[0] if own else min(pins, key=lambda p: differences(got, p["figures"]))
    pinned = nearest["figures"]
    assert got == pinned, (
        f"the run's figures are none of golden.json's pins (this machine: {here!r}; "
        f"pinned: {[p['machine'] for p in pins]}); against the pin of "
        f"{nearest['machine']!r}, X marks each difference\n" + table(got, pinned))
