"""The reference the engine tests check against: one full transformers forward."""

from __future__ import annotations

import torch

from tidal.engine.base import SamplingParams
from tidal.engine.sampling import processed_logprobs


def processed_distribution(
    model: torch.nn.Module, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """[len(output), V]: the distribution `params` samples from at each output position,
    from one full forward of `model` over prompt + output."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    n = len(output)
    return processed_logprobs(
        logits,
        torch.full((n,), params.temperature),
        torch.full((n,), params.top_k, dtype=torch.long),
        torch.full((n,), params.top_p),
    )
