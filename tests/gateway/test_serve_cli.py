"""`tidal serve` with bad options (issue 27): every option is checked and the port bound
before a model loads or the store is created; a refusal is a usage error (exit 2) naming
the option, with no URL printed, no store created and an existing store's bytes as they
were. The option refusals run the real `tidal` app in process (typer's CliRunner): they
end before anything would serve. A port held by a socket of the test, and `--port 0`,
run `tidal serve` as a real process (the scripted engine: real tokenizer, no model)."""

from __future__ import annotations

import hashlib
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import typer
from click.testing import CliRunner, Result

from tidal.cli import app
from tidal.ledger.store import LedgerStore

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "tests.gateway.worker_engines:scripted"
runner = CliRunner()
CLI = typer.main.get_command(app)


def flat(text: str) -> str:
    """The text of an error, rich's box and line wrapping taken out."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def serve_in_process(*args: str | Path) -> Result:
    res = runner.invoke(CLI, ["serve", *(str(a) for a in args)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    return res


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tidal_serve(*args: str | Path) -> subprocess.Popen[str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "tidal.cli", "serve", *(str(a) for a in args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another socket (the test's) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.parametrize(("args", "option", "message"), [
    (["--port", "70000"], "'--port'", "less than or equal to 65535"),
    (["--port", "-1"], "'--port'", "greater than or equal to 0"),
    (["--max-tokens", "-3"], "'--max-tokens'", "greater than or equal to 1"),
    (["--max-tokens", "0"], "'--max-tokens'", "greater than or equal to 1"),
    (["--prefix-cache-mb", "-1"], "'--prefix-cache-mb'", "greater than or equal to 0"),
    (["--prefix-cache-mb", "nan"], "'--prefix-cache-mb'", ""),
    (["--device", "tpu"], "--device", "'tpu' is not a device: expected cpu, cuda"),
    (["--device", "cuda:99"], "--device", "'cuda:99'"),
    (["--model", "/nonexistent/model-dir"], "--model", "no checkpoint directory at"),
    (["--engine", "no_such_module_zz:make"], "--engine", "cannot import 'no_such_module_zz'"),
    (["--tool-parser", "nonesuch"], "--tool-parser", "nonesuch"),
])
def test_bad_option_is_refused_before_anything_starts(
    tmp_path: Path, args: list[str], option: str, message: str
) -> None:
    store = tmp_path / "ledger.db"
    res = serve_in_process("--store", store, "--port", "0", *args)
    text = flat(res.output)
    assert res.exit_code == 2, res.output
    assert f"Invalid value for {option}" in text and message in text
    assert "tidal gateway:" not in res.output  # no URL
    assert not store.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda(tmp_path: Path) -> None:
    res = serve_in_process("--store", tmp_path / "l.db", "--device", "cuda")
    assert res.exit_code == 2
    assert "'cuda': CUDA is not available here" in flat(res.output)
    assert not (tmp_path / "l.db").exists()


def test_store_that_is_not_a_ledger_is_left_as_it_was(tmp_path: Path) -> None:
    store = tmp_path / "notes.db"
    store.write_text("these are my notes, not SQLite\n" * 100)
    before = sha(store)
    res = serve_in_process("--store", store)
    assert res.exit_code == 2
    assert f"Invalid value for --store: {store} is not a readable tidal ledger store" in flat(
        res.output)
    assert sha(store) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.db"]  # no -wal, no -shm


def test_store_that_is_a_directory(tmp_path: Path) -> None:
    res = serve_in_process("--store", tmp_path)
    assert res.exit_code == 2
    assert f"{tmp_path} is a directory, not a ledger store" in flat(res.output)


def test_store_under_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    res = serve_in_process("--store", f / "ledger.db")
    assert res.exit_code == 2
    assert f"cannot create {f / 'ledger.db'}: {f} is not a writable directory" in flat(
        res.output)
    assert f.read_text() == "x"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_port_in_use_fails_before_the_model_and_the_store(
    tmp_path: Path, held_port: int, workers: str
) -> None:
    store = tmp_path / "ledger.db"
    proc = tidal_serve("--port", str(held_port), "--store", store, "--engine", ENGINE,
                       "--workers", workers)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert f"cannot listen on 127.0.0.1:{held_port}: Address already in use" in flat(err)
    assert "Traceback" not in err
    assert out == ""  # no URL: a harness reading it records nowhere
    assert not store.exists()


def test_port_0_prints_the_port_really_bound(tmp_path: Path) -> None:
    store = tmp_path / "ledger.db"
    proc = tidal_serve("--port", "0", "--store", store, "--engine", ENGINE)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout or ()],
                     daemon=True).start()
    try:
        line = lines.get(timeout=120)
        m = re.match(r"tidal gateway: http://127\.0\.0\.1:(\d+)/v1 ", line)
        assert m, line
        port = int(m.group(1))
        assert port != 0
        t0 = time.monotonic()
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)  # serving: no retry
        assert r.status_code == 200 and r.json()["ok"] is True
        assert time.monotonic() - t0 < 30
        assert store.exists()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_vllm_server_not_reachable(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    store = tmp_path / "ledger.db"
    res = serve_in_process("--store", store, "--port", "0", "--engine", "vllm",
                           "--engine-url", url)
    assert res.exit_code == 1
    assert f"error: cannot reach vLLM at {url}" in res.output
    assert "tidal gateway:" not in res.output and not store.exists()


def test_api_key_required_when_asked(tmp_path: Path) -> None:
    """`--api-key` (repeatable): a call without one of the keys is 403 and records
    nothing; with one it is served. Without `--api-key` no key is checked (above)."""
    store = tmp_path / "ledger.db"
    proc = tidal_serve("--port", "0", "--store", store, "--engine", ENGINE,
                       "--api-key", "k-one", "--api-key", "k-two")
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout or ()],
                     daemon=True).start()
    try:
        m = re.match(r"tidal gateway: (http://127\.0\.0\.1:\d+)/v1 ", lines.get(timeout=120))
        assert m
        url = f"{m.group(1)}/sessions/s-1/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        for headers in ({}, {"Authorization": "Bearer k-three"}):
            r = httpx.post(url, json=body, headers=headers, timeout=60)
            assert r.status_code == 403, r.text
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer k-two"},
                          timeout=60).status_code == 200
        assert httpx.post(url, json=body, headers={"x-api-key": "k-one"},
                          timeout=60).status_code == 200
        with LedgerStore(store) as led:
            assert led.count_calls() == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_empty_api_key_is_refused(tmp_path: Path) -> None:
    res = serve_in_process("--api-key", " ", "--store", tmp_path / "l.db", "--engine", ENGINE)
    assert res.exit_code == 2
    assert "--api-key" in flat(res.output) and "non-empty" in flat(res.output)
