"""Merging trees that start alike (`tidal.train.merge`): one trainer step on the trees of
a `tidal run`, merged vs as the processor emits them (one tree per episode).

For each RL step of the run (its sessions are named `rl-<step>-...`), the trees are
rebuilt from the run's ledger exactly as the loop builds them (`process_store` with the
run's config), and `TreeTrainer.step` runs on them twice, `merge=True` and
`merge=False`, each from the same weights (the run's last checkpoint) with a fresh
AdamW, alternating which goes first. Prints JSON: per step the tokens computed and the
seconds of each, and their means (the first two steps are a warm-up, left out of the
means); `loss_max_rel_diff` compares the two losses (they must agree).

    .venv/bin/python bench/merge.py RUN_DIR [--steps 12] [--threads 2]

RUN_DIR is what `tidal run` wrote (runs/run-...; it needs ledger.db, config.toml and
checkpoint/).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, default=12, help="RL steps measured (from step 1)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from tidal.engine.model import load_policy_model
    from tidal.ledger.store import LedgerStore
    from tidal.run.config import load_config
    from tidal.train import LossConfig, TreeTrainer
    from tidal.tree.process import process_store

    torch.set_num_threads(args.threads)
    run: Path = args.run_dir
    cfg = load_config(run / "config.toml")
    store = LedgerStore(run / "ledger.db")
    base = load_policy_model(run / "checkpoint")
    sessions = store.session_ids()
    loss_cfg = LossConfig(
        clip_low=cfg.rl.clip_eps, clip_high=cfg.rl.clip_eps, correction=cfg.rl.correction
    )
    rows: list[dict[str, Any]] = []
    for step in range(1, args.steps + 1):
        sids = [s for s in sessions if s.startswith(f"rl-{step}-")]
        if not sids:
            break
        trees = process_store(
            store, sids, max_paths=cfg.rl.max_paths, incomplete=cfg.rl.timeout_reward,
            normalisation=cfg.rl.normalization, strict=False,
        ).trees
        row: dict[str, Any] = {"step": step, "sessions": len(sids), "trees": len(trees)}
        for merge in ((True, False) if step % 2 else (False, True)):
            model = copy.deepcopy(base)
            trainer = TreeTrainer(
                model, torch.optim.AdamW(model.parameters(), lr=cfg.rl.lr), loss_cfg,
                max_tokens=cfg.rl.max_tokens_per_stream, merge=merge,
            )
            t0 = time.perf_counter()
            m = trainer.step(trees)
            name = "merged" if merge else "plain"
            row[f"{name}_s"] = round(time.perf_counter() - t0, 3)
            row[f"{name}_tokens"] = m.tokens
            row[f"{name}_loss"] = m.loss
            row["path_tokens"] = m.path_tokens
        rows.append(row)
    store.close()
    timed = rows[2:] or rows

    def mean(key: str) -> float:
        return round(statistics.fmean(r[key] for r in timed), 3)

    diffs = [
        abs(r["merged_loss"] - r["plain_loss"]) / max(abs(r["plain_loss"]), 1e-12) for r in rows
    ]
    out = {
        "bench": "tree_merge",
        "run_dir": str(run),
        "steps": rows,
        "tokens_plain": mean("plain_tokens"),
        "tokens_merged": mean("merged_tokens"),
        "token_ratio": round(mean("plain_tokens") / mean("merged_tokens"), 2),
        "step_s_plain": mean("plain_s"),
        "step_s_merged": mean("merged_s"),
        "speedup": round(mean("plain_s") / mean("merged_s"), 2),
        "loss_max_rel_diff": max(diffs) if diffs else None,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
