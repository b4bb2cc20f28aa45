"""Any OpenAI-API harness can be trained by tidal: a minimal one, written from scratch.

This agent knows nothing about tidal. It is a plain loop over the stock `openai` client
with three tools (`bash`, `write_file`, `finish`) that act in its working directory.
The only thing that makes its calls trainable is the base URL: one per session,
`{gateway}/sessions/{session_id}/v1`. The gateway records every call of that session
(exact token ids, logprobs, policy version) whatever the harness sends back.

Run by `tidal run` as a command harness (docs/workload.md), it reads everything from its
environment, as OpenAI clients do, and runs inside the episode's sandbox:

    [agent]
    harness = "command"
    command = "python3 /opt/agent/plain_openai_agent.py"   # OPENAI_BASE_URL, TIDAL_MODEL,
                                                           # TIDAL_INSTRUCTION are set

By hand, against `tidal serve`:

    .venv/bin/python examples/plain_openai_agent.py --gateway http://127.0.0.1:8000 \
        --model tiny --prompt "Write 471 reversed to answer.txt." --workdir /tmp/ep1

Optional extras a harness may send (see docs/agent.md): header `X-Tidal-Role`
(default "main") and `X-Tidal-Task` (the task id, for grouping; tidal's session URLs
already name it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

from openai import OpenAI

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the working directory.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
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


def _tool(name: str, args: dict[str, Any], workdir: Path) -> str:
    if name == "bash":
        try:
            r = subprocess.run(str(args.get("command", "")), shell=True, cwd=workdir,  # noqa: S602
                               capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return "error: the command timed out after 30 s"
        return f"exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    if name == "write_file":
        target = (workdir / str(args.get("path", "out.txt"))).resolve()
        if workdir.resolve() not in target.parents:
            return "error: path outside the work directory"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(str(args.get("content", "")))
        return "ok"
    return f"error: no tool {name!r}"


def run(base_url: str, model: str, prompt: str, workdir: Path, max_turns: int = 6) -> str | None:
    """Run one session against `base_url` (a session's OpenAI base URL); returns the final
    answer, or None when the model stopped calling tools or ran out of turns."""
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"),
                    max_retries=0, default_headers={"X-Tidal-Role": "main"})
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
            return None
        for call in msg.tool_calls:
            fn = getattr(call, "function", None)
            if fn is None:
                continue
            try:
                args = json.loads(fn.arguments)
            except json.JSONDecodeError:
                args = None
            if not isinstance(args, dict):
                result = f"error: arguments {fn.arguments!r} are not a JSON object"
            elif fn.name == "finish":
                return str(args.get("answer"))
            else:
                result = _tool(fn.name, args, workdir)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gateway", help="gateway root URL (default: $OPENAI_BASE_URL is the "
                    "session's URL, as tidal's command harness sets it)")
    ap.add_argument("--model", default=os.environ.get("TIDAL_MODEL", "tiny"))
    ap.add_argument("--prompt", default=os.environ.get("TIDAL_INSTRUCTION"))
    ap.add_argument("--workdir", type=Path, default=Path.cwd())
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args()
    if args.gateway:
        base_url = f"{args.gateway.rstrip('/')}/sessions/plain-{uuid.uuid4().hex[:12]}/v1"
    elif os.environ.get("OPENAI_BASE_URL"):
        base_url = os.environ["OPENAI_BASE_URL"]
    else:
        ap.error("give --gateway, or set OPENAI_BASE_URL to a session's URL")
    if args.prompt is None:
        ap.error("give --prompt, or set TIDAL_INSTRUCTION")
    args.workdir.mkdir(parents=True, exist_ok=True)
    answer = run(base_url, args.model, args.prompt, args.workdir, args.max_turns)
    print(f"session {base_url}: answer {answer!r}")


if __name__ == "__main__":
    main()
