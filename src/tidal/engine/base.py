"""The engine protocol: token ids in, sampled token ids with logprobs out.

Every engine (the embedded transformers engine, the vLLM client) implements `Engine`.
No text crosses this seam: the gateway renders and tokenizes, the engine only samples.
Logprobs are those of the distribution actually sampled from (after temperature,
top-k and top-p), so that the trainer's importance ratios compare like with like.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

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


@dataclass(frozen=True)
class Adapter:
    """A version's LoRA adapters, for engines that serve adapters over frozen base
    weights (vLLM with `--enable-lora`) instead of merged weights. `tensors` are in
    peft's saved-adapter names (`base_model.model.<module>.lora_A.weight`, no adapter
    name); `write(out)` makes peft's adapter directory (adapter_config.json +
    adapter_model.safetensors)."""

    tensors: Mapping[str, torch.Tensor]
    r: int
    alpha: float
    targets: tuple[str, ...]

    def write(self, out: Path) -> Path:
        import json

        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()},
                  str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": self.r, "lora_alpha": self.alpha,
            "target_modules": list(self.targets), "lora_dropout": 0.0, "bias": "none",
            "task_type": "CAUSAL_LM", "base_model_name_or_path": None}, indent=1))
        return out


class Weights:
    """New policy weights on their way from the trainer to an engine, in the form each
    engine needs, each made at most once: `tensors()` streams (name, full tensor) pairs
    (an in-process engine copies them; a collective sync broadcasts them one by one),
    `directory()` writes a transformers checkpoint (safetensors, config, tokenizer) the
    first time it is asked and returns it (engines in other processes load it).

    `tidal run`'s trainer gives `TrainerGroup.weights(out)` per update (gathered from its
    ranks; `adapter` set with LoRA), a single model `Weights.of_model(model, out)`; a path
    given to `update_weights` is a checkpoint that exists already (`Weights.of_directory`).
    """

    def __init__(
        self,
        tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        *,
        directory: Path | None = None,
        write: Callable[[Path], None] | None = None,
        target: Path | None = None,
        adapter: Adapter | None = None,
    ) -> None:
        self.adapter = adapter  # LoRA: the adapters the merged tensors were made from
        self._tensors = tensors
        self._dir = directory
        self._write = write
        self._target = target
        self._lock = threading.Lock()

    @classmethod
    def of_model(cls, model: Any, out: Path, *, extra_files: Sequence[Path] = ()) -> Weights:
        """A transformers model's weights: its state dict in process, and on demand
        `model.save_pretrained(out)` plus `extra_files` (e.g. the tokenizer's files). The
        model is read when they are asked for: hand them over before it trains again."""

        def write(d: Path) -> None:
            import shutil

            d.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(d, safe_serialization=True)
            for f in extra_files:
                shutil.copy2(f, d / f.name)

        return cls(lambda: iter(model.state_dict().items()), write=write, target=out)

    @classmethod
    def of_state_dict(cls, state_dict: Mapping[str, torch.Tensor]) -> Weights:
        """Tensors in process only: an engine that needs a directory refuses them."""
        return cls(lambda: iter(state_dict.items()))

    @classmethod
    def of_directory(cls, path: str | Path) -> Weights:
        """A checkpoint directory that exists (its tensors are read from it on demand)."""
        d = Path(path)
        return cls(lambda: _read_safetensors(d), directory=d)

    @property
    def written(self) -> bool:
        """Whether the checkpoint directory exists yet (made, or given)."""
        return self._dir is not None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors()

    def directory(self) -> Path:
        """The checkpoint directory, written now if it was not yet (once)."""
        with self._lock:
            if self._dir is None:
                if self._write is None or self._target is None:
                    raise EngineError("these weights are tensors in process: this engine "
                                      "needs a checkpoint directory (Weights.of_model or a path)")
                self._write(self._target)
                self._dir = self._target
            return self._dir


def _read_safetensors(d: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    if not d.is_dir():
        raise EngineError(f"no checkpoint directory at {d}")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {d}")
    for f in files:
        yield from load_file(str(f)).items()


def as_weights(source: Weights | str | Path) -> Weights:
    """What `update_weights` was given, as `Weights` (a path is an existing checkpoint)."""
    return source if isinstance(source, Weights) else Weights.of_directory(source)


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
        self, prompts: Sequence[Sequence[int] | npt.NDArray[np.int32]], params: SamplingParams,
        *, session: str | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt (a batch; may be of size 1). Thread-safe.

        `session` names the agent session the prompts belong to (the gateway always
        passes it): a pool of servers keeps a session on one server, whose prefix cache
        holds its history. Sampling does not depend on it."""
        ...

    def forget(self, session: str) -> None:
        """The session ended (the gateway's `on_forget`): drop what routing kept for it
        (a pool of servers pins each session to one). A no-op for a single engine."""
        ...

    def metrics(self) -> dict[str, Any]:
        """What the engine did since the last call, as flat JSON values (a run logs them
        in each step's row); {} when it measures nothing."""
        ...

    def close(self) -> None:
        """Stop serving; what it started (threads, servers) stops too."""
        ...

    def update_weights(self, source: Weights | str | Path, version: int) -> None:
        """Load new weights (`Weights` from the trainer, or a checkpoint directory) and set
        the policy version that later generations carry. The one way weights reach an
        engine: in process, in another process, or over a collective."""
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
