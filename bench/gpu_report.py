"""Markdown tables of a bench/gpu_check.sh result, for docs/training.md and docs/engine.md
("On a GPU"): the machine and its measured ceilings, each section's status (and the
first line of what failed), the CUDA tests, tree training, consistent numerics, the
trainer on NCCL, `tidal run`, and the engine's decode rates and weight moves.

    python3 bench/gpu_report.py bench/results/gpu_check.json [--part training|engine|all]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 10 ** -digits or abs(x) >= 1e6):
            return f"{x:.1e}"
        return f"{x:,.{digits}f}"
    return str(x)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in r) + " |"
              for r in rows]
    return "\n".join(lines)


def machine(d: dict[str, Any]) -> str:
    r = d["results"]
    env, ceil = r.get("setup", {}), r.get("ceilings", {})
    pk = env.get("packages", {})
    rates = ", ".join(f"{k} {v:.0f}" for k, v in ceil.get("matmul_tflops", {}).items())
    return (f"Machine: {env.get('gpu', '?')} ({env.get('nvidia_smi', '')}), torch "
            f"{pk.get('torch')}, CUDA {env.get('torch_cuda')}, NCCL {env.get('nccl')}, "
            f"transformers {pk.get('transformers')}, Python {env.get('python')}. Measured in the "
            f"same run (bench/gpu_ceilings.py): dense matmul {rates} "
            f"TFLOP/s ({ceil.get('n')}^3); device copy {_f(ceil.get('copy_gbs'), 0)} GB/s "
            f"(read + write), read {_f(ceil.get('read_gbs'), 0)} GB/s.")


def sections(d: dict[str, Any]) -> str:
    rows = []
    for name, s in d["sections"].items():
        why = ""
        if s.get("status") not in ("ok",):
            tail = (s.get("stderr_tail") or s.get("why") or "").strip().splitlines()
            errs = [x for x in tail if "Error" in x or "error" in x or "FAILED" in x]
            why = (errs[-1] if errs else (tail[-1] if tail else ""))[:160].replace("|", "/")
        rows.append([name, s.get("status", "?"), s.get("seconds"), s.get("limit_s"), why])
    return _table(["section", "status", "seconds", "limit", "what failed"], rows)


def pytest_table(d: dict[str, Any]) -> str:
    p = d["results"].get("pytest", {})
    rows = [[t["id"].replace("tests.", ""), t["outcome"], t["seconds"],
             t["message"].splitlines()[0][:120].replace("|", "/") if t["message"] else ""]
            for t in p.get("tests", [])]
    return f"{p.get('counts', {})}\n\n" + _table(["test", "outcome", "s", "message"], rows)


def tree_table(d: dict[str, Any]) -> str:
    rows = []
    for key in ("tree_bf16", "tree_fp32"):
        res = d["results"].get(key)
        if not res or "agent" not in res:
            continue
        a, dtype = res["agent"], res["config"]["dtype"]
        mfu = {k.removeprefix("tree_mfu_vs_"): v for k, v in a.items()
               if k.startswith("tree_mfu_vs_")}
        rows.append([
            dtype, f"{a['unique_tokens']:,} / {a['path_tokens']:,}", a["ideal_ratio"],
            a["tree_speedup"], a["tree_fraction_of_ideal"], a.get("flop_ratio"),
            a.get("tree_s"), a.get("path_s"), a.get("tree_unique_tokens_per_s"),
            a.get("tree_path_tokens_per_s"), a.get("tree_tflops"),
            ", ".join(f"{v:.1%} of {k}" for k, v in mfu.items()),
            f"{_f((a.get('tree_peak_mb') or 0) / 1024, 1)} / "
            f"{_f((a.get('path_peak_mb') or 0) / 1024, 1)}",
            f"{a['tree_grad_rel_err']:.1e} ({a.get('tree_grad_max_param_rel_err', 0):.1e})",
            a.get("tree_warmup_s"),
        ])
    return _table(["dtype", "unique / path tokens", "ideal", "speedup", "of ideal",
                   "FLOP ratio", "tree s", "per-path s", "unique tok/s", "path tok/s",
                   "TFLOP/s", "MFU", "peak GB tree / path", "grad rel err (worst param)",
                   "first step s (compile)"], rows)


def numerics_table(d: dict[str, Any]) -> str:
    res = d["results"].get("numerics", {}).get("models", {})
    out = []
    for name, m in res.items():
        rows = []
        for mode in ("standard", "consistent"):
            x = m.get(mode, {})
            rows.append([mode, x.get("rollout_s"), x.get("sampled_tokens_per_s"),
                         x.get("train_step_s"), x.get("train_tokens"), x.get("token_kl"),
                         x.get("max_abs_logprob_diff"), x.get("mean_abs_logprob_diff")])
        out.append(f"{name}, {m.get('dtype')}, workload {m.get('workload')}: rollout cost "
                   f"{_f(m.get('rollout_cost'))}x, train step cost {_f(m.get('train_step_cost'))}x")
        out.append(_table(["numerics", "rollout s", "sampled tok/s", "train step s",
                           "train tokens", "token KL", "max abs diff", "mean abs diff"], rows))
        if "invariance_probe" in m:
            out.append("Batch-invariance probe (row bits alone vs in a batch): "
                       + json.dumps(m["invariance_probe"]))
    return "\n\n".join(out)


def ddp_text(d: dict[str, Any]) -> str:
    r = d["results"].get("ddp")
    if not r:
        return "-"
    keys = ("ok", "backend", "batch", "plain_step_s", "sharded_build_s", "sharded_step_s",
            "save_s", "loaded_sharded_s", "loaded_plain_s", "metrics_close",
            "params_plain_vs_sharded", "loaded_sharded_vs_saved", "loaded_plain_vs_saved",
            "loaded_sharded_next_step_vs_saver", "loaded_plain_next_step_vs_saver",
            "transformers_checkpoint_vs_sharded", "peak_memory_mb_per_rank", "error")
    return "\n".join(f"- {k}: {json.dumps(r[k])}" for k in keys if k in r)


def run_text(d: dict[str, Any]) -> str:
    out = []
    for name in ("run", "run_consistent"):
        r = d["results"].get(name)
        if not r:
            continue
        v = r.get("verify") if isinstance(r.get("verify"), dict) else {}
        out.append(f"{name}: rc {r.get('run_rc')}, verify rc {r.get('verify_rc')} "
                   f"(ok {v.get('ok')}, calls {v.get('calls')}, drift {v.get('drift')})")
        rows = [[m.get("phase"), m.get("step"), m.get("seconds"), m.get("rollout_s"),
                 m.get("train_s"), m.get("token_kl"), m.get("max_abs_logprob_diff"),
                 m.get("weight_sync_s"), m.get("peak_memory_mb_per_rank")]
                for m in r.get("metrics", [])]
        out.append(_table(["phase", "step", "s", "rollout s", "train s", "token KL",
                           "max abs diff", "weight sync s", "peak MB"], rows))
    return "\n\n".join(out) or "-"


def engine_tables(d: dict[str, Any]) -> str:
    rows, moves = [], []
    for key in ("engine", "engine_fp32"):
        r = d["results"].get(key)
        if not r:
            continue
        for x in r.get("rows", []):
            rows.append([x["dtype"], x["batch"], x["context"], x.get("decode_tokens_per_s"),
                         x.get("decode_step_ms"), x.get("bandwidth_bound_tokens_per_s"),
                         x.get("fraction_of_bound"), x.get("prefill_tokens_per_s"),
                         x.get("peak_memory_mb")])
        for dtype, m in r.get("weight_move", {}).items():
            moves.append([dtype, m.get("source_mb"), m.get("from_device_s"), m.get("from_cpu_s"),
                          m.get("arrived")])
        for e in r.get("errors", []):
            rows.append([e, "", "", "", "", "", "", "", ""])
    return (_table(["dtype", "batch", "context", "decode tok/s", "step ms", "bandwidth bound "
                    "tok/s", "of bound", "prefill tok/s", "peak MB"], rows) + "\n\n"
            + _table(["engine dtype", "fp32 weights MB", "from the GPU s", "from CPU s",
                      "arrived"], moves))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--part", default="all", choices=["training", "engine", "all"])
    args = ap.parse_args()
    d = json.loads(args.result.read_text())
    parts = [machine(d), "Sections:\n\n" + sections(d)]
    if args.part in ("training", "all"):
        parts += ["CUDA tests (`pytest -k cuda`):\n\n" + pytest_table(d),
                  "Tree training (bench/tree_train.py):\n\n" + tree_table(d),
                  "Consistent numerics (bench/consistent.py):\n\n" + numerics_table(d),
                  "Trainer on NCCL at world size 1 (bench/gpu_ddp.py):\n\n" + ddp_text(d),
                  "`tidal run` on CUDA:\n\n" + run_text(d)]
    if args.part in ("engine", "all"):
        parts += ["Embedded engine (bench/gpu_engine.py):\n\n" + engine_tables(d)]
    print("\n\n".join(parts))


if __name__ == "__main__":
    main()
