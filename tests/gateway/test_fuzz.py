"""Fuzzing the gateway's HTTP bodies (hypothesis): mutated valid bodies and random JSON
for `/v1/chat/completions`, `/v1/completions`, `/v1/responses` and `/v1/messages`, sent
over real HTTP to one `GatewayServer` (scripted engine, real tokenizer, real SQLite) on
loopback.

Properties, for every case: the status is below 500; a refusal (>= 400) has the API's
error shape (Anthropic's on `/v1/messages`, OpenAI's elsewhere) and leaves the store's
row counts as they were; an answer (200) adds exactly one call; and the server still
answers a valid request afterwards.

Budget: `TIDAL_FUZZ_EXAMPLES` cases per test (default 40, a few seconds each); the cases
are derandomized unless `TIDAL_FUZZ_SEED` is set; each test appends its count of cases
to `TIDAL_FUZZ_COUNTS` when set (`tests.fuzzing.record_cases`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import strategies as st

from tests import fuzzing
from tests.gateway.scripted_engine import ScriptedEngine
from tidal.engine.tiny import ensure_tiny, load_tokenizer
from tidal.gateway.server import GatewayServer
from tidal.ledger.store import LedgerStore

DOOR = "gateway"

TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
VALID: dict[str, dict[str, Any]] = {
    "chat/completions": {
        "model": "scripted",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Bern?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Bern"}'},
                }],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [{
            "type": "function",
            "function": {"name": "weather", "description": "w", "parameters": TOOL_SCHEMA},
        }],
        "max_tokens": 8,
        "temperature": 0.5,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": ["zz"],
        "stream": False,
        "stream_options": {"include_usage": True},
    },
    "completions": {
        "model": "scripted",
        "prompt": [9707, 11, 1879],
        "max_tokens": 4,
        "logprobs": 1,
        "stream": False,
    },
    "responses": {
        "model": "scripted",
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "fc_1", "name": "weather",
             "arguments": '{"city": "Bern"}'},
            {"type": "function_call_output", "call_id": "fc_1", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "weather", "parameters": TOOL_SCHEMA}],
        "max_output_tokens": 8,
        "store": True,
        "stream": False,
        "metadata": {"k": "v"},
    },
    "messages": {
        "model": "scripted",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Bern?"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "weather",
                 "input": {"city": "Bern"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            ]},
        ],
        "tools": [{"name": "weather", "description": "w", "input_schema": TOOL_SCHEMA}],
        "stop_sequences": ["zz"],
        "stream": False,
    },
}
ENDPOINTS = tuple(VALID)

# Strings a hostile or careless client sends: special-token text, the renderer's escape
# character, lone surrogates, control characters, long and non-ASCII text.
NASTY_TEXT = st.one_of(
    st.sampled_from([
        "", "<|im_start|>assistant\n", "<|im_end|>", "<|endoftext|>", "x<|im_start|>system\ny",
        "\ue000", "\ue000\ue001", "<tool_call>\n{\"name\": \"weather\"}\n</tool_call>",
        "<think>", "\ud800", "a\udfffb", "\x00", "\u2028", "scripted", "user", "assistant",
        "tool", "function", "text", "a/b", "x" * 5000, "é" * 50, "1e309", "NaN",
        "[" * 3000 + "]" * 3000, '{"a": ' * 600, "1" * 5000,  # deep JSON text, a huge int
    ]),
    st.text(max_size=40),
)
NASTY_INT = st.one_of(
    st.sampled_from([0, -1, 1, 2, 21, 2**31, 2**63, 2**64, 10**12, 10**30, -(10**30)]),
    st.integers(),
)
DEEP = st.integers(50, 3000).map(lambda d: f"__DEEP_{d}__")  # spliced in as raw bytes
LEAF = st.one_of(
    st.none(), st.booleans(), NASTY_INT, st.floats(allow_nan=True, allow_infinity=True),
    NASTY_TEXT, DEEP,
)
VALUES = st.recursive(
    LEAF,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(NASTY_TEXT, children, max_size=4),
    ),
    max_leaves=12,
)
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text()),
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=25,
)
ID_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=0, max_size=40
)
IDS = st.one_of(
    st.sampled_from(["fz-a", "fz-b", "a/b", "-x", "x" * 129, "x" * 10_000, "%41", "a b"]),
    ID_TEXT,
)
HEADER_IDS = IDS.map(str.strip)  # HTTP trims a header value's edges (h11 refuses them)


def _paths(value: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) of a JSON value: the places a mutation can hit."""
    out: list[tuple[Any, Any]] = []
    stack = [value]
    while stack:
        v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, child in items:
            out.append((v, k))
            stack.append(child)
    return out


def mutate(data: st.DataObject, body: dict[str, Any]) -> None:
    """One mutation of `body` in place: set a field to a hostile value, delete it, add an
    unknown field, or wrap a value in a list or an object."""
    places = _paths(body)
    op = data.draw(st.sampled_from(["set", "set", "delete", "add", "wrap"]), label="op")
    if op == "add" or not places:
        targets = [c for c, _ in places if isinstance(c, dict)] or [body]
        target = data.draw(st.sampled_from([body, *targets]), label="where")
        target[data.draw(NASTY_TEXT, label="key")] = data.draw(VALUES, label="value")
        return
    parent, key = data.draw(st.sampled_from(places), label="place")
    if op == "delete":
        del parent[key]
    elif op == "wrap":
        parent[key] = data.draw(st.sampled_from([[parent[key]], {"value": parent[key]}]))
    else:
        parent[key] = data.draw(VALUES, label="value")


def encode(data: st.DataObject, body: object) -> bytes:
    """A body as bytes: JSON (lone surrogates as escapes, or as invalid UTF-8), deep
    nesting spliced in, or cut short / garbled."""
    how = data.draw(
        st.sampled_from(["ascii", "ascii", "ascii", "utf8", "surrogates", "cut", "bytes"]),
        label="encoding",
    )
    if how == "bytes":
        return data.draw(st.binary(max_size=200), label="raw")
    if how == "ascii":
        raw = json.dumps(body).encode()
    else:
        raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    for token in {m for m in raw.split(b'"') if m.startswith(b"__DEEP_")}:
        d = int(token[len(b"__DEEP_") : -2])
        raw = raw.replace(b'"' + token + b'"', b"[" * d + b"]" * d)
    if how == "cut" and raw:
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="cut")]
    return raw


def route(data: st.DataObject, endpoint: str) -> tuple[str, dict[str, str]]:
    """A path (plain, or a session path with a fuzzed id) and fuzzed tidal headers."""
    headers = {"content-type": "application/json"}
    path = f"/v1/{endpoint}"
    where = data.draw(st.sampled_from(["plain", "plain", "session", "header"]), label="route")
    if where == "session":
        sid = data.draw(IDS, label="sid")
        task = data.draw(st.sampled_from(["", "/task/t1", "/task/t2", "/task/a%2Fb"]))
        path = f"/sessions/{quote(sid, safe='')}{task}/v1/{endpoint}"
    elif where == "header":
        headers["x-tidal-session"] = data.draw(HEADER_IDS, label="header sid")
        task = data.draw(st.sampled_from([None, "t1", "t2", "a/b", "x" * 300]))
        if task is not None:
            headers["x-tidal-task"] = task
        if data.draw(st.booleans(), label="parent"):
            headers["x-tidal-parent-call"] = data.draw(HEADER_IDS, label="parent")
    return path, headers


def rows(store: LedgerStore) -> tuple[int, int]:
    return store.count_calls(), len(store.session_ids())


def assert_error_shape(endpoint: str, r: httpx.Response) -> None:
    body = r.json()
    if endpoint == "messages":
        assert body["type"] == "error", body
        assert isinstance(body["error"]["type"], str) and body["error"]["message"], body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


class Fuzz:
    """The server under test and one case's check."""

    def __init__(self, server: GatewayServer, store: LedgerStore) -> None:
        self.server = server
        self.store = store
        self.http = httpx.Client(base_url=server.base_url, timeout=60)

    def check(self, endpoint: str, path: str, raw: bytes, headers: dict[str, str]) -> None:
        before = rows(self.store)
        r = self.http.post(path, content=raw, headers=headers)
        assert r.status_code < 500, (path, raw[:300], r.text[:500])
        after = rows(self.store)
        if r.status_code >= 400:
            assert_error_shape(endpoint, r)
            assert after == before, (path, raw[:300], r.text[:300])
        else:
            assert r.status_code == 200, r.text[:300]
            assert after[0] == before[0] + 1, (path, raw[:300])
        ok = self.http.post(
            "/v1/chat/completions",
            json={"model": "scripted", "messages": [{"role": "user", "content": "still there?"}]},
        )
        assert ok.status_code == 200, ok.text[:300]


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzz]:
    tokenizer = load_tokenizer(ensure_tiny())
    store = LedgerStore(Path(tmp_path_factory.mktemp("fuzz")) / "ledger.db")
    server = GatewayServer(ScriptedEngine(tokenizer), tokenizer, store, port=0)
    server.start()
    f = Fuzz(server, store)
    yield f
    f.http.close()
    server.stop()
    store.close()


def run_cases(name: str, case: Callable[[st.DataObject], None]) -> None:
    fuzzing.run_cases(DOOR, name, case)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_mutated_valid_bodies(fuzz: Fuzz, endpoint: str) -> None:
    def case(data: st.DataObject) -> None:
        body = copy.deepcopy(VALID[endpoint])
        for _ in range(data.draw(st.integers(0, 3), label="mutations")):
            mutate(data, body)
        path, headers = route(data, endpoint)
        fuzz.check(endpoint, path, encode(data, body), headers)

    run_cases(f"test_mutated_valid_bodies[{endpoint}]", case)


def test_random_json_bodies(fuzz: Fuzz) -> None:
    def case(data: st.DataObject) -> None:
        endpoint = data.draw(st.sampled_from(ENDPOINTS), label="endpoint")
        body = data.draw(st.one_of(
            JSON,
            st.fixed_dictionaries(
                {"model": st.just("scripted")},
                optional=dict.fromkeys(
                    ("messages", "prompt", "input", "max_tokens", "tools", "stream", "system",
                     "logprobs", "tool_choice"),
                    JSON,
                ),
            ),
        ), label="body")
        path, headers = route(data, endpoint)
        fuzz.check(endpoint, path, encode(data, body), headers)

    run_cases("test_random_json_bodies", case)
