"""The standard batch's fast decode step (`fused.py`): the tokens and logprobs of
transformers' forward, up to float noise, for Qwen2 (the tiny model: q/k/v biases) and
Llama (no biases, grouped heads); its fused copies follow every change of the weights;
models it does not support keep transformers' forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine.reference import forward_logprobs
from tidal.engine import decode_attention, fused
from tidal.engine.base import SamplingParams, Weights
from tidal.engine.batch import DecodeBatch, SequenceRequest, SequenceResult
from tidal.engine.embedded import EmbeddedEngine
from tidal.engine.model import load_policy_model
from tidal.engine.sampling import processed_logprobs, sample_tokens

ATOL = 1e-4  # as test_embedded.py: fp32 noise between a KV-cached loop and one forward

PROMPTS = [
    list(range(1000, 1017)),
    [151644, 872, 198, 9707, 1879],
    list(range(5000, 5040, 3)),
]


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Any:
    return load_policy_model(tiny_dir)


@pytest.fixture(scope="module")
def llama() -> Any:
    """A random Llama (no biases; 4 query heads on 2 KV heads), as the loader sets it up."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _run(model: Any, prompts: list[list[int]], steps: int = 10) -> dict[int, SequenceResult]:
    """Two prompts admitted, two steps, the rest joins (a merged, left-padded batch)."""
    reqs = [SequenceRequest(tuple(p), SamplingParams(max_tokens=steps), seed=7 + i)
            for i, p in enumerate(prompts)]
    batch = DecodeBatch(model, max_context=256, pad_id=0)
    batch.admit(reqs[:2], [0, 1])
    batch.step()
    batch.step()
    batch.admit(reqs[2:], list(range(2, len(reqs))))
    done: dict[int, SequenceResult] = {}
    while len(batch):
        batch.step()
        done.update(dict(batch.pop_finished()))
    return done


def _prompts(model: Any) -> list[list[int]]:
    vocab = int(model.config.vocab_size)
    return [[t % vocab for t in p] for p in PROMPTS]


@pytest.mark.parametrize("name", ["tiny", "llama"])
def test_fast_decode_samples_what_transformers_forward_does(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = request.getfixturevalue(name)
    assert fused.fast_decoder(model) is not None
    calls = []
    real = fused.FastDecoder.decode
    monkeypatch.setattr(fused.FastDecoder, "decode",
                        lambda self, *a: calls.append(1) or real(self, *a))
    prompts = _prompts(model)
    fast = _run(model, prompts)
    assert calls  # the fast step ran
    monkeypatch.setattr(fused, "fast_decoder", lambda model, **kw: None)
    slow = _run(model, prompts)
    for i, prompt in enumerate(prompts):
        assert fast[i].output_ids == slow[i].output_ids
        np.testing.assert_allclose(fast[i].logprobs, slow[i].logprobs, atol=ATOL, rtol=0)
        ref = forward_logprobs(model, prompt, fast[i].output_ids)  # one full forward
        np.testing.assert_allclose(fast[i].logprobs, ref.numpy(), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("packed", "attention", "small_ops"),
                         [(True, "kernel", "fused"), (False, "kernel", "fused"),
                          (True, "sdpa", "fused"), (True, "kernel", "torch"),
                          (False, "sdpa", "torch")])
def test_fast_step_logits_equal_a_full_forward(tiny: Any, packed: bool, attention: Any,
                                               small_ops: Any) -> None:
    """One decode step's logits, packed oneDNN weights or `F.linear` on the concatenated
    ones, the attention kernel or SDPA, the fused small ops or torch's, against
    transformers' forward over each whole sequence, padded rows included."""
    if packed and not fused._onednn_ok(torch.float32):
        pytest.skip("oneDNN's packed linear is not available here")
    decoder = fused.FastDecoder(tiny, packed=packed, attention=attention, small_ops=small_ops)
    assert (decoder.attention is None) == (attention == "sdpa")
    assert (decoder.glue is decode_attention.TORCH_GLUE) == (small_ops == "torch")
    reqs = [SequenceRequest(tuple(p), SamplingParams(max_tokens=4), seed=i)
            for i, p in enumerate(PROMPTS)]
    batch = DecodeBatch(tiny, max_context=256, pad_id=151643)
    batch.admit(reqs, [0, 1, 2])
    last = batch._last.clone()
    batch._mask = torch.cat([batch._mask, batch._mask.new_ones((3, 1))], dim=-1)
    with torch.inference_mode():
        logits = decoder.decode(last, batch._next_pos, batch._mask, batch._cache.layers)
        for i, p in enumerate(PROMPTS):
            want = tiny(input_ids=torch.tensor([[*p, int(last[i])]])).logits[0, -1]
            torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4)


def test_fast_decoder_follows_weight_updates(tiny_dir: Path) -> None:
    """`EmbeddedEngine.update_weights` (in process, as the trainer sends LoRA-merged
    weights) rebuilds the fused copies: the engine samples from the new weights."""
    params = SamplingParams(max_tokens=8, seed=2)
    with EmbeddedEngine(tiny_dir) as eng:
        decoder = fused.fast_decoder(eng.model)
        assert decoder is not None
        before = eng.generate([PROMPTS[0]], params)[0]
        state = {k: v.clone() for k, v in eng.model.state_dict().items()}
        gen = torch.Generator().manual_seed(0)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if k.endswith("proj.weight")
               else v for k, v in state.items()}
        eng.update_weights(Weights.of_state_dict(new), 1)
        assert not decoder.stale
        after = eng.generate([PROMPTS[0]], params)[0]
        assert not np.allclose(before.logprobs, after.logprobs, atol=1e-3)
        ref = forward_logprobs(eng.model, PROMPTS[0], after.output_ids.tolist())
        np.testing.assert_allclose(after.logprobs, ref.numpy(), atol=ATOL, rtol=0)
        eng.update_weights(Weights.of_state_dict(state), 2)
        again = eng.generate([PROMPTS[0]], params)[0]
        np.testing.assert_array_equal(again.output_ids, before.output_ids)
        np.testing.assert_allclose(again.logprobs, before.logprobs, atol=ATOL, rtol=0)


def test_fast_decoder_sees_direct_changes(llama: Any) -> None:
    """Parameters written in place (the version counter moves) or replaced are seen: the
    next decode step rebuilds the copies and samples from the new weights."""
    prompts = _prompts(llama)
    decoder = fused.fast_decoder(llama)
    assert decoder is not None
    up = llama.model.layers[1].mlp.up_proj
    old = up.weight.detach().clone()
    try:
        with torch.no_grad():
            up.weight.mul_(1.5)
        assert decoder.written and decoder.stale
        got = _run(llama, prompts, steps=6)
        assert not decoder.stale
        for i, prompt in enumerate(prompts):
            ref = forward_logprobs(llama, prompt, got[i].output_ids)
            np.testing.assert_allclose(got[i].logprobs, ref.numpy(), atol=ATOL, rtol=0)
        up.weight = torch.nn.Parameter(old)  # a new object: only the thorough check sees it
        assert not decoder.written and decoder.stale
        assert fused.fast_decoder(llama) is decoder and not decoder.stale
    finally:
        up.weight = torch.nn.Parameter(old)
        fused.refresh(llama)


def test_unsupported_models_keep_transformers_forward() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1,
                                       n_head=2)).eval()
    assert "model_type" in (fused.unsupported(model) or "")
    assert fused.fast_decoder(model) is None
    reqs = [SequenceRequest((1, 2, 3), SamplingParams(max_tokens=3), seed=0)]
    batch = DecodeBatch(model, max_context=64, pad_id=0)
    batch.admit(reqs, [0])
    while len(batch):
        batch.step()
    [(_, res)] = batch.pop_finished()
    assert len(res.output_ids) == 3


def test_sampling_shortcuts_change_no_bit() -> None:
    """Temperature 1 skips the division, and no greedy row skips the argmax: the same
    bits as doing both."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=gen) * 4
    ones, zeros = torch.ones(4), torch.zeros(4, dtype=torch.long)
    lp = processed_logprobs(logits, ones, zeros, ones)
    assert torch.equal(lp, (logits / ones[:, None]).log_softmax(-1))
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens = sample_tokens(lp, ones <= 0, gens)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    mixed = sample_tokens(lp, torch.tensor([False, True, False, False]), gens)
    assert mixed[1] == lp[1].argmax()
    assert torch.equal(tokens[[0, 2, 3]], mixed[[0, 2, 3]])


def test_rotary_table_is_the_models_rotary(tiny: Any) -> None:
    """The decode step reads rotary's cos and sin from a table the model's rotary embedding
    made once, grown past its first 1024 positions when a row gets there."""
    decoder = fused.FastDecoder(tiny)
    positions = torch.tensor([0, 5, 1023, 1024, 3000, 7])
    h = torch.zeros(len(positions), 1, int(tiny.config.hidden_size))
    cos_ref, sin_ref = tiny.model.rotary_emb(h, positions[:, None])
    cos, sin = decoder._cos_sin(positions)
    torch.testing.assert_close(cos, cos_ref[:, 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref[:, 0], rtol=1e-6, atol=1e-6)
