"""The embedded engine: logprob correctness, batching, seeds, weight updates, errors."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.engine.reference import (
    forward_logprobs,
    generate_concurrently,
    processed_distribution,
)
from tidal.engine.base import Engine, EngineError, Generation, SamplingParams, Weights
from tidal.engine.batch import DecodeBatch, SequenceRequest, SequenceResult, decode_batch
from tidal.engine.embedded import EmbeddedEngine
from tidal.engine.sampling import processed_logprobs

# fp32 on CPU: logprobs from the KV-cached loop vs one full forward pass, and padded vs
# unpadded batches, agree to ~4e-6 on the tiny model (measured); 1e-4 leaves headroom.
ATOL = 1e-4

PROMPTS = [
    list(range(1000, 1017)),
    [151644, 872, 198, 9707, 1879],  # <|im_start|>user\nHello world
    list(range(5000, 5040, 3)),
]


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[EmbeddedEngine]:
    with EmbeddedEngine(tiny_dir, batch_wait_s=0.02) as eng:
        yield eng


def test_is_an_engine(engine: EmbeddedEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.max_context == 32768
    assert engine.policy_version == 0


def test_plain_sampling_logprobs_equal_forward_pass(engine: EmbeddedEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=1.0, top_k=0, seed=3)
    gens = engine.generate(PROMPTS, params)
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        assert gen.finish_reason == "length"
        assert len(gen.output_ids) == len(gen.logprobs) == 12
        assert gen.output_ids.dtype == np.int32
        ref = forward_logprobs(engine.model, prompt, gen.output_ids.tolist())
        np.testing.assert_allclose(gen.logprobs, ref.numpy(), atol=ATOL, rtol=0)


def test_processed_logprobs_reflect_temperature_top_k_top_p(engine: EmbeddedEngine) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=40, top_p=0.9, seed=5)
    prompt = PROMPTS[0]
    gen = engine.generate([prompt], params)[0]
    lp = processed_distribution(engine.model, prompt, gen.output_ids.tolist(), params)
    want = lp.gather(-1, torch.tensor(gen.output_ids.tolist())[:, None])[:, 0]
    np.testing.assert_allclose(gen.logprobs, want.numpy(), atol=ATOL, rtol=0)
    # Every sampled token is inside the kept set, and the processed distribution is not
    # the plain one: at most 40 tokens survive.
    assert torch.isfinite(want).all()
    assert int(torch.isfinite(lp).sum(-1).max()) <= 40
    plain = forward_logprobs(engine.model, prompt, gen.output_ids.tolist())
    assert float((plain - want).abs().max()) > 0.1


def test_top_logprobs_are_the_processed_distributions_best(engine: EmbeddedEngine) -> None:
    """`top_logprobs` lists the k most likely tokens of the distribution sampled from, at
    every position; tokens that top-k cut away are not alternatives."""
    prompt = PROMPTS[0]
    for params, kept in (
        (SamplingParams(max_tokens=6, temperature=0.8, top_logprobs=5, seed=4), 5),
        (SamplingParams(max_tokens=6, top_k=3, top_logprobs=8, seed=4), 3),
    ):
        gen = engine.generate([prompt], params)[0]
        assert gen.top_logprobs is not None and len(gen.top_logprobs) == len(gen.output_ids)
        lp = processed_distribution(engine.model, prompt, gen.output_ids.tolist(), params)
        for pos, alts in enumerate(gen.top_logprobs):
            assert len(alts) == kept
            want_lp, want_ids = lp[pos].topk(kept)
            assert [t for t, _ in alts] == want_ids.tolist()
            np.testing.assert_allclose([v for _, v in alts], want_lp.numpy(), atol=ATOL, rtol=0)
            assert int(gen.output_ids[pos]) in [t for t, _ in alts] or kept == 5
    plain = engine.generate([prompt], SamplingParams(max_tokens=3, seed=4))[0]
    assert plain.top_logprobs is None


def test_processed_logprobs_by_hand() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]])
    lp = processed_logprobs(
        logits,
        temperature=torch.tensor([1.0, 2.0, 1.0]),
        top_k=torch.tensor([2, 0, 0]),
        top_p=torch.tensor([1.0, 1.0, 0.5]),
    )
    # row 0: top-2 of [2, 1] -> softmax over two tokens
    two = torch.tensor([2.0, 1.0]).log_softmax(-1)
    torch.testing.assert_close(lp[0, :2], two)
    assert torch.isinf(lp[0, 2:]).all()
    # row 1: temperature 2
    torch.testing.assert_close(lp[1], (logits[1] / 2).log_softmax(-1))
    # row 2: p(3.0) = 0.64 >= 0.5 -> only the argmax survives
    assert lp[2, 1].item() == pytest.approx(0.0)
    assert torch.isinf(lp[2, [0, 2, 3]]).all()


def test_padding_does_not_change_logprobs(engine: EmbeddedEngine) -> None:
    params = SamplingParams(max_tokens=10)
    reqs = [SequenceRequest(tuple(p), params, seed=100 + i) for i, p in enumerate(PROMPTS)]
    kw = {"max_context": engine.max_context, "pad_id": 151643}
    alone = [decode_batch(engine.model, [r], **kw)[0] for r in reqs]
    together = decode_batch(engine.model, reqs, **kw)  # one left-padded batch of 3
    assert len({len(p) for p in PROMPTS}) == 3  # really padded
    for a, b in zip(alone, together, strict=True):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL, rtol=0)


def test_concurrent_requests_are_batched_and_correct(
    engine: EmbeddedEngine, tiny_dir: Path
) -> None:
    params = SamplingParams(max_tokens=6, seed=21)
    expected = {i: engine.generate([p], params)[0] for i, p in enumerate(PROMPTS)}
    results: dict[int, Generation] = {}
    barrier = threading.Barrier(len(PROMPTS))
    # A batch closes as soon as it holds max_batch_size sequences; the long window only
    # makes sure that three calls released together by the barrier end up in one batch.
    with EmbeddedEngine(tiny_dir, max_batch_size=len(PROMPTS), batch_wait_s=10.0) as eng:

        def call(i: int) -> None:
            barrier.wait()
            results[i] = eng.generate([PROMPTS[i]], params)[0]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(results) == [0, 1, 2]
    for i, gen in results.items():
        assert gen.extra["batch_size"] == 3  # one forward served all three callers
        np.testing.assert_array_equal(gen.output_ids, expected[i].output_ids)
        np.testing.assert_allclose(gen.logprobs, expected[i].logprobs, atol=ATOL, rtol=0)


def test_seeded_sampling_is_reproducible(engine: EmbeddedEngine) -> None:
    params = SamplingParams(max_tokens=16, seed=1234)
    a = engine.generate(PROMPTS[:2], params)
    b = engine.generate(PROMPTS[:2], params)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.output_ids, y.output_ids)
    # Prompts of one request get distinct seeds; another seed gives other tokens.
    same = engine.generate([PROMPTS[0], PROMPTS[0]], params)
    assert not np.array_equal(same[0].output_ids, same[1].output_ids)
    c = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=16, seed=4321))[0]
    assert not np.array_equal(a[0].output_ids, c.output_ids)


def test_greedy_is_argmax(engine: EmbeddedEngine) -> None:
    gen = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    ids = torch.tensor([PROMPTS[1] + gen.output_ids.tolist()])
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0, len(PROMPTS[1]) - 1 : -1]
    assert logits.argmax(-1).tolist() == gen.output_ids.tolist()
    ref = forward_logprobs(engine.model, PROMPTS[1], gen.output_ids.tolist())
    np.testing.assert_allclose(gen.logprobs, ref.numpy(), atol=ATOL, rtol=0)


def test_stop_token_ends_generation(engine: EmbeddedEngine) -> None:
    free = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10, seed=8))[0]
    stop_at = int(free.output_ids[3])
    first = free.output_ids.tolist().index(stop_at)
    stopped = engine.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=10, seed=8, stop_token_ids=(stop_at,))
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids.tolist() == free.output_ids.tolist()[: first + 1]


def test_context_limit_truncates_with_length(tiny_dir: Path) -> None:
    with EmbeddedEngine(tiny_dir, max_context=24) as eng:  # a short context: cheap to reach
        assert eng.max_context == 24
        gen = eng.generate([list(range(20))], SamplingParams(max_tokens=50, seed=0))[0]
        assert gen.finish_reason == "length"
        assert len(gen.output_ids) == 4
        with pytest.raises(EngineError, match="context"):
            eng.generate([list(range(24))], SamplingParams(max_tokens=1))


def test_bad_input_errors(engine: EmbeddedEngine) -> None:
    p = SamplingParams(max_tokens=2)
    with pytest.raises(EngineError, match="empty"):
        engine.generate([[]], p)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.generate([[1, 2, engine.vocab_size]], p)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.generate([[-1]], p)
    with pytest.raises(EngineError, match="integer"):
        engine.generate([np.array([1.5, 2.0])], p)  # type: ignore[list-item]
    with pytest.raises(EngineError, match="tokens; the context"):
        engine.generate([[1] * engine.max_context], p)
    with pytest.raises(EngineError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(EngineError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert engine.generate([], p) == []
    with pytest.raises(EngineError, match="dtype"):
        EmbeddedEngine("tiny", dtype="float8")
    with pytest.raises(EngineError, match="max_context"):
        EmbeddedEngine("tiny", max_context=10**6)


def _perturbed_state(eng: EmbeddedEngine) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    state = {}
    for name, param in eng.model.named_parameters():
        state[name] = param.detach() + 0.05 * torch.randn(param.shape, generator=gen)
    return state


def test_update_weights_bumps_version_and_changes_outputs(tiny_dir: Path, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=8, seed=2)
    with EmbeddedEngine(tiny_dir) as eng:
        before = eng.generate([PROMPTS[0]], params)[0]
        assert before.policy_version == 0
        ckpt = tmp_path / "step-1"
        ckpt.mkdir()
        (ckpt / "config.json").write_text((tiny_dir / "config.json").read_text())
        save_file(_perturbed_state(eng), str(ckpt / "model.safetensors"))
        eng.update_weights(str(ckpt), 1)
        assert eng.policy_version == 1
        after = eng.generate([PROMPTS[0]], params)[0]
        assert after.policy_version == 1
        assert not np.allclose(before.logprobs, after.logprobs, atol=1e-3)
        ref = forward_logprobs(eng.model, PROMPTS[0], after.output_ids.tolist())
        np.testing.assert_allclose(after.logprobs, ref.numpy(), atol=ATOL, rtol=0)
        # The original weights come back from the original checkpoint.
        eng.update_weights(tiny_dir, 2)
        again = eng.generate([PROMPTS[0]], params)[0]
        assert again.policy_version == 2
        np.testing.assert_array_equal(again.output_ids, before.output_ids)


def test_update_weights_in_process(tiny_dir: Path, tmp_path: Path) -> None:
    with EmbeddedEngine(tiny_dir) as eng:
        state = _perturbed_state(eng)
        eng.update_weights(Weights.of_state_dict(state), 5)
        assert eng.policy_version == 5
        name = "model.layers.0.mlp.up_proj.weight"
        torch.testing.assert_close(dict(eng.model.named_parameters())[name], state[name])
        # A trainer's model.state_dict() (tied lm_head.weight included) is accepted.
        full = {k: v.clone() for k, v in eng.model.state_dict().items()}
        assert "lm_head.weight" in full
        eng.update_weights(Weights.of_state_dict(full), 5)
        torch.testing.assert_close(dict(eng.model.named_parameters())[name], state[name])
        # A trainer's model: its tensors are copied, no checkpoint is written.
        trainer_model = copy.deepcopy(eng.model)
        with torch.no_grad():
            dict(trainer_model.named_parameters())[name].add_(1.0)
        weights = Weights.of_model(trainer_model, tmp_path / "ckpt")
        eng.update_weights(weights, 6)
        assert eng.policy_version == 6 and not weights.written
        assert not (tmp_path / "ckpt").exists()
        torch.testing.assert_close(dict(eng.model.named_parameters())[name], state[name] + 1.0)
        with pytest.raises(EngineError, match="unexpected keys"):
            eng.update_weights(Weights.of_state_dict({"nope": torch.zeros(1)}), 7)
        with pytest.raises(EngineError, match="missing keys"):
            eng.update_weights(Weights.of_state_dict({name: state[name]}), 7)
        bad = dict(state)
        bad[name] = torch.zeros(3, 3)
        with pytest.raises(EngineError, match="shape"):
            eng.update_weights(Weights.of_state_dict(bad), 7)
        assert eng.policy_version == 6


def test_update_weights_errors(engine: EmbeddedEngine, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no checkpoint directory"):
        engine.update_weights(str(tmp_path / "missing"), 1)
    with pytest.raises(EngineError, match="safetensors"):
        engine.update_weights(str(tmp_path), 1)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64}')
    with pytest.raises(EngineError, match="architecture"):
        engine.update_weights(str(tmp_path), 1)
    assert engine.policy_version == 0


def test_closed_engine_refuses(tiny_dir: Path) -> None:
    eng = EmbeddedEngine(tiny_dir)
    eng.close()
    with pytest.raises(EngineError, match="closed"):
        eng.generate([[1, 2]], SamplingParams(max_tokens=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_matches_cpu_forward(engine: EmbeddedEngine, tiny_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, seed=7, temperature=0.8, top_k=50, top_p=0.95)
    with EmbeddedEngine(tiny_dir, device="cuda") as gpu:
        gens = gpu.generate(PROMPTS, params)
        again = gpu.generate(PROMPTS, params)
    for prompt, gen, rep in zip(PROMPTS, gens, again, strict=True):
        np.testing.assert_array_equal(gen.output_ids, rep.output_ids)
        ids = torch.tensor([prompt + gen.output_ids.tolist()])
        with torch.inference_mode():
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        n = len(gen.output_ids)
        lp = processed_logprobs(
            logits,
            torch.full((n,), 0.8),
            torch.full((n,), 50, dtype=torch.long),
            torch.full((n,), 0.95),
        )
        want = lp.gather(-1, torch.tensor(gen.output_ids.tolist())[:, None])[:, 0]
        np.testing.assert_allclose(gen.logprobs, want.numpy(), atol=1e-3, rtol=0)


def _wait_until_busy(eng: EmbeddedEngine) -> None:
    for _ in range(10_000):
        if eng._model_lock.locked():
            return
        threading.Event().wait(0.005)
    raise AssertionError("engine never became busy")


def test_sequences_join_a_running_batch(tiny_dir: Path) -> None:
    short_params = SamplingParams(max_tokens=4, seed=31)
    with EmbeddedEngine(tiny_dir, batch_wait_s=0.0) as eng:
        alone = eng.generate([PROMPTS[1]], short_params)[0]
        long_result: list[Generation] = []
        runner = threading.Thread(
            target=lambda: long_result.extend(
                eng.generate([PROMPTS[2]], SamplingParams(max_tokens=150, seed=1))
            )
        )
        runner.start()
        _wait_until_busy(eng)
        joined = eng.generate([PROMPTS[1]], short_params)[0]
        runner.join()
    assert joined.extra["batch_size"] == 2  # admitted next to the running sequence
    assert len(long_result) == 1 and len(long_result[0].output_ids) == 150
    np.testing.assert_array_equal(joined.output_ids, alone.output_ids)
    np.testing.assert_allclose(joined.logprobs, alone.logprobs, atol=ATOL, rtol=0)


def test_weight_update_waits_for_running_sequences(tiny_dir: Path) -> None:
    with EmbeddedEngine(tiny_dir, batch_wait_s=0.0) as eng:
        original = {k: v.detach().clone() for k, v in eng.model.named_parameters()}
        perturbed = _perturbed_state(eng)
        out: list[Generation] = []
        runner = threading.Thread(
            target=lambda: out.extend(
                eng.generate([PROMPTS[0]], SamplingParams(max_tokens=60, seed=4))
            )
        )
        runner.start()
        _wait_until_busy(eng)
        # Returns once the running sequence is done.
        eng.update_weights(Weights.of_state_dict(perturbed), 1)
        assert out and out[0].policy_version == 0
        assert eng.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].policy_version == 1
        runner.join()
        eng.update_weights(Weights.of_state_dict(original), 2)
        # The whole sequence was sampled from the original weights.
        ref = forward_logprobs(eng.model, PROMPTS[0], out[0].output_ids.tolist())
        np.testing.assert_allclose(out[0].logprobs, ref.numpy(), atol=ATOL, rtol=0)


def test_mixed_concurrent_callers_match_solo_runs(tiny_dir: Path) -> None:
    """Callers with different prompts, lengths and sampling parameters, joining and
    leaving the running batch at different steps, get what they would get alone.

    Under the consistent numerics, the engine's promise (docs/engine.md): the default
    forward's batched matmuls may round a row differently with other rows beside it
    (seen on an AVX-512 machine, where which rows share a step depends on the threads'
    timing), and a sampled token then flips. The batch's own bookkeeping, merged and
    trimmed caches included, is checked exactly under the default numerics by
    `test_decode_batch_merge_and_trim_are_exact`, which fixes who joins when."""
    calls = [
        (PROMPTS[0], SamplingParams(max_tokens=9, seed=1)),
        (PROMPTS[1], SamplingParams(max_tokens=3, seed=2, temperature=0.6, top_k=20)),
        (PROMPTS[2], SamplingParams(max_tokens=14, seed=3, top_p=0.8)),
        (PROMPTS[1] * 3, SamplingParams(max_tokens=5, temperature=0.0)),
        (PROMPTS[0][:3], SamplingParams(max_tokens=7, seed=5, temperature=1.3)),
    ]
    with EmbeddedEngine(tiny_dir, batch_wait_s=0.0, max_batch_size=3,
                        numerics="consistent") as eng:
        solo = [eng.generate([p], sp)[0] for p, sp in calls]
        got = generate_concurrently(eng, calls)
    for i, want in enumerate(solo):
        assert got[i].extra["batch_size"] <= 3
        np.testing.assert_array_equal(got[i].output_ids, want.output_ids)
        np.testing.assert_allclose(got[i].logprobs, want.logprobs, atol=ATOL, rtol=0)


def test_decode_batch_merge_and_trim_are_exact(engine: EmbeddedEngine) -> None:
    """Deterministic version of continuous batching: B joins A mid-flight (cache merge
    with left padding), A leaves first (leading columns trimmed), C joins late."""
    kw = {"max_context": engine.max_context, "pad_id": 151643}
    a = SequenceRequest(tuple(PROMPTS[2]), SamplingParams(max_tokens=6), seed=1)
    b = SequenceRequest(tuple(PROMPTS[1]), SamplingParams(max_tokens=12, top_k=30), seed=2)
    c = SequenceRequest(tuple(PROMPTS[0]), SamplingParams(max_tokens=4), seed=3)
    requests = {"a": a, "b": b, "c": c}
    solo = {t: decode_batch(engine.model, [r], **kw)[0] for t, r in requests.items()}
    batch = DecodeBatch(engine.model, **kw)
    done: dict[str, object] = {}
    batch.admit([a], ["a"])
    for _ in range(2):
        batch.step()
    batch.admit([b], ["b"])
    assert len(batch) == 2
    steps = 0
    while len(batch):
        batch.step()
        steps += 1
        if steps == 6:
            batch.admit([c], ["c"])
        done.update(dict(batch.pop_finished()))
    assert sorted(done) == ["a", "b", "c"]
    for tag, want in solo.items():
        res = done[tag]
        assert isinstance(res, SequenceResult)
        assert res.output_ids == want.output_ids
        assert res.finish_reason == want.finish_reason
        np.testing.assert_allclose(res.logprobs, want.logprobs, atol=ATOL, rtol=0)


def test_decode_steps_append_in_place(engine: EmbeddedEngine) -> None:
    """A decode step writes its column into the KV buffers (no copy of the whole cache);
    a row leaving moves the cache to new buffers, and sampling stays that of solo runs."""
    kw = {"max_context": engine.max_context, "pad_id": 151643}
    a = SequenceRequest(tuple(PROMPTS[0]), SamplingParams(max_tokens=3), seed=1)
    b = SequenceRequest(tuple(PROMPTS[2]), SamplingParams(max_tokens=10), seed=2)
    solo = {t: decode_batch(engine.model, [r], **kw)[0] for t, r in (("a", a), ("b", b))}
    batch = DecodeBatch(engine.model, **kw)
    batch.admit([a, b], ["a", "b"])

    def storage() -> list[int]:
        return [layer.keys.untyped_storage().data_ptr()
                for layer in batch._cache.layers]  # the buffers are the point

    before = storage()
    batch.step()
    assert storage() == before  # appended in place
    done: dict[str, SequenceResult] = {}
    while len(batch):
        batch.step()
        done.update(dict(batch.pop_finished()))
        if "a" in done and len(batch):
            assert storage() != before  # row a left: the cache was re-seated
    for tag, want in solo.items():
        assert done[tag].output_ids == want.output_ids
        np.testing.assert_allclose(done[tag].logprobs, want.logprobs, atol=ATOL, rtol=0)
