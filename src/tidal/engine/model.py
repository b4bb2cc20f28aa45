"""Loading the policy model: the one function the engine and the trainer both call.

The embedded engine samples from a transformers causal LM and the trainer trains one; the
two must be the same model, read the same way, or the logprobs the engine records and the
trainer recomputes drift apart for reasons that have nothing to do with RL. So both load
a checkpoint directory through `load_policy_model`: transformers'
`AutoModelForCausalLM` with PyTorch's SDPA attention (the engine samples with it; the
trainer's tree attention runs SDPA per group of chains on CPU and is plain SDPA outside a
tree step; docs/training.md, "Attention"), the dtype named the same way everywhere, from
local files only (model hubs cannot be reached here; `tiny.resolve_model` turns a model's
name into its directory first), on the device asked for.

It leaves the model in eval mode unless asked for `train=True`: the engine never trains,
and a trainer that wants train mode (dropout) says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.engine.base import EngineError

if TYPE_CHECKING:
    import torch


def load_policy_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    train: bool = False,
) -> Any:
    """The transformers causal LM of checkpoint directory `path` on `device`, its weights
    in `dtype` ("float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16" or a torch dtype),
    SDPA attention, in eval mode (train mode with `train=True`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=_parse_dtype(dtype),
        attn_implementation="sdpa",
        local_files_only=True,
    ).to(device)  # type: ignore[arg-type]
    model.train(train)
    return model


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise EngineError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]
