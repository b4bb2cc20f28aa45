"""The fast batch (`fast_batch.py`) and its step (`fused.py`): the tokens and logprobs of
transformers' forward, up to float noise, for Qwen2 (the tiny model: q/k/v biases) and
Llama (no biases, grouped heads), prefill and decode, with and without cached prefixes;
its fused copies follow every change of the weights; models it does not support keep
transformers' forward."""

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
from tidal.engine.embedded import EmbeddedEngine, batch_class
from tidal.engine.fast_batch import FastDecodeBatch
from tidal.engine.model import load_policy_model
from tidal.engine.prefix import PrefixCache
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


def _run(model: Any, prompts: list[list[int]], steps: int = 10,
         kind: type[DecodeBatch] = FastDecodeBatch,
         prefix: PrefixCache | None = None) -> dict[int, SequenceResult]:
    """Two prompts admitted, two steps, the rest joins the running batch."""
    reqs = [SequenceRequest(tuple(p), SamplingParams(max_tokens=steps), seed=7 + i)
            for i, p in enumerate(prompts)]
    batch = kind(model, max_context=256, pad_id=0, prefix=prefix)
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
def test_fast_batch_samples_what_transformers_forward_does(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same tokens and logprobs as the standard batch (transformers' forward) and as
    one full forward per sequence; then each sequence's continuation, its history read
    from the prefix cache, as a fresh prefill of the whole of it."""
    model = request.getfixturevalue(name)
    assert batch_class(model) is FastDecodeBatch
    calls = []
    real = fused.FastDecoder.forward
    monkeypatch.setattr(fused.FastDecoder, "forward",
                        lambda self, *a: calls.append(1) or real(self, *a))
    prompts = _prompts(model)
    cache = PrefixCache(64 << 20)
    fast = _run(model, prompts, prefix=cache)
    assert calls  # the fast step ran
    slow = _run(model, prompts, kind=DecodeBatch)
    for i, prompt in enumerate(prompts):
        assert fast[i].output_ids == slow[i].output_ids
        np.testing.assert_allclose(fast[i].logprobs, slow[i].logprobs, atol=ATOL, rtol=0)
        ref = forward_logprobs(model, prompt, fast[i].output_ids)  # one full forward
        np.testing.assert_allclose(fast[i].logprobs, ref.numpy(), atol=ATOL, rtol=0)
    more = [p + fast[i].output_ids[:-1] + [7, 8, 9] for i, p in enumerate(prompts)]
    cached = _run(model, more, steps=5, prefix=cache)
    fresh = _run(model, more, steps=5)
    assert sum(cached[i].cached_tokens for i in cached) >= sum(map(len, prompts)) - 5
    for i in range(len(more)):
        assert fresh[i].cached_tokens == 0
        assert cached[i].output_ids == fresh[i].output_ids
        np.testing.assert_allclose(cached[i].logprobs, fresh[i].logprobs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["tiny", "llama"])
def test_prompts_joining_running_rows_are_prefilled_in_their_decode_step(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`FastDecodeBatch.step(requests)` prefills prompts that join running rows in those
    rows' decode forward (`folds`): one forward where admitting and then stepping took two,
    and every sequence samples what it did that way. With a prefix cache, a prompt that
    repeats another admitted with it still waits for that one's prefill (a second pass)
    and reads it from the cache."""
    model = request.getfixturevalue(name)
    vocab = int(model.config.vocab_size)
    long = [(3 * t + 11) % vocab for t in range(100)]
    prompts = [*_prompts(model), long, long]
    real = fused.FastDecoder.forward

    def run(fold: bool) -> tuple[dict[int, SequenceResult], int]:
        calls: list[int] = []
        monkeypatch.setattr(fused.FastDecoder, "forward",
                            lambda self, *a: calls.append(1) or real(self, *a))
        reqs = [SequenceRequest(tuple(p), SamplingParams(max_tokens=6), seed=7 + i)
                for i, p in enumerate(prompts)]
        batch = FastDecodeBatch(model, max_context=256, pad_id=0, prefix=PrefixCache(64 << 20))
        batch.folds = fold
        batch.admit(reqs[:1], [0])
        batch.step()
        before = len(calls)
        batch.step(reqs[1:], list(range(1, len(reqs))))
        joining = len(calls) - before
        done: dict[int, SequenceResult] = dict(batch.pop_finished())
        while len(batch):
            batch.step()
            done.update(dict(batch.pop_finished()))
        return done, joining

    folded, n_folded = run(True)
    apart, n_apart = run(False)
    # the step they join in: the fold and the repeated prompt's second pass, against
    # two prefills and a decode step
    assert (n_folded, n_apart) == (2, 3)
    assert folded[4].cached_tokens >= 96 and folded[3].cached_tokens == 0
    for i in range(len(prompts)):
        assert folded[i].output_ids == apart[i].output_ids
        assert folded[i].cached_tokens == apart[i].cached_tokens
        np.testing.assert_allclose(folded[i].logprobs, apart[i].logprobs, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("packed", "attention", "small_ops"),
                         [(True, "kernel", "fused"), (False, "kernel", "fused"),
                          (True, "sdpa", "fused"), (True, "kernel", "torch"),
                          (False, "sdpa", "torch")])
def test_fast_step_logits_equal_a_full_forward(tiny: Any, packed: bool, attention: Any,
                                               small_ops: Any) -> None:
    """A prefill of three prompts (their tokens in one flat list, each prompt's region of
    the store elsewhere) and then one decode step, packed oneDNN weights or `F.linear` on
    the concatenated ones, the attention kernel or SDPA, the fused small ops or torch's,
    against transformers' forward over each whole sequence."""
    if packed and not fused._onednn_ok(torch.float32):
        pytest.skip("oneDNN's packed linear is not available here")
    decoder = fused.FastDecoder(tiny, packed=packed, attention=attention, small_ops=small_ops)
    assert (decoder.attention is None) == (attention == "sdpa")
    assert (decoder.glue is decode_attention.TORCH_GLUE) == (small_ops == "torch")
    config = tiny.config
    store = [(torch.zeros(200, decoder.n_kv, decoder.head_dim),
              torch.zeros(200, decoder.n_kv, decoder.head_dim))
             for _ in range(config.num_hidden_layers)]
    regions = [3, 60, 120]
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    starts = torch.cat([torch.full((len(p),), s) for s, p in zip(regions, PROMPTS, strict=True)])
    last = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    nxt = torch.tensor([11, 22, 33])
    with torch.inference_mode():
        first = decoder.forward(ids, positions, starts, store, last)
        step = decoder.forward(nxt, torch.tensor([len(p) for p in PROMPTS]),
                               torch.tensor(regions), store)
        for i, p in enumerate(PROMPTS):
            want = tiny(input_ids=torch.tensor([[*p, int(nxt[i])]])).logits[0]
            torch.testing.assert_close(first[i], want[-2], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(step[i], want[-1], atol=1e-4, rtol=1e-4)


def test_a_long_prefill_runs_in_chunks(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt longer than a chunk is prefilled chunk by chunk: the same logits."""
    from tidal.engine import fast_batch

    prompt = [(t * 7) % 5000 + 100 for t in range(150)]
    whole = _run(tiny, [prompt, prompt[:40]], steps=4)
    monkeypatch.setattr(fast_batch, "PREFILL_CHUNK", 32)
    chunked = _run(tiny, [prompt, prompt[:40]], steps=4)
    for i in (0, 1):
        assert whole[i].output_ids == chunked[i].output_ids
        np.testing.assert_allclose(whole[i].logprobs, chunked[i].logprobs, atol=ATOL, rtol=0)


def test_a_full_store_moves_the_live_regions(tiny: Any) -> None:
    """Sequences admitted while others run, until the store (4096 slots at first) fills:
    the live regions are moved into a new store mid-sequence, and every sequence samples
    what the standard batch does."""
    vocab = int(tiny.config.vocab_size)
    prompts = [[(i * 131 + t * 17) % vocab for t in range(190 + i)] for i in range(20)]
    reqs = [SequenceRequest(tuple(p), SamplingParams(max_tokens=40), seed=i)
            for i, p in enumerate(prompts)]

    def run(kind: type[DecodeBatch]) -> tuple[dict[int, SequenceResult], int]:
        batch = kind(tiny, max_context=256, pad_id=0)
        done: dict[int, SequenceResult] = {}
        moved = 0
        for i in range(0, len(reqs), 4):
            store = batch._store[0][0] if isinstance(batch, FastDecodeBatch) and len(batch) \
                else None
            batch.admit(reqs[i : i + 4], list(range(i, i + 4)))
            if store is not None and batch._store[0][0].data_ptr() != store.data_ptr():
                moved += 1
            for _ in range(12):
                batch.step()
            done.update(dict(batch.pop_finished()))
        while len(batch):
            batch.step()
            done.update(dict(batch.pop_finished()))
        return done, moved

    fast, moved = run(FastDecodeBatch)
    slow, _ = run(DecodeBatch)
    assert moved >= 1  # the store filled with sequences still running
    for i in range(len(reqs)):
        assert fast[i].output_ids == slow[i].output_ids
        np.testing.assert_allclose(fast[i].logprobs, slow[i].logprobs, atol=ATOL, rtol=0)


def test_the_store_follows_the_live_sequences(tiny: Any) -> None:
    """A batch that never empties, a short sequence joining every few steps: the store's
    retired regions are reclaimed and it stays at twice what the live ones need (a store
    that doubled at every move grew without bound over a run: 24 GB)."""
    vocab = int(tiny.config.vocab_size)
    batch = FastDecodeBatch(tiny, max_context=256, pad_id=0)
    sizes = set()
    for i in range(160):
        prompt = tuple((i * 7 + t) % vocab for t in range(60))
        batch.admit([SequenceRequest(prompt, SamplingParams(max_tokens=12), seed=i)], [i])
        for _ in range(3):
            batch.step()
        batch.pop_finished()
        sizes.add(int(batch._store[0][0].shape[0]))
    assert batch._used > 0 and sizes == {4096}  # 160 x 72 slots went through it
    while len(batch):  # emptied, then more than the store holds joins at once
        batch.step()
        batch.pop_finished()
    many = [SequenceRequest(tuple((i + t) % vocab for t in range(60)),
                            SamplingParams(max_tokens=12), seed=i) for i in range(64)]
    batch.admit(many, list(range(64)))
    assert batch._used == 64 * 72 and batch._capacity() == 2 * 64 * 72
    batch.step()


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
    assert batch_class(model) is DecodeBatch
    with pytest.raises(ValueError, match="no fast step for this model: model_type 'gpt2'"):
        FastDecodeBatch(model, max_context=64, pad_id=0)
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


BF16 = pytest.mark.skipif(not fused.bf16_matmuls(),
                          reason="oneDNN runs no bf16 matmuls on this CPU (it needs AVX-512)")


@BF16
@pytest.mark.parametrize("packed", [True, False])
def test_a_bf16_linear_is_the_product_of_the_rounded_operands(tiny: Any, packed: bool) -> None:
    """`Linear(dtype=bf16)` on an fp32 input: the input and the weights (and bias) rounded to
    bf16, their product accumulated in fp32 and rounded once to bf16, returned in fp32."""
    attn = tiny.model.layers[0].self_attn
    lin = fused.Linear([attn.q_proj, attn.k_proj, attn.v_proj], packed=packed,
                       dtype=torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16 and lin.bias is not None
    assert lin.bias.dtype == torch.bfloat16
    x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = lin(x)
    assert got.dtype == torch.float32
    w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
    b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
    exact = torch.nn.functional.linear(x.bfloat16().double(), w.bfloat16().double(),
                                       b.bfloat16().double())
    # one bf16 rounding of the fp32 sum (8 bits: within 2^-8 relative), never the fp32 sum
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)
    assert torch.equal(got, got.bfloat16().float())
    assert not torch.equal(got, torch.nn.functional.linear(x, w, b))


@BF16
def test_bf16_matmuls_in_the_engine(tiny_dir: Path) -> None:
    """`EmbeddedEngine(matmul_dtype="bfloat16")`: the fast step's linear layers hold bf16
    weights (kept so by a weight update), and its log-probabilities are a bf16 rounding
    away from the fp32 forward's, not equal to them (the fp32 engine's are within ATOL:
    the tests above)."""
    params = SamplingParams(max_tokens=12, seed=3)
    with EmbeddedEngine(tiny_dir, matmul_dtype="bfloat16") as eng:
        decoder = fused.fast_decoder(eng.model)
        assert decoder is not None and decoder.matmul_dtype == torch.bfloat16
        assert all(lin.weight.dtype == torch.bfloat16 for lin in decoder.linears())
        got = eng.generate([PROMPTS[0]], params)[0]
        ref = forward_logprobs(eng.model, PROMPTS[0], got.output_ids.tolist()).numpy()
        gap = np.abs(got.logprobs - ref)
        assert 0 < gap.max() < 0.1, gap
        state = {k: v.clone() for k, v in eng.model.state_dict().items()}
        eng.update_weights(Weights.of_state_dict(state), 1)
        decoder = fused.fast_decoder(eng.model)
        assert decoder is not None and decoder.matmul_dtype == torch.bfloat16
        assert all(lin.weight.dtype == torch.bfloat16 for lin in decoder.linears())
        again = eng.generate([PROMPTS[0]], params)[0]
        np.testing.assert_array_equal(again.output_ids, got.output_ids)
        np.testing.assert_allclose(again.logprobs, got.logprobs, atol=ATOL, rtol=0)


def test_bf16_matmuls_refused_with_a_reason(tiny_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown dtype, bf16 with the consistent numerics, and bf16 on a CPU where oneDNN
    has no bf16 matmuls are refused by name, before anything runs."""
    from tidal.engine.base import EngineError

    with pytest.raises(EngineError, match=r"matmul_dtype must be one of .*'float16'"):
        EmbeddedEngine(tiny_dir, matmul_dtype="float16")
    with pytest.raises(EngineError, match="matmul_dtype 'bfloat16' is for the standard"):
        EmbeddedEngine(tiny_dir, matmul_dtype="bfloat16", numerics="consistent")
    monkeypatch.setattr(fused, "bf16_matmuls", lambda: False)
    with pytest.raises(EngineError, match="oneDNN runs no bf16 matmuls on this CPU"):
        EmbeddedEngine(tiny_dir, matmul_dtype="bfloat16")


def test_auto_matmul_dtype_is_bf16_where_onednn_runs_it(tiny_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`matmul_dtype="auto"`: bf16 matmuls on a CPU where oneDNN runs them, else fp32 (never
    an error); `metrics()` names the dtypes the step runs in. With the consistent numerics
    it is refused, as bf16 is."""
    from tidal.engine.base import EngineError

    for supported in (False, True) if fused.bf16_matmuls() else (False,):
        monkeypatch.setattr(fused, "bf16_matmuls", lambda s=supported: s)
        with EmbeddedEngine(tiny_dir, matmul_dtype="auto", kv_dtype="bfloat16") as eng:
            decoder = fused.fast_decoder(eng.model)
            want = torch.bfloat16 if supported else torch.float32
            assert decoder is not None and decoder.matmul_dtype == want
            assert decoder.kv_dtype == torch.bfloat16
            m = eng.metrics()
            assert (m["matmul_dtype"], m["kv_dtype"]) == (
                "bfloat16" if supported else "float32", "bfloat16")
    with pytest.raises(EngineError, match="matmul_dtype 'auto' is for the standard"):
        EmbeddedEngine(tiny_dir, matmul_dtype="auto", numerics="consistent")
    with pytest.raises(EngineError, match=r"kv_dtype must be one of \('float32', 'bfloat16'\)"):
        EmbeddedEngine(tiny_dir, kv_dtype="auto")


def test_a_bf16_kv_store(tiny_dir: Path) -> None:
    """`kv_dtype=bf16`: the fast batch's store is bf16 (half the bytes a cached token takes),
    a continuation read from the prefix cache is what a fresh prefill of the whole history
    computes (each key and value is rounded once, as written), and the logprobs are a
    bf16 rounding away from the fp32 forward's, not equal to them. Any CPU: the attention
    widens what it reads."""
    model = load_policy_model(tiny_dir)  # its own: the registry's decoder is replaced
    decoder = fused.fast_decoder(model, kv_dtype=torch.bfloat16)
    assert decoder is not None and decoder.kv_dtype == torch.bfloat16
    assert decoder.matmul_dtype == torch.float32
    prompts = _prompts(model)
    cache = PrefixCache(64 << 20)
    got = _run(model, prompts, prefix=cache)
    batch = FastDecodeBatch(model, max_context=256, pad_id=0)
    batch.admit([SequenceRequest(tuple(prompts[0]), SamplingParams(max_tokens=20), seed=0)], [0])
    batch.step()
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in batch._store)
    gaps = []
    for i, prompt in enumerate(prompts):
        ref = forward_logprobs(model, prompt, got[i].output_ids).numpy()
        gaps.append(np.abs(got[i].logprobs - ref).max())
    assert 0 < max(gaps) < 0.1, gaps
    more = [p + got[i].output_ids[:-1] + [7, 8, 9] for i, p in enumerate(prompts)]
    cached = _run(model, more, steps=5, prefix=cache)
    fresh = _run(model, more, steps=5)
    assert sum(cached[i].cached_tokens for i in cached) >= sum(map(len, prompts)) - 5
    for i in range(len(more)):
        assert cached[i].output_ids == fresh[i].output_ids
        np.testing.assert_allclose(cached[i].logprobs, fresh[i].logprobs, atol=ATOL, rtol=0)
    _, nbytes = batch._extract(0, 10)  # what the prefix cache is charged for 10 tokens
    config = model.config
    assert nbytes == 10 * 2 * config.num_hidden_layers * config.num_key_value_heads * (
        decoder.head_dim) * 2
