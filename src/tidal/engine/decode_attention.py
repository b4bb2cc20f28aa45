"""Attention over a KV store that reads each grouped KV head once per query token, and the
fast step's small ops fused: a small C++ extension (`decode_attention.cpp`), built for
this machine on first use.

The store (`fast_batch.py`'s) keeps every sequence's keys and values in a region of slots,
[S, KV, D] per layer; query token n reads the `lengths[n]` slots from `starts[n]` (its
sequence's region up to and including itself). A decode step is one token per sequence, a
prefill a sequence's new tokens: nothing is padded, masked, merged or copied when
sequences join or leave.

Why: at batch 16 and 800 tokens of context, SmolLM2-135M's decode step reads ~590 MB of
fp32 keys and values (30 layers, 3 KV heads of 64). SDPA's CPU kernel read them at ~7
GB/s (88 of a 212 ms step) on a 2-core machine that streams ~19 GB/s: it runs each query
head on its own (9 heads over 3 KV heads) through small GEMMs with a per-block online
softmax. The kernel here runs one task per (row, KV head) over torch's OpenMP threads:
the G query heads that share the head take their dot products from one pass over its
keys, then one pass over its values, in AVX2/FMA loops with every cache line prefetched
ahead (`-O3 -march=native -ffast-math -fopenmp`; exponentials by glibc's vector `expf`):
~48 ms. Figures: docs/engine.md, "The fast decode step".

The step's small ops (`glue()`, a `Glue`): the RMS norm, with the residual add before it
fused in; rotary on q and k with the fused q/k/v projection split in the same pass; and
silu(gate) * up. Through torch, each was several kernels at 16 rows (`F.rms_norm` on CPU
is six), each with its dispatch and allocation.

Numerics: fp32 throughout, summed in another order than SDPA's and torch's (within ~1e-6
of them on the shapes tested); the consistent batch never comes here.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("decode_attention.cpp")
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")

# q [N, H, D], k/v [S, KV, D] (head dim contiguous), starts [N] and lengths [N] int64, scale
# -> [N, H, D]: token n attends to slots starts[n] .. starts[n] + lengths[n] - 1
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                  torch.Tensor]



@dataclass(frozen=True)
class Glue:
    """The decode step's small ops, fp32 and row-major (see the module's docstring)."""

    # (x [N, C], w [C], eps) -> x * rsqrt(mean(x^2) + eps) * w, row by row
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, delta, w, eps): x += delta in place, then rms_norm(x, w, eps)
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (qkv [N, (H + 2 KV) D], cos [N, D], sin [N, D], H, KV) -> q [N, H, D] and k, v
    # [N, KV, D], rotary (rotate-half) applied to q and k
    rope_split: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int],
                         list[torch.Tensor]]
    # gu [B, 2 I] -> silu(gu[:, :I]) * gu[:, I:]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


_LOCK = threading.Lock()
_BUILT: dict[str, Any] = {}


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


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # noqa: PLR0917 (a Kernel)
              starts: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention through SDPA ([N, H, D]): each token's region gathered into a
    padded [n, KV, L, D] and masked, n tokens at a time (the gathered keys and values of a
    chunk kept near 64 MB; a bf16 store's widened to fp32). What the kernel must agree
    with, and what the fast step runs where the kernel cannot be built."""
    width = int(lengths.max())
    per_token = width * k.shape[1] * k.shape[2] * k.element_size()
    chunk = max(1, (64 << 20) // per_token)
    cols = torch.arange(width, device=q.device)
    parts = []
    for a in range(0, q.shape[0], chunk):
        s, n = starts[a : a + chunk], lengths[a : a + chunk]
        slots = (s[:, None] + cols).clamp_(max=k.shape[0] - 1)  # [n, L]
        allowed = (cols < n[:, None])[:, None, None, :]
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            q[a : a + chunk, :, None, :], k[slots].to(q.dtype).transpose(1, 2),
            v[slots].to(q.dtype).transpose(1, 2),
            attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])[:, :, 0, :])
    return torch.cat(parts)


def _check(fn: Kernel) -> str | None:
    """Why `fn` cannot stand in for SDPA (None: it can), on a small case: three tokens of
    one sequence (a prefill) and one of another, over an fp32 and a bf16 store, head dims
    16 (the portable path) and 64 (the intrinsics one where the CPU has them)."""
    gen = torch.Generator().manual_seed(0)
    for dim in (16, 64):
        q = torch.randn(4, 6, dim, generator=gen)
        k = torch.randn(50, 2, dim, generator=gen)
        v = torch.randn(50, 2, dim, generator=gen)
        starts = torch.tensor([3, 3, 3, 20])
        lengths = torch.tensor([7, 8, 9, 30])
        for kv in (torch.float32, torch.bfloat16):
            k_, v_ = k.to(kv), v.to(kv)
            got = fn(q, k_, v_, starts, lengths, 0.25)
            want = reference(q, k_, v_, starts, lengths, 0.25)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return (f"it differs from SDPA by {(got - want).abs().max().item():.2e} "
                        f"({kv} store, head dim {dim})")
    return None


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH: the `ninja` wheel's binary (a dependency)
    where the machine has none, e.g. a venv's bin that is not on PATH."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen2/Mistral RMSNorm (in fp32, cast back), op for op."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor,
                  eps: float) -> torch.Tensor:
    return _rms_norm(x.add_(delta), w, eps)


def _rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                kv_heads: int) -> list[torch.Tensor]:
    """transformers' apply_rotary_pos_emb on q and k at once, and v as it is."""
    B, D = qkv.shape[0], cos.shape[1]
    qk = qkv[:, : (heads + kv_heads) * D].reshape(B, heads + kv_heads, D)
    rotated = torch.cat((-qk[..., D // 2 :], qk[..., : D // 2]), dim=-1)
    qk = qk * cos[:, None] + rotated * sin[:, None]
    v = qkv[:, (heads + kv_heads) * D :].reshape(B, kv_heads, D)
    return [qk[:, :heads], qk[:, heads:], v]


def _silu_mul(gu: torch.Tensor) -> torch.Tensor:
    half = gu.shape[-1] // 2
    return torch.nn.functional.silu(gu[:, :half]) * gu[:, half:]


# The same ops through torch (any dtype): what the built ones must agree with, and what
# the decode step runs where they cannot be built.
TORCH_GLUE = Glue(_rms_norm, _add_rms_norm, _rope_split, _silu_mul)


def _check_glue(ops: Glue) -> str | None:
    """Why `ops` cannot stand in for torch's ops (None: they can), on small cases."""
    gen = torch.Generator().manual_seed(0)
    x, d, w = (torch.randn(5, 24, generator=gen) for _ in range(3))
    w = w[0].contiguous()
    want = TORCH_GLUE.rms_norm(x + d, w, 1e-5)
    got = [ops.rms_norm(x + d, w, 1e-5), ops.add_rms_norm(x.clone(), d, w, 1e-5)]
    qkv = torch.randn(3, (4 + 2 * 2) * 8, generator=gen)
    angles = torch.randn(3, 4, generator=gen).repeat(1, 2)
    pairs = list(zip(ops.rope_split(qkv, angles.cos(), angles.sin(), 4, 2),
                     TORCH_GLUE.rope_split(qkv, angles.cos(), angles.sin(), 4, 2), strict=True))
    gu = torch.randn(3, 20, generator=gen)
    pairs += [(g, want) for g in got]
    pairs.append((ops.silu_mul(gu), TORCH_GLUE.silu_mul(gu)))
    for got_t, want_t in pairs:
        if got_t.shape != want_t.shape or not torch.allclose(got_t, want_t, rtol=1e-5,
                                                            atol=1e-5):
            return "its small ops differ from torch's"
    return None


def kernel() -> Kernel | None:
    """The built attention kernel, or None where it cannot be built or checked (said
    once)."""
    with _LOCK:
        if "attention" not in _BUILT:
            module, why = _module()
            fn: Kernel | None = None if module is None else module.decode_attention
            _BUILT["attention"] = _usable(fn, why or (None if fn is None else _check(fn)),
                                          "decode steps use SDPA")
        return _BUILT["attention"]


def glue() -> Glue | None:
    """The built small ops, or None where they cannot be built or checked (said once)."""
    with _LOCK:
        if "glue" not in _BUILT:
            module, why = _module()
            ops = None if module is None else Glue(module.rms_norm, module.add_rms_norm,
                                                   module.rope_split, module.silu_mul)
            _BUILT["glue"] = _usable(ops, why or (None if ops is None else _check_glue(ops)),
                                     "the decode step uses torch's small ops")
        return _BUILT["glue"]


def _usable(made: Any, why: str | None, instead: str) -> Any:
    """`made`, or None with a warning saying why (`why` set) and what runs `instead`."""
    if why:
        warnings.warn(f"tidal.engine.decode_attention: {instead}: {why}", RuntimeWarning,
                      stacklevel=4)
        return None
    return made


def _module() -> tuple[Any, str | None]:
    """The extension module, built on the first call (None where it could not be, and
    why); the caller holds `_LOCK`."""
    if "module" not in _BUILT:
        _BUILT["module"] = _build()
    return _BUILT["module"]


def _build() -> tuple[Any, str | None]:
    """The built extension module (None where it could not be built, and why)."""
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        return load(name=_name(), sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                    extra_ldflags=["-lm", "-fopenmp"], verbose=False), None
    except (OSError, RuntimeError, ImportError, ValueError) as e:  # no compiler, no ninja
        return None, f"it could not be built ({type(e).__name__}: {str(e).strip()[:300]})"
