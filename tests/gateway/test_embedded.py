"""The gateway over the real embedded engine (tiny random Qwen2): streaming, and 64
concurrent sessions x 20 calls through the stock openai client with no record lost."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tidal.engine.embedded import EmbeddedEngine
from tidal.gateway.server import GatewayServer
from tidal.gateway.verify import verify_store
from tidal.ledger.store import LedgerStore


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir: Path) -> Iterator[EmbeddedEngine]:
    eng = EmbeddedEngine(tiny_dir, model_name="tiny", max_batch_size=64, batch_wait_s=0.02, seed=0)
    yield eng
    eng.close()


@pytest.fixture
def live(tiny_engine: EmbeddedEngine, tokenizer: Any, tmp_path: Path) -> Iterator[GatewayServer]:
    store = LedgerStore(tmp_path / "ledger.db")
    srv = GatewayServer(tiny_engine, tokenizer, store, default_max_tokens=4)
    srv.start()
    yield srv
    srv.stop()
    store.close()


def test_streaming_matches_ledger(live: GatewayServer) -> None:
    client = openai.OpenAI(base_url=live.session_url("st"), api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            logprobs=True,
            max_tokens=12,
            stream_options={"include_usage": True},
            seed=3,
        )
    )
    store = live.gateway.store
    (call,) = list(store.iter_full_calls())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    lps = [
        e.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    out = call.output_ids
    visible = out[:-1] if call.finish_reason == "stop" else out
    assert text == live.gateway.renderer.decode(visible.tolist())
    assert np.allclose(lps, call.output_logprobs)
    assert chunks[-1].usage.completion_tokens == out.shape[0] <= 12
    assert chunks[-1].choices == []
    assert call.finish_reason in ("stop", "length")


def test_top_logprobs_over_http(live: GatewayServer) -> None:
    """The stock client gets OpenAI's `top_logprobs`: k alternatives per token, most
    likely first, the same in a stream; asking without `logprobs` is a clear error."""
    client = openai.OpenAI(base_url=live.session_url("top"), api_key="x", max_retries=0)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
           "seed": 7, "logprobs": True, "top_logprobs": 3}
    r = client.chat.completions.create(**ask)
    entries = r.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 3 for e in entries)
    for e in entries:
        values = [a.logprob for a in e.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] >= e.logprob - 1e-5
        assert all(bytes(a.bytes) == a.token.encode() for a in e.top_logprobs)
        if e.token in [a.token for a in e.top_logprobs]:
            assert any(abs(a.logprob - e.logprob) < 1e-5 for a in e.top_logprobs)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [[a.token for a in e.top_logprobs] for e in streamed] == [
        [a.token for a in e.top_logprobs] for e in entries
    ]  # same seed, same tokens
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(**{**ask, "logprobs": False})
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be in"):
        client.chat.completions.create(**{**ask, "top_logprobs": 21})
    c = client.completions.create(model="tiny", prompt="hi", max_tokens=4, seed=7, logprobs=2)
    lp = c.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    assert len(lp.top_logprobs) == len(lp.tokens) and all(len(d) <= 2 for d in lp.top_logprobs)
    parts = list(client.completions.create(model="tiny", prompt="hi", max_tokens=4, seed=7,
                                           logprobs=2, stream=True))
    per_chunk = [ch.choices[0].logprobs for ch in parts if ch.choices and ch.choices[0].logprobs]
    assert [x.token_logprobs[0] for x in per_chunk] == lp.token_logprobs
    assert [x.top_logprobs[0] for x in per_chunk] == lp.top_logprobs


def test_64_sessions_x_20_calls(live: GatewayServer) -> None:
    """Each session runs 4 conversations of 5 turns (so prompts stay short on 2 CPU
    cores); every turn after a conversation's first goes through the TITO splice."""
    n_sessions, n_calls, turns = 64, 20, 5

    def run(k: int) -> list[str]:
        client = openai.OpenAI(
            base_url=live.session_url(f"conc-{k}"), api_key="x", max_retries=0, timeout=300
        )
        ids = []
        msgs: list[Any] = []
        for i in range(n_calls):
            if i % turns == 0:
                msgs = [{"role": "system", "content": f"agent {k}"}]
            msgs.append({"role": "user", "content": f"step {i}"})
            r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
            ids.append(r.tidal["call_id"])  # type: ignore[attr-defined]
            msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        return ids

    with ThreadPoolExecutor(n_sessions) as pool:
        results = list(pool.map(run, range(n_sessions)))
    store = live.gateway.store
    assert store.count_calls() == n_sessions * n_calls
    for k, ids in enumerate(results):
        log = store.call_log(f"conc-{k}")
        assert [sc.call_id for sc in log.calls] == ids  # every call, in order, none lost
    rep = verify_store(store)
    assert rep.ok, rep.problems[:5]
    assert rep.calls == n_sessions * n_calls
    # Every later turn continued the previous one: the history was never re-rendered.
    conts = [c.metadata["tito"]["continues"] for c in store.iter_full_calls()]
    assert sum(c is not None for c in conts) == n_sessions * n_calls * (turns - 1) // turns


def test_a_session_continued_reads_its_history_from_the_prefix_cache(
    live: GatewayServer,
) -> None:
    """The second call of a session re-sends the first call's history; the gateway builds
    its prompt from the recorded tokens, so the engine finds them all in its prefix cache,
    and OpenAI's `usage.prompt_tokens_details.cached_tokens` says so."""
    client = openai.OpenAI(base_url=live.session_url("px"), api_key="x", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "list the files " * 8}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                           seed=1)
    # At most the chat template's head, shared with other sessions' calls: not the message.
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 16
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and now?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                            seed=2)
    calls = list(live.gateway.store.iter_full_calls())
    c1 = next(c for c in calls if c.call_id == first.tidal["call_id"])
    # All of call 1's context but its last sampled token (never run through the model).
    want = c1.prompt_ids.shape[0] + c1.output_ids.shape[0] - 1
    assert second.usage.prompt_tokens_details.cached_tokens == want
    assert second.usage.prompt_tokens > want
