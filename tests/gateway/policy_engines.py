"""Engine factories for `tidal serve --engine module:attr` in the restart tests: a
deterministic policy of the prompt (real tokenizer, no model), so that a server process
the test cannot script still writes tool calls and answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.gateway.scripted_engine import ScriptedEngine

TOOL_CALL = (
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Bern", "unit": "c"}}\n</tool_call>'
)


def reply(prompt: str) -> str:
    """A tool call when the last user turn asks for the weather and tools are offered, an
    answer after a tool result, else a note naming the turn's length."""
    last = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "<tool_response>" in last:
        return "Sunny, 21 C."
    if "weather" in last.lower() and "<tools>" in prompt:
        return TOOL_CALL
    return f"Noted ({len(last)} characters)."


def weather_policy(model_dir: Path, tokenizer: Any) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, model_name="tiny", policy=reply)
