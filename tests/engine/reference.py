"""The reference the engine tests check against: one full transformers forward; and
concurrent callers, whose requests share the engine's batches."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from tidal.engine.base import Engine, Generation, SamplingParams
from tidal.engine.consistent import KEY_BLOCK, KeyLists
from tidal.engine.sampling import processed_logprobs


def forward_logprobs(model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Plain log-softmax of `model` at each output position, from one full forward."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    lp = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0]


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


def generate_concurrently(
    engine: Engine, calls: Sequence[tuple[list[int], SamplingParams]]
) -> list[Generation]:
    """One thread per call, all started at once: they join and leave the running batch."""
    got: dict[int, Generation] = {}

    def call(i: int) -> None:
        got[i] = engine.generate([calls[i][0]], calls[i][1])[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [got[i] for i in range(len(calls))]


def causal_lists(n: int) -> KeyLists:
    """The consistent forward's key lists for one sequence: token t attends to 0..t."""
    width = n + (-n) % KEY_BLOCK
    keys = torch.arange(width)[None].clamp(max=n - 1)
    return KeyLists(keys, torch.zeros(n, dtype=torch.long), torch.arange(n) + 1)
