"""The engine protocol: token ids in, sampled token ids with logprobs out.

Every engine (the embedded transformers engine, the vLLM client) implements `Engine`.
No text crosses this seam: the gateway renders and tokenizes, the engine only samples.
Logprobs are those of the distribution actually sampled from (after temperature,
top-k and top-p), so that the trainer's importance ratios compare like with like.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat completions


class EngineError(RuntimeError):
    """The engine could not serve a request (bad parameters, context too long, ...)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0  # alternatives to report per sampled token (0-20); not sampling

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise EngineError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EngineError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise EngineError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )


TopLogprobs = tuple[tuple[tuple[int, float], ...], ...]
"""Per output position, up to `SamplingParams.top_logprobs` (token id, logprob) pairs of the
distribution sampled from, most likely first; tokens it gives no probability are left out."""


@dataclass(frozen=True, eq=False)
class Generation:
    """One sampled continuation. `logprobs[i]` is the log-probability of `output_ids[i]`;
    `top_logprobs[i]` the most likely alternatives there (None unless asked for)."""

    output_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    finish_reason: str  # "stop" (a stop token was sampled; it is included) or "length"
    policy_version: int
    extra: dict[str, float] = field(default_factory=dict)
    top_logprobs: TopLogprobs | None = None


@runtime_checkable
class Engine(Protocol):
    """What the gateway and the RL loop need from an inference engine."""

    @property
    def model_name(self) -> str: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def max_context(self) -> int:
        """Longest prompt + output the engine accepts, in tokens."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int] | npt.NDArray[np.int32]], params: SamplingParams
    ) -> list[Generation]:
        """Sample one continuation per prompt (a batch; may be of size 1). Thread-safe."""
        ...

    def update_weights(self, source: str, version: int) -> None:
        """Load new weights (a checkpoint directory written by the trainer) and set the
        policy version that later generations carry."""
        ...


_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_STEP = 0xBF58476D1CE4E5B9
_SEED_MASK = (1 << 63) - 1


def mix_seed(seed: int, index: int) -> int:
    """The seed of prompt `index` in a `generate` call with `SamplingParams.seed == seed`.

    Every engine uses it, so a seeded call samples the same way on every backend and each
    prompt of a batch gets its own random stream.
    """
    return (seed * _SEED_MIX + index * _SEED_STEP + 1) & _SEED_MASK
