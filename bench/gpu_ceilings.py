"""The machine's measured ceilings, for the other GPU benches' ratios: dense matrix
products (bf16, fp16, fp32 with TF32 off and on) and device memory bandwidth.

Matrix rate: an n x n x n product (`--n`, 8192 on CUDA), `--reps` timed after 3 warm-ups,
CUDA events around the whole batch; TFLOP/s = 2 n^3 reps / seconds, on random data.
Bandwidth: a device-to-device copy of a `--copy-mb` buffer, reported as bytes read plus
bytes written per second (`copy_gbs`, the figure KINDS.md quotes), and a pure read
(a sum of the buffer, `read_gbs`). On CPU (the dry run) the same with small sizes.

Prints one JSON object (and writes it to `--out` if given): device, torch/CUDA versions,
`matmul_tflops` by dtype, `copy_gbs`, `read_gbs`.

    python3 bench/gpu_ceilings.py [--device cuda] [--n 8192] [--reps 10] [--copy-mb 4096]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _timed(fn: Callable[[], Any], reps: int, dev: torch.device) -> float:
    """Seconds per call of `fn`, `reps` calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end) / 1000 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def matmul_tflops(n: int, dtype: torch.dtype, reps: int, dev: torch.device,
                  tf32: bool = False) -> float:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        gen = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
        out = torch.empty(n, n, device=dev, dtype=dtype)
        s = _timed(lambda: torch.mm(a, b, out=out), reps, dev)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return 2 * n**3 / s / 1e12


def bandwidth_gbs(mb: int, reps: int, dev: torch.device) -> tuple[float, float]:
    """(copy: bytes read + written per second, read: bytes read per second), GB/s."""
    n = mb * 2**20 // 4
    src = torch.ones(n, device=dev)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), reps, dev)
    acc = torch.empty((), device=dev)
    read_s = _timed(lambda: torch.sum(src, 0, out=acc), reps, dev)
    nbytes = n * 4
    return 2 * nbytes / copy_s / 1e9, nbytes / read_s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=None, help="matrix size (8192 on CUDA, 512 on CPU)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--copy-mb", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    n = args.n or (8192 if cuda else 512)
    reps = args.reps or (10 if cuda else 3)
    copy_mb = args.copy_mb or (4096 if cuda else 64)
    out: dict[str, Any] = {
        "bench": "gpu_ceilings", "device": str(dev), "torch": torch.__version__,
        "cuda": torch.version.cuda, "n": n, "reps": reps, "copy_mb": copy_mb,
    }
    if cuda:
        props = torch.cuda.get_device_properties(dev)
        out.update(name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count,
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    rates: dict[str, float] = {}
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp16", torch.float16, False),
                              ("fp32", torch.float32, False), ("tf32", torch.float32, True)):
        if not cuda and name in ("fp16", "tf32"):
            continue
        reps_here = reps if dtype != torch.float32 or tf32 or not cuda else max(2, reps // 3)
        rates[name] = round(matmul_tflops(n, dtype, reps_here, dev, tf32), 3)
    out["matmul_tflops"] = rates
    copy, read = bandwidth_gbs(copy_mb, reps, dev)
    out["copy_gbs"], out["read_gbs"] = round(copy, 1), round(read, 1)
    text = json.dumps(out, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
