"""Consistent numerics: a token's logits are a function of its context alone, bit for bit.

The standard engine agrees with itself across batch compositions only to ~1e-6
(test_embedded.py's ATOL); here every comparison is exact equality.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Qwen2Config

from tests.engine.reference import causal_lists, generate_concurrently
from tests.train.conftest import tiny_qwen2, tiny_qwen3
from tidal.engine.base import EngineError, SamplingParams
from tidal.engine.batch import SequenceRequest
from tidal.engine.consistent import (
    KEY_BLOCK,
    QUERY_CHUNK,
    TILE_ROWS,
    ConsistencyError,
    ConsistentModel,
    KeyLists,
    block_attention,
    tile_plan,
    tile_sizes,
    tiled_linear,
    tiled_logprobs,
)
from tidal.engine.consistent_batch import ConsistentDecodeBatch
from tidal.engine.embedded import EmbeddedEngine

PROMPTS = [list(range(1000, 1017)), [151644, 872, 198, 9707, 1879], list(range(5000, 5240, 3))]


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)


def model_logprobs(cm: ConsistentModel, ids: list[int]) -> torch.Tensor:
    """Log-softmax [T, V] of the consistent forward over one whole sequence."""
    with torch.inference_mode():
        t = torch.tensor(ids)
        h = cm.hidden(t, torch.arange(len(ids)), causal_lists(len(ids)))
        return cm.logits(h).log_softmax(-1)


def test_tiled_linear_rows_depend_only_on_their_input() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(384, 128), torch.randn(384)
    x = torch.randn(70, 128)
    full = tiled_linear(x, w, b)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b))
    for start, n in [(0, 1), (5, 1), (3, 2), (9, 3), (1, TILE_ROWS + 1), (20, 50)]:
        assert torch.equal(tiled_linear(x[start : start + n], w, b), full[start : start + n])


def test_tile_plans_cover_rows_and_long_inputs_keep_each_rows_bits() -> None:
    sizes = (4, 8, 16, 64, 256)
    assert [tile_plan(m, sizes) for m in (1, 5, 8, 12, 17, 300)] == [
        [4], [8], [8], [16], [16, 4], [256, 64]]
    assert tile_plan(5, (16,)) == [16]  # only the reference agrees: everything padded to it
    torch.manual_seed(3)
    w, b = torch.randn(384, 128), torch.randn(384)
    assert TILE_ROWS in tile_sizes(w, b)
    x = torch.randn(600, 128)  # 256-row tiles where they agree, then the rest
    full = tiled_linear(x, w, b)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b))
    for start, n in [(0, 1), (599, 1), (250, 12), (100, 300)]:
        assert torch.equal(tiled_linear(x[start : start + n], w, b), full[start : start + n])


@pytest.mark.parametrize("keep", [True, False])
def test_tiled_logprobs_are_the_log_softmax_and_differentiate_like_it(
    keep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bit for bit the log-softmax of the tiled logits at the targets; gradients as plain
    autograd's, whether the forward kept the softmax or backward recomputes it."""
    if not keep:
        monkeypatch.setattr("tidal.engine.consistent.KEEP_PROBS_BYTES", 0)
    torch.manual_seed(4)
    h = torch.randn(300, 32, requires_grad=True)
    w = torch.randn(500, 32, requires_grad=True)
    b = torch.randn(500, requires_grad=True)
    tgt = torch.randint(0, 500, (300,))
    lp = tiled_logprobs(h, w, b, tgt)
    with torch.no_grad():
        want = tiled_linear(h, w, b).float().log_softmax(-1).gather(1, tgt[:, None])[:, 0]
    assert torch.equal(lp.detach(), want)
    weights = torch.randn(300)
    grads = torch.autograd.grad((lp * weights).sum(), (h, w, b))
    ref = torch.nn.functional.linear(h, w, b).log_softmax(-1).gather(1, tgt[:, None])[:, 0]
    for got, exp in zip(grads, torch.autograd.grad((ref * weights).sum(), (h, w, b)),
                        strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


def test_block_attention_differentiates_like_attention() -> None:
    """The plain backward over a stream long enough for 256-query chunks: SDPA's
    gradients; the forward rows of the long stream are each row's own."""
    torch.manual_seed(5)
    n, h, g, d = 300, 4, 2, 16
    q, k, v = (torch.randn(n, c, d, requires_grad=True) for c in (h, g, g))
    lists = causal_lists(n)
    out = block_attention(q, k, v, lists, d**-0.5)
    ref = sdpa(q.transpose(0, 1)[None], k.repeat_interleave(h // g, 1).transpose(0, 1)[None],
               v.repeat_interleave(h // g, 1).transpose(0, 1)[None], is_causal=True,
               )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    up = torch.randn(n, h, d)
    for got, exp in zip(torch.autograd.grad((out * up).sum(), (q, k, v)),
                        torch.autograd.grad((ref * up).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        sel = torch.tensor([0, 257, 299])
        part = block_attention(q[sel], k, v, KeyLists(lists.keys_R_L, lists.list_T[sel],
                                                      lists.len_T[sel]), d**-0.5)
        assert torch.equal(part, out.detach()[sel])


def test_block_attention_is_attention_and_order_free() -> None:
    torch.manual_seed(1)
    n, h, g, d = 150, 4, 2, 16
    q, k, v = torch.randn(n, h, d), torch.randn(n, g, d), torch.randn(n, g, d)
    lists = causal_lists(n)
    out = block_attention(q, k, v, lists, d**-0.5)
    ref = sdpa(
        q.transpose(0, 1)[None],
        k.repeat_interleave(h // g, 1).transpose(0, 1)[None],
        v.repeat_interleave(h // g, 1).transpose(0, 1)[None],
        is_causal=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Any subset of queries, in any order, gets bitwise the same rows.
    for sel in [torch.tensor([149]), torch.tensor([0, 64, 63]), torch.arange(n).flip(0)[:40]]:
        sub = KeyLists(lists.keys_R_L, lists.list_T[sel], lists.len_T[sel])
        part = block_attention(q[sel], k, v, sub, d**-0.5)
        assert torch.equal(part, out[sel])
    assert QUERY_CHUNK < 40  # the last subset spans two query chunks


@pytest.mark.parametrize("make", [tiny_qwen2, tiny_qwen3])
def test_forward_matches_transformers_and_ignores_later_tokens(make: object) -> None:
    model = make()  # type: ignore[operator]
    cm = ConsistentModel(model)
    ids = torch.randint(0, 512, (130,), generator=torch.Generator().manual_seed(2)).tolist()
    lp = model_logprobs(cm, ids)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=1e-4)
    for t in [0, 1, KEY_BLOCK - 1, KEY_BLOCK, 129]:  # a prefix alone: the same bits
        assert torch.equal(model_logprobs(cm, ids[: t + 1])[t], lp[t])


def test_unsupported_models_are_refused(tiny_dir: Path) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ConsistencyError, match=r"qwen2, qwen3, llama.*'gpt2'"):
        ConsistentModel(gpt2)
    with pytest.raises(ConsistencyError, match="sliding-window"):
        ConsistentModel(
            type(tiny_qwen2())(
                Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            use_sliding_window=True, sliding_window=16)
            )
        )
    with pytest.raises(EngineError, match="numerics must be one of"):
        EmbeddedEngine(tiny_dir, numerics="bitwise")


def test_engine_samples_from_the_consistent_forward(tiny_dir: Path) -> None:
    """The recorded logprob of every sampled token is the consistent forward's log-softmax
    of the whole sequence, bit for bit, whoever shared the batch."""
    calls = [(p, SamplingParams(max_tokens=12 + 3 * i, seed=i)) for i, p in enumerate(PROMPTS)]
    with EmbeddedEngine(tiny_dir, numerics="consistent", batch_wait_s=0.0,
                        max_batch_size=2) as eng:
        solo = [eng.generate([p], sp)[0] for p, sp in calls]
        got = generate_concurrently(eng, calls)
        cm = ConsistentModel(eng.model)
        for i, (prompt, _) in enumerate(calls):
            out = solo[i].output_ids.tolist()
            assert got[i].output_ids.tolist() == out
            assert np.array_equal(got[i].logprobs, solo[i].logprobs)  # exact, not allclose
            lp = model_logprobs(cm, prompt + out)[len(prompt) - 1 : -1]
            want = lp.gather(-1, torch.tensor(out)[:, None])[:, 0].numpy()
            assert np.array_equal(solo[i].logprobs, want)


def test_slot_store_compaction_keeps_running_rows(tiny_dir: Path) -> None:
    """Sequences admitted while others run, past the store's first capacity: the live
    regions are moved to a bigger store and decoding continues unchanged."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    reqs = [
        SequenceRequest(tuple(range(3000 + 100 * i, 3000 + 100 * i + 900)),
                        SamplingParams(max_tokens=6 + i), seed=i)
        for i in range(6)
    ]

    capacity = []

    def run(groups: list[list[int]]) -> dict[int, tuple[list[int], list[float]]]:
        batch = ConsistentDecodeBatch(model, max_context=32768, pad_id=0)
        out: dict[int, tuple[list[int], list[float]]] = {}
        for group in groups:
            batch.admit([reqs[i] for i in group], group)
            capacity.append(batch._capacity())
            batch.step()
            for tag, res in batch.pop_finished():
                out[tag] = (res.output_ids, res.logprobs)
        while len(batch):
            batch.step()
            for tag, res in batch.pop_finished():
                out[tag] = (res.output_ids, res.logprobs)
        return out

    alone = {}
    for i in range(len(reqs)):
        alone.update(run([[i]]))
    capacity.clear()
    together = run([[0, 1], [2], [3, 4], [5]])  # 6 x ~910 slots: past the first 4,096
    assert capacity[0] == 4096 and capacity[-1] > 4096  # the store was compacted and grown
    assert together == alone
