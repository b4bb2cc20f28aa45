"""Engine factories for `tidal serve --engine module:attr` in tests (worker processes
import them by name): the scripted engine of `scripted_engine.py`, real tokens, no model."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tests.gateway.scripted_engine import ScriptedEngine
from tidal.engine.base import Generation, SamplingParams

REPLY = "The quick brown fox jumps over the lazy dog."
SLOW = "take your time"  # a prompt with this text is answered after `SLOW_S`
SLOW_S = 3.0


class _Scripted(ScriptedEngine):
    def generate(
        self, prompts: Sequence[Sequence[int] | npt.NDArray[np.int32]], params: SamplingParams,
        *, session: str | None = None,
    ) -> list[Generation]:
        if any(SLOW in self._tok.decode(list(p)) for p in prompts):
            time.sleep(SLOW_S)  # long enough to kill the worker while the call is in flight
        return super().generate(prompts, params)


def scripted(model_dir: Path, tokenizer: Any) -> ScriptedEngine:
    """Every call answers `REPLY` (a few tokens, so a stream has several chunks)."""
    return _Scripted(tokenizer, model_name="tiny", default_reply=REPLY)


not_callable = 42
