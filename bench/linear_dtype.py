"""SmolLM2-135M's decoder linear layers at decode shapes, fp32 against bf16 weights.

Per layer the fused q/k/v (576 -> 960), o (576 -> 576), fused gate/up (576 -> 3072) and
down (1536 -> 576) projections, 30 layers, random weights, `torch.nn.functional.linear`
(oneDNN; bf16 where this CPU has AVX512_BF16 or AMX), at 16 and 64 rows: the median
time of a step's layers and their FLOP rate, beside this machine's 2048^3 fp32 matmul
rate. A measurement for the engine's linear-layer target (docs/engine.md); the engine runs
its own linear layers in bf16 with `engine.matmul_dtype = "bfloat16"` (measured in place
by `bench/decode_step.py --matmul-dtype bfloat16`). Prints one JSON object.

    .venv/bin/python bench/linear_dtype.py [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

HIDDEN, INTER, KV_DIM, LAYERS = 576, 1536, 192, 30
SHAPES = ((HIDDEN, HIDDEN + 2 * KV_DIM), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN))


def layers_time(dtype: torch.dtype, rows: int, repeats: int) -> dict[str, float]:
    weights = [[torch.randn(o, i).to(dtype) for i, o in SHAPES] for _ in range(LAYERS)]
    x = {i: torch.randn(rows, i).to(dtype) for i, _ in SHAPES}

    def step() -> None:
        for layer in weights:
            for (i, _), w in zip(SHAPES, layer, strict=True):
                torch.nn.functional.linear(x[i], w)

    step()
    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    flop = 2 * rows * LAYERS * sum(i * o for i, o in SHAPES)
    return {"ms": round(1e3 * med, 2), "gflops": round(flop / med / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    big = 5 * 2 * 2048**3 / (time.perf_counter() - t0) / 1e9
    out: dict[str, object] = {
        "bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "large_matmul_gflops": round(big, 1)}
    for rows in (16, 64):
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            r = layers_time(dtype, rows, args.repeats)
            out[f"{name}_{rows}_rows"] = {**r, "of_large_matmul": round(r["gflops"] / big, 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
