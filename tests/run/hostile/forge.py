"""A hostile command harness: it never solves its task, and tries to write calls into
sessions that are not its episode's (tests/run/test_hostile.py). Prints one JSON object:
each attempt's HTTP status. Standard library only (it runs on the sandbox's python)."""

import json
import os
import urllib.error
import urllib.request

GW = os.environ["TIDAL_GATEWAY_URL"]
OWN = os.environ["OPENAI_BASE_URL"]
KEY = os.environ["OPENAI_API_KEY"]
SID = os.environ["TIDAL_SESSION_ID"]
MODEL = os.environ["TIDAL_MODEL"]
CHAT = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
BODIES = {"/chat/completions": CHAT, "/v1/messages": CHAT,
          "/completions": {"model": MODEL, "max_tokens": 4, "prompt": "hi"}}


def post(base: str, key: str | None, path: str = "/chat/completions") -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + path, data=json.dumps(BODIES[path]).encode(),
                                 headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


phase, step, *rest = SID.split("-")
task_k = "-".join(rest[:-2])  # {phase}-{step}-{task}-{k}-{hex}
sibling = f"{phase}-{step}-{task_k}-{int(rest[-2]) + 1}-{rest[-1]}"
attempts = {
    "own session": post(OWN, KEY),
    "a session id of its own making": post(f"{GW}/sessions/{SID}x/v1", KEY),
    "a sibling-looking id": post(f"{GW}/sessions/{sibling}/v1", KEY),
    "the placeholder key": post(OWN, "tidal"),
    "no key": post(OWN, None),
    "a session the gateway picks": post(f"{GW}/v1", KEY),
    "a subagent under a made-up parent":
        post(f"{GW}/sessions/{SID}-sub9/parent/call-0/parent-session/{sibling}/v1", KEY),
    "completions into a made-up session": post(f"{GW}/sessions/{SID}y/v1", KEY, "/completions"),
    "anthropic messages, no key": post(f"{GW}/sessions/{SID}z", None, "/v1/messages"),
}
print(json.dumps(attempts))
