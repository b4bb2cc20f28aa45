"""The attention kernel and the small ops (engine/decode_attention.py) against SDPA and torch."""

from __future__ import annotations

import pytest
import torch

from tidal.engine.decode_attention import TORCH_GLUE, Glue, Kernel, glue, kernel, reference


@pytest.fixture(scope="module")
def fn() -> Kernel:
    built = kernel()
    assert built is not None, "the kernel did not build here (see the warning)"
    return built


@pytest.mark.parametrize("store", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv", "dim"), [
    (9, 3, 64), (14, 2, 64), (8, 1, 128), (4, 4, 128),  # the intrinsics path (with AVX2)
    (18, 2, 64), (4, 4, 32), (14, 2, 48), (2, 1, 8),  # the plain loops
])
def test_agrees_with_sdpa(fn: Kernel, heads: int, kv: int, dim: int,
                          store: torch.dtype) -> None:
    """Tokens of a prefill (one sequence, lengths 1..5: causal), decode tokens of other
    sequences, regions of lengths that are and are not multiples of 4; over an fp32 store
    and a bf16 one (read as SDPA over the same values in fp32: widening is exact)."""
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    S = 200
    starts = torch.tensor([0, 0, 0, 0, 0, 40, 90, 150])
    lengths = torch.tensor([1, 2, 3, 4, 5, 47, 53, 50])
    q = torch.randn(len(starts), heads, dim, generator=gen) * 2
    k = torch.randn(S, kv, dim, generator=gen).to(store)
    v = torch.randn(S, kv, dim, generator=gen).to(store)
    got = fn(q, k, v, starts, lengths, dim**-0.5)
    want = reference(q, k.float(), v.float(), starts, lengths, dim**-0.5)
    assert got.shape == (len(starts), heads, dim) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=2e-6), (got - want).abs().max()
    # slots outside a token's region do not count, whatever they hold
    k2, v2 = k.clone(), v.clone()
    k2[5:40], v2[5:40] = 1e4, float("nan")
    assert torch.allclose(fn(q, k2, v2, starts, lengths, 0.1), fn(q, k, v, starts, lengths, 0.1))


def test_the_query_may_be_a_view(fn: Kernel) -> None:
    """The step passes q as a slice of the fused q/k/v projection."""
    qkv = torch.randn(4, 9 + 3, 64)
    k, v = torch.randn(60, 3, 64), torch.randn(60, 3, 64)
    q = qkv[:, :9]
    starts, lengths = torch.tensor([0, 10, 20, 30]), torch.tensor([10, 7, 30, 1])
    assert not q.is_contiguous()
    assert torch.allclose(fn(q, k, v, starts, lengths, 0.125),
                          reference(q, k, v, starts, lengths, 0.125), rtol=1e-5, atol=2e-6)


def test_bad_shapes_are_named(fn: Kernel) -> None:
    q, k = torch.randn(2, 9, 64), torch.randn(10, 3, 64)
    starts, lengths = torch.tensor([0, 2]), torch.tensor([3, 8])
    with pytest.raises(RuntimeError, match="multiple of KV"):
        fn(torch.randn(2, 8, 64), k, k, starts, lengths, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        fn(q.double(), k.double(), k.double(), starts, lengths, 1.0)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        fn(q, k, k.bfloat16(), starts, lengths, 1.0)
    with pytest.raises(RuntimeError, match=r"starts and lengths must be int64 \[N\]"):
        fn(q, k, k, starts.int(), lengths, 1.0)
    with pytest.raises(RuntimeError, match=r"token 1 reads slots \[2, 11\) of a store of 10"):
        fn(q, k, k, starts, torch.tensor([3, 9]), 1.0)
    with pytest.raises(RuntimeError, match=r"token 0 reads slots \[0, 0\)"):
        fn(q, k, k, starts, torch.tensor([0, 8]), 1.0)
    with pytest.raises(RuntimeError, match="contiguous head dims"):
        fn(q, k.transpose(1, 2).contiguous().transpose(1, 2), k, starts, lengths, 1.0)


@pytest.fixture(scope="module")
def ops() -> Glue:
    built = glue()
    assert built is not None, "the small ops did not build here (see the warning)"
    return built


@pytest.mark.parametrize(("rows", "width"), [(16, 576), (3, 24), (1, 7)])
def test_norms_agree_with_torch(ops: Glue, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    w = torch.rand(width, generator=gen) + 0.5
    want = torch.nn.functional.rms_norm(x, (width,), w, 1e-5)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-6)
    h = x.clone()
    got = ops.add_rms_norm(h, delta, w, 1e-6)
    torch.testing.assert_close(h, x + delta)  # the residual, updated in place
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x + delta, (width,), w, 1e-6),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("heads", "kv", "dim"), [(9, 3, 64), (2, 1, 8), (4, 4, 128)])
def test_rope_split_agrees_with_transformers_rotary(ops: Glue, heads: int, kv: int,
                                                     dim: int) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(dim)
    B = 5
    qkv = torch.randn(B, (heads + 2 * kv) * dim, generator=gen)
    angles = (torch.rand(B, dim // 2, generator=gen) * 100).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    q, k, v = ops.rope_split(qkv, cos, sin, heads, kv)
    q_ref = qkv[:, : heads * dim].view(B, heads, 1, dim)
    k_ref = qkv[:, heads * dim : (heads + kv) * dim].view(B, kv, 1, dim)
    q_want, k_want = apply_rotary_pos_emb(q_ref, k_ref, cos[:, None], sin[:, None])
    torch.testing.assert_close(q, q_want[:, :, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, k_want[:, :, 0], rtol=1e-5, atol=1e-6)
    assert torch.equal(v, qkv[:, (heads + kv) * dim :].view(B, kv, dim))
    for got, want in zip([q, k, v], TORCH_GLUE.rope_split(qkv, cos, sin, heads, kv), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_silu_mul_agrees_with_torch(ops: Glue) -> None:
    gu = torch.randn(16, 2 * 1536) * 4
    want = torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:]
    torch.testing.assert_close(ops.silu_mul(gu), want, rtol=1e-5, atol=1e-6)


def test_small_ops_name_bad_input(ops: Glue) -> None:
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.rms_norm(x.t(), w, 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(x, torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="delta must have"):
        ops.add_rms_norm(x, torch.randn(4, 9), w, 1e-5)
    with pytest.raises(RuntimeError, match=r"qkv must be \[B, \(H \+ 2 KV\) D\]"):
        ops.rope_split(torch.randn(2, 48), torch.ones(2, 8), torch.ones(2, 8), 3, 1)
    with pytest.raises(RuntimeError, match=r"gu must be \[B, 2 I\]"):
        ops.silu_mul(torch.randn(2, 7))


def test_where_it_cannot_be_built_the_step_says_so_and_uses_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.engine import decode_attention

    monkeypatch.setattr(decode_attention, "_BUILT", {})
    monkeypatch.setattr(decode_attention, "_build",
                        lambda: (None, "it could not be built (OSError: no compiler)"))
    with pytest.warns(RuntimeWarning, match="decode steps use SDPA: it could not be built"):
        assert decode_attention.kernel() is None
    with pytest.warns(RuntimeWarning, match="torch's small ops: it could not be built"):
        assert decode_attention.glue() is None
    assert decode_attention.kernel() is None  # said once: no second warning
