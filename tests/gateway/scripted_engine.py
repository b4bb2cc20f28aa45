"""A real `Engine` with a scripted policy, for tests that need controlled model text.

It is a deterministic policy, not a mock: it receives token ids, returns sampled token ids
(the tokenization of the next scripted reply, with the family's stop token) with logprob
0.0 (probability 1 under a deterministic policy), carries a policy version and enforces
its context limit like any engine. The gateway, HTTP layer and ledger it runs under are
the real ones. A random tiny model writes noise, so tool calls and drift cases need this.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.engine.base import EngineError, Generation, SamplingParams, Weights


class ScriptedEngine:
    def __init__(
        self,
        tokenizer: Any,
        *,
        model_name: str = "scripted",
        max_context: int = 32768,
        default_reply: str = "ok",
        policy: Callable[[str], str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._name = model_name
        self._max_context = max_context
        self._version = 0
        self._lock = threading.Lock()
        self.replies: deque[str] = deque()
        self.default_reply = default_reply
        self.policy = policy  # prompt text -> reply, when no scripted reply is queued
        self.prompts: list[npt.NDArray[np.int32]] = []
        self.stop_id = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def push(self, *texts: str) -> None:
        with self._lock:
            self.replies.extend(texts)

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    def generate(
        self, prompts: Sequence[Sequence[int] | npt.NDArray[np.int32]], params: SamplingParams,
        *, session: str | None = None,
    ) -> list[Generation]:
        out = []
        for p in prompts:
            arr = np.asarray(p, dtype=np.int32)
            if arr.size == 0 or arr.size >= self._max_context:
                raise EngineError(f"prompt of {arr.size} tokens does not fit {self._max_context}")
            with self._lock:
                text = self.replies.popleft() if self.replies else None
                self.prompts.append(arr)
            if text is None:
                text = (
                    self.policy(self._tok.decode(arr.tolist()))
                    if self.policy
                    else self.default_reply
                )
            ids = [*self._tok.encode(text, add_special_tokens=False), self.stop_id]
            finish = "stop"
            if len(ids) > params.max_tokens:
                ids, finish = ids[: params.max_tokens], "length"
            out.append(
                Generation(
                    output_ids=np.asarray(ids, dtype=np.int32),
                    logprobs=np.zeros(len(ids), dtype=np.float32),
                    finish_reason=finish,
                    policy_version=self._version,
                )
            )
        return out

    def forget(self, session: str) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {"calls": len(self.prompts)}

    def close(self) -> None:
        pass

    def update_weights(self, source: Weights | str | Path, version: int) -> None:
        self._version = version
