"""A decode step's attention that reads each grouped KV head once: a small C++ kernel
(`decode_attention.cpp`), built for this machine on first use.

Why: at batch 16 and 800 tokens of context, SmolLM2-135M's decode step reads ~590 MB of
fp32 keys and values (30 layers, 3 KV heads of 64). SDPA's CPU kernel read them at ~7
GB/s (88 of a 212 ms step) on a 2-core machine that streams ~19 GB/s: it runs each query
head on its own (9 heads over 3 KV heads) through small GEMMs with a per-block online
softmax. The kernel here runs one task per (row, KV head) over torch's OpenMP threads:
the G query heads that share the head take their dot products from one pass over its
keys, then one pass over its values, in AVX2/FMA loops with every cache line prefetched
ahead (`-O3 -march=native -ffast-math -fopenmp`; exponentials by glibc's vector `expf`):
~48 ms. Figures: docs/engine.md, "The fast decode step".

Numerics: fp32 throughout, summed in another order than SDPA's (within ~1e-6 of it on
the shapes tested); the consistent batch never comes here.

Building needs a C++ compiler and ninja (torch.utils.cpp_extension; the `ninja` wheel is a
dependency, used where the machine has no ninja of its own); the build (~1 min) is
cached under torch's extensions directory, keyed by the source, the flags and this CPU's
instruction sets, and one process builds while the others wait. Where it cannot be built,
or disagrees with SDPA on a check at load, `kernel()` is None, says why once (a warning),
and the decode step uses SDPA.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_attention.cpp")
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")

# q [B, H, D], k/v [B, KV, T, D] (head dim contiguous), mask [B, T] bool or None, scale
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float],
                  torch.Tensor]

_LOCK = threading.Lock()
_BUILT: dict[str, Kernel | None] = {}


def _cpu_flags() -> str:
    """This CPU's instruction sets (the build is `-march=native`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _name() -> str:
    key = "\n".join([SOURCE.read_text(), " ".join(CFLAGS), _cpu_flags(), torch.__version__])
    return "tidal_decode_attention_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """The same attention through SDPA ([B, H, D]): what the kernel must agree with."""
    allowed = None if mask is None else mask.bool()[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=allowed, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0, :]


def _check(fn: Kernel) -> str | None:
    """Why `fn` cannot stand in for SDPA (None: it can), on a small masked case."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 16, generator=gen)
    k = torch.randn(3, 2, 40, 16, generator=gen)[:, :, :37]  # views of a longer buffer
    v = torch.randn(3, 2, 40, 16, generator=gen)[:, :, :37]
    mask = torch.ones(3, 37, dtype=torch.bool)
    mask[1, :9] = False
    got, want = fn(q, k, v, mask, 0.25), reference(q, k, v, mask, 0.25)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        return f"it differs from SDPA by {(got - want).abs().max().item():.2e}"
    return None


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH: the `ninja` wheel's binary (a dependency)
    where the machine has none, e.g. a venv's bin that is not on PATH."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def kernel() -> Kernel | None:
    """The built kernel, or None where it cannot be built or checked (said once)."""
    with _LOCK:
        if "fn" not in _BUILT:
            _BUILT["fn"] = _build()
        return _BUILT["fn"]


def _build() -> Kernel | None:
    why: str | None
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        module = load(name=_name(), sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                      extra_ldflags=["-lm", "-fopenmp"], verbose=False)
        fn: Kernel = module.decode_attention
        why = _check(fn)
    except (OSError, RuntimeError, ImportError, ValueError) as e:  # no compiler, no ninja
        why = f"it could not be built ({type(e).__name__}: {str(e).strip()[:300]})"
    if why is None:
        return fn
    warnings.warn(f"tidal.engine.decode_attention: decode steps use SDPA: {why}",
                  RuntimeWarning, stacklevel=3)
    return None
