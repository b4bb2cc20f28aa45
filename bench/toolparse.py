"""How often a real model's tool calls parse: Qwen2.5-Coder-1.5B-Instruct behind the
gateway, asked to use a tool, with the lenient parsing rules and without.

Each session: the stock `openai` client, the gateway on loopback (embedded engine, the
real model built from its PyPI wheels by `tidal.engine.pretrained`), two tools offered
(set_flag, get_weather), one of four requests that each call for one tool, temperature
0.7, a seed per session. The gateway parses with its default parsers for the model's
template (hermes, fenced, json) and the lenient rules; the same recorded outputs are then
parsed again without them, so both rates are of the same outputs. A call "parses" when
the parser finds a call to the tool the request names.

Run: `.venv/bin/python bench/toolparse.py [--sessions 20] [--fixtures PATH]` (needs
`pip install -e '.[real]'`; the first run builds the model, ~4 minutes); prints JSON.
`--fixtures` writes the outputs (the test fixtures of tests/gateway/test_toolparsers.py).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "set_flag", "description": "Enable or disable a feature flag.",
        "parameters": {"type": "object", "properties": {
            "name": {"type": "string"}, "on": {"type": "boolean"}}, "required": ["name", "on"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
]
ASKS = [
    ("set_flag", "Use set_flag to disable the feature flag named beta."),
    ("get_weather", "What is the weather in Paris right now? Use the tool."),
    ("set_flag", "Turn on the dark_mode flag."),
    ("get_weather", "Check the current weather in Oslo for me."),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--system", default=None,
                    help="a system message first (as the OpenAI Agents SDK sends its "
                    "agent's instructions); default none: the template's own")
    args = ap.parse_args()

    import openai

    from tidal.engine.embedded import EmbeddedEngine
    from tidal.engine.tiny import load_tokenizer, resolve_model
    from tidal.gateway.server import GatewayServer
    from tidal.gateway.toolcalls import ToolSet, parse_output
    from tidal.ledger.store import LedgerStore

    t0 = time.perf_counter()
    model_dir = resolve_model(args.model)
    build_s = time.perf_counter() - t0
    engine = EmbeddedEngine(str(model_dir), model_name="m", seed=0)
    tokenizer = load_tokenizer(model_dir)
    offered = ToolSet({t["function"]["name"]: t["function"]["parameters"] for t in TOOLS})
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = LedgerStore(Path(tmp) / "bench.db")
        with GatewayServer(engine, tokenizer, store) as srv:
            parsers = srv.gateway.tool_parsers
            for k in range(args.sessions):
                want, ask = ASKS[k % len(ASKS)]
                client = openai.OpenAI(base_url=srv.session_url(f"s{k}"), api_key="x",
                                       max_retries=0, timeout=600)
                t = time.perf_counter()
                msgs = [{"role": "user", "content": ask}]
                if args.system:
                    msgs.insert(0, {"role": "system", "content": args.system})
                r = client.chat.completions.create(
                    model="m", messages=msgs, tools=TOOLS,  # type: ignore[arg-type]
                    temperature=0.7, seed=k, max_tokens=args.max_tokens,
                )
                (call,) = [store.call_log(f"s{k}").full_call(sc.call_id)
                           for sc in store.call_log(f"s{k}").calls]
                text = call.output_text.removesuffix("<|im_end|>")
                strict = parse_output(text, parsers, offered, lenient=False)
                lenient_calls = [tc.function.name for tc in r.choices[0].message.tool_calls or []]
                rows.append({
                    "session": k, "want": want, "text": text,
                    "lenient": want in lenient_calls,
                    "strict": want in [c.name for c in strict.tool_calls],
                    "formats": call.metadata["tool_call_formats"],
                    "unparsed": (call.metadata.get("tool_parse") or {}).get("reason"),
                    "seconds": round(time.perf_counter() - t, 1),
                })
                print(json.dumps(rows[-1]), flush=True)
        store.close()
    engine.close()
    n = max(len(rows), 1)
    formats: dict[str, int] = {}
    for r in rows:
        for f in r["formats"]:
            formats[f] = formats.get(f, 0) + 1
    result = {
        "bench": "tool_call_parse_rate",
        "model": args.model,
        "system": args.system,
        "sessions": len(rows),
        "temperature": 0.7,
        "parse_rate_lenient": round(sum(r["lenient"] for r in rows) / n, 3),
        "parse_rate_strict": round(sum(r["strict"] for r in rows) / n, 3),
        "formats_parsed": formats,
        "unparsed": [r["unparsed"] for r in rows if r["unparsed"]],
        "build_s": round(build_s, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "cpus": os.cpu_count(),
    }
    if args.fixtures is not None:
        args.fixtures.parent.mkdir(parents=True, exist_ok=True)
        args.fixtures.write_text(json.dumps(
            [{"ask": ASKS[r["session"] % len(ASKS)][1], "seed": r["session"], "text": r["text"],
              "expect": "call" if r["lenient"] else "prose"} for r in rows], indent=1) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
