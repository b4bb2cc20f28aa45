"""The trainer through torch.distributed at world size 1: FSDP2 over a real process group
(NCCL on CUDA, gloo on CPU), a training step, a sharded checkpoint saved and loaded
(bench/gpu_check.sh).

`tidal run` trains in one process without a process group when `train.world_size = 1`;
the code that runs at world size > 1 (`RankTrainer` on a sharded policy: `shard_policy`,
`materialize`'s broadcast from rank 0, the trainer's collectives on its loss
denominators, metric sums and peak memory, `save_state`/`load_state` through
torch.distributed.checkpoint) is run here on one GPU by a `Ranks` that goes through the
group although it is alone in it (`OneRankGroup`). Checked against the same step
without a group (`Ranks()`): the metrics and the parameters after AdamW's step. Then
the sharded trainer saves (`RankTrainer.save`: DCP shards + a transformers checkpoint),
a fresh sharded trainer and a plain one load the DCP state, and one more step on each
must give the same parameters as the trainer that saved.

Prints JSON (and writes `--out`): `ok`, the comparisons, and the seconds of each part.

    python3 bench/gpu_ddp.py [--device cuda] [--model tiny] [--max-tokens 512]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # tidal, and tests.train.synthetic

from tidal.train.distributed import Ranks  # noqa: E402


@dataclasses.dataclass(frozen=True)
class OneRankGroup(Ranks):
    """One rank that still goes through the process group: FSDP2 over a mesh of one, and
    every collective the trainer makes at world size > 1."""

    @property
    def distributed(self) -> bool:
        return True


def _trees(vocab: int, n: int, path_len: int) -> list[Any]:
    from tests.train.synthetic import agent_tree

    rng = np.random.default_rng(0)
    return [agent_tree(rng, f"t{i}", n_leaves=4, path_len=path_len, shared_fraction=0.6,
                       n_mid=2, vocab=vocab) for i in range(n)]


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in trainer.state_dict().items()}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    worst, name = 0.0, ""
    for k, v in a.items():
        d = float((v - b[k]).abs().max()) if v.numel() else 0.0
        if d > worst:
            worst, name = d, k
    return {"max_abs": worst, "at": name, "equal": all(torch.equal(v, b[k]) for k, v in a.items()),
            "same_keys": a.keys() == b.keys()}


def _timed(device: torch.device, fn: Any, *args: Any) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="tiny", help="tiny, qwen2.5-0.5b-shaped, or a directory")
    ap.add_argument("--max-tokens", type=int, default=512, help="small: trees are partitioned")
    ap.add_argument("--trees", type=int, default=3)
    ap.add_argument("--path-len", type=int, default=600)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch.distributed as dist

    from consistent import model_dir  # bench/consistent.py builds and caches the models
    from tidal.engine.model import load_policy_model
    from tidal.train.group import TRAIN_STATE, RankTrainer, TrainerSpec
    from tidal.train.loss import LossConfig

    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    directory = model_dir(args.model) if args.model in ("tiny", "qwen2.5-0.5b-shaped") \
        else Path(args.model)
    result: dict[str, Any] = {"bench": "gpu_ddp", "device": args.device, "model": args.model,
                              "ok": False}
    spec = TrainerSpec(weights_dir=str(directory), device=dev.type, lr=1e-3,
                       loss=LossConfig(correction="tis"), max_tokens=args.max_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="tidal-ddp-"))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    _, init_s = _timed(dev, lambda: dist.init_process_group(
        backend, init_method=f"file://{tmp}/pg", rank=0, world_size=1))
    result.update(backend=dist.get_backend(), init_s=round(init_s, 3))
    try:
        vocab = int(json.loads((directory / "config.json").read_text())["vocab_size"])
        trees = _trees(vocab, args.trees, args.path_len)
        from tidal.train.packing import pack_trees

        batch = pack_trees(trees, args.max_tokens)
        result["batch"] = {"unique_tokens": batch.unique_tokens, "streams": len(batch.streams),
                           "partitioned": sum(s.partition is not None for s in batch.streams)}

        plain = RankTrainer(spec, Ranks())
        m_plain, plain_s = _timed(dev, plain.step, trees)
        p_plain = _params(plain)
        del plain

        group = OneRankGroup(0, 1)
        sharded, build_s = _timed(dev, RankTrainer, spec, group)
        m_sh, step_s = _timed(dev, sharded.step, trees)
        p_sh = _params(sharded)
        metrics = {k: (getattr(m_plain, k), getattr(m_sh, k))
                   for k in ("loss", "token_kl", "max_abs_logprob_diff", "grad_norm", "tokens",
                             "streams")}
        result.update(
            sharded_build_s=round(build_s, 3), plain_step_s=round(plain_s, 3),
            sharded_step_s=round(step_s, 3), metrics_plain_vs_sharded=metrics,
            metrics_close=all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in metrics.values()),
            params_plain_vs_sharded=_diff(p_plain, p_sh),
            peak_memory_mb_per_rank=sharded.peak_memory_mb,
            sharded_param_type=type(next(sharded.model.parameters())).__name__)
        _, save_s = _timed(dev, sharded.save, str(tmp / "ckpt"))
        files = sorted(str(f.relative_to(tmp / "ckpt")) for f in (tmp / "ckpt").rglob("*")
                       if f.is_file())
        result.update(save_s=round(save_s, 3), checkpoint_files=files)
        hf = load_policy_model(tmp / "ckpt", device="cpu")
        result["transformers_checkpoint_vs_sharded"] = _diff(
            {k: v.float() for k, v in hf.state_dict().items() if k in p_sh}, p_sh)
        del hf
        m_next, _ = _timed(dev, sharded.step, trees)
        p_next = _params(sharded)
        del sharded
        state = dataclasses.replace(spec, state_dir=str(tmp / "ckpt" / TRAIN_STATE))
        for name, ranks in (("sharded", group), ("plain", Ranks())):
            loaded, load_s = _timed(dev, RankTrainer, state, ranks)
            result[f"loaded_{name}_s"] = round(load_s, 3)
            result[f"loaded_{name}_vs_saved"] = _diff(_params(loaded), p_sh)
            m_again = loaded.step(trees)
            result[f"loaded_{name}_next_step_vs_saver"] = _diff(_params(loaded), p_next)
            result[f"loaded_{name}_next_loss"] = (m_again.loss, m_next.loss)
            del loaded
        p = result["params_plain_vs_sharded"]
        result["ok"] = bool(
            result["metrics_close"] and p["max_abs"] <= 1e-4
            and result["loaded_sharded_vs_saved"]["equal"]
            and result["loaded_plain_vs_saved"]["equal"]
            and result["loaded_sharded_next_step_vs_saver"]["max_abs"] <= 1e-6
            and result["loaded_plain_next_step_vs_saver"]["max_abs"] <= 1e-4
            and result["transformers_checkpoint_vs_sharded"]["equal"])
    except Exception as e:
        import traceback

        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        dist.destroy_process_group()
        text = json.dumps(result, indent=1, default=str)
        if args.out is not None:
            args.out.write_text(text)
        print(text)
    os._exit(0 if result["ok"] else 1)  # no lingering NCCL/gloo threads at exit


if __name__ == "__main__":
    main()
