"""The trainer's linear layers in bf16 (`train.matmul_dtype`), as the engine runs its own.

`matmuls(dtype)` is a context: inside it every `F.linear` whose input is fp32 (every
`nn.Linear` of the policy: q/k/v, o, gate/up, down, the LM head, LoRA's adapters) rounds
its input, weight and bias to `dtype`, multiplies there and hands its output back in
fp32: the arithmetic of the embedded engine's `engine.matmul_dtype = "bfloat16"`
(`tidal.engine.fused.Linear`). Everything else (embeddings, norms, rotary, attention,
activations, the log-softmax, the loss) stays fp32, and so do the parameters, their
gradients (the casts' backward hands them back in fp32) and AdamW's state: the usual
mixed precision, with fp32 master weights. Outside the context nothing changes, so an
fp32 trainer (the default) computes what it always did, bit for bit.

Where a CPU runs bf16 matmuls natively (oneDNN: AVX512_BF16 or AMX) they take about half
the time of fp32's, and a training step of `make run-real`'s shapes ~0.7x
(bench/train_step.py: 25.3 against 36.2 s). The recomputed log-probabilities are then a
bf16 rounding away from fp32's, as the engine's are; in `make run-real` they lie about
half as far from the engine's as an fp32 trainer's did (docs/training.md), and
`rl.correction` weighs what still differs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own alias
from torch.overrides import TorchFunctionMode

MatmulDtype = Literal["float32", "bfloat16", "auto"]


class _LinearIn(TorchFunctionMode):
    """Routes fp32 `F.linear` calls through `dtype` (the module doc)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type],
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            named = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            x, w, b = named["input"], named["weight"], named.get("bias")
            if x.dtype == torch.float32:
                return F.linear(x.to(self.dtype), w.to(self.dtype),
                                None if b is None else b.to(self.dtype)).to(torch.float32)
        return func(*args, **kwargs)


class _Current(threading.local):
    """What `matmuls` set in this thread (a mode is this thread's only: an engine
    decoding in another thread while the trainer steps is not affected)."""

    dtype: torch.dtype = torch.float32


_current = _Current()


@contextlib.contextmanager
def matmuls(dtype: torch.dtype) -> Iterator[None]:
    """The policy's linear layers in `dtype` while the context is open (fp32: as they
    are)."""
    outer = matmul_dtype()
    _current.dtype = dtype
    try:
        if dtype == torch.float32:
            yield
        else:
            with _LinearIn(dtype):
                yield
    finally:
        _current.dtype = outer


def matmul_dtype() -> torch.dtype:
    """The dtype `matmuls` has the linear layers in, in this thread (fp32 outside it).
    What a layer's forward recomputed in backward (activation checkpointing) must run in
    again: the autograd engine does not carry the context into it."""
    return _current.dtype


def bf16_runs(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 natively: a CUDA device that supports it, or a
    CPU where oneDNN runs bf16 matmuls (`tidal.engine.fused.bf16_matmuls`)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    from tidal.engine.fused import bf16_matmuls

    return device.type == "cpu" and bf16_matmuls()


def resolve_matmul_dtype(name: MatmulDtype, device: torch.device) -> torch.dtype:
    """`train.matmul_dtype` on `device`: "auto" is bf16 where it runs natively, else fp32;
    "bfloat16" where it does not is an error (on AVX2 alone torch's bf16 matmuls run
    slower than fp32's: docs/engine.md)."""
    if name == "float32":
        return torch.float32
    if bf16_runs(device):
        return torch.bfloat16
    if name == "auto":
        return torch.float32
    raise ValueError(f"train.matmul_dtype = \"bfloat16\": {device} multiplies no bf16 "
                     "natively (a CPU needs oneDNN's bf16 matmuls: AVX512_BF16 or AMX); set "
                     "train.matmul_dtype = \"auto\" or \"float32\"")
