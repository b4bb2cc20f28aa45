"""Any OpenAI-API harness can be trained by tidal: a minimal one, written from scratch.

This agent knows nothing about tidal. It is a plain loop over the stock `openai` client
with two tools (`write_file`, `finish`) that act on a local directory. The only thing
that makes its calls trainable is the base URL: one per session,
`{gateway}/sessions/{session_id}/v1`. The gateway records every call of that session
(exact token ids, logprobs, policy version) whatever the harness sends back.

    .venv/bin/python examples/plain_openai_agent.py --gateway http://127.0.0.1:8000 \
        --model tiny --prompt "Write 471 reversed to answer.txt." --workdir /tmp/ep1

Optional extras a harness may send (see docs/agent.md): header `X-Tidal-Role`
(default "main") and `X-Tidal-Task` (the task id, for grouping).
"""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path
from typing import Any

from openai import OpenAI

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "End the task.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
            },
        },
    },
]


def run(
    gateway: str, model: str, prompt: str, workdir: Path, max_turns: int = 6
) -> tuple[str, str | None]:
    """Run one session; returns (session_id, final answer or None)."""
    session_id = f"plain-{uuid.uuid4().hex[:12]}"
    client = OpenAI(
        base_url=f"{gateway.rstrip('/')}/sessions/{session_id}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Tidal-Role": "main"},
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=128,
        )
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))  # as the SDK returned it
        if not msg.tool_calls:
            return session_id, None
        for call in msg.tool_calls:
            fn = getattr(call, "function", None)
            if fn is None:
                continue
            try:
                args = json.loads(fn.arguments)
            except json.JSONDecodeError:
                args = None
            if fn.name == "finish" and isinstance(args, dict):
                return session_id, str(args.get("answer"))
            if fn.name == "write_file" and isinstance(args, dict):
                target = (workdir / str(args.get("path", "out.txt"))).resolve()
                if workdir.resolve() in target.parents:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(str(args.get("content", "")))
                    result = "ok"
                else:
                    result = "error: path outside the work directory"
            else:
                result = f"error: cannot run {fn.name} with {fn.arguments!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return session_id, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gateway", required=True, help="gateway root URL")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt", default="Write 471 reversed to answer.txt.")
    ap.add_argument("--workdir", type=Path, required=True)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    session_id, answer = run(args.gateway, args.model, args.prompt, args.workdir)
    print(f"session {session_id}: answer {answer!r}")


if __name__ == "__main__":
    main()
