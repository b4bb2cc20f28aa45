"""The decode-attention kernel (engine/decode_attention.py) against SDPA."""

from __future__ import annotations

import pytest
import torch

from tidal.engine.decode_attention import Kernel, kernel, reference


@pytest.fixture(scope="module")
def fn() -> Kernel:
    built = kernel()
    assert built is not None, "the kernel did not build here (see the warning)"
    return built


@pytest.mark.parametrize(("heads", "kv", "dim"), [
    (9, 3, 64), (14, 2, 64), (8, 1, 128), (4, 4, 128),  # the intrinsics path (with AVX2)
    (18, 2, 64), (4, 4, 32), (14, 2, 48), (2, 1, 8),  # the plain loops
])
def test_agrees_with_sdpa(fn: Kernel, heads: int, kv: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    B, T, cap = 5, 53, 70
    q = torch.randn(B, heads, dim, generator=gen) * 2
    # the cache's layout: views of buffers with room to spare along the sequence axis
    k = torch.randn(B, kv, cap, dim, generator=gen)[:, :, :T]
    v = torch.randn(B, kv, cap, dim, generator=gen)[:, :, :T]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :20] = False  # left padding
    mask[3, 5:9] = False  # a hole
    for m in (mask, None):
        got, want = fn(q, k, v, m, dim**-0.5), reference(q, k, v, m, dim**-0.5)
        assert got.shape == (B, heads, dim)
        assert torch.allclose(got, want, rtol=1e-5, atol=2e-6), (got - want).abs().max()
    # a masked column does not count, whatever it holds
    k2 = k.clone()
    k2[1, :, :20] = 1e4
    assert torch.allclose(fn(q, k2, v, mask, 0.1), fn(q, k, v, mask, 0.1))


def test_the_query_may_be_a_view(fn: Kernel) -> None:
    """The decode step passes q as a slice of the fused q/k/v projection."""
    qkv = torch.randn(4, 9 + 3, 64)
    k, v = torch.randn(4, 3, 30, 64), torch.randn(4, 3, 30, 64)
    q = qkv[:, :9]
    assert not q.is_contiguous()
    assert torch.allclose(fn(q, k, v, None, 0.125), reference(q, k, v, None, 0.125),
                          rtol=1e-5, atol=2e-6)


def test_bad_shapes_are_named(fn: Kernel) -> None:
    q, k = torch.randn(2, 9, 64), torch.randn(2, 3, 10, 64)
    with pytest.raises(RuntimeError, match="multiple of KV"):
        fn(torch.randn(2, 8, 64), k, k, None, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        fn(q.double(), k.double(), k.double(), None, 1.0)
    with pytest.raises(RuntimeError, match=r"mask must be \[B, T\]"):
        fn(q, k, k, torch.ones(2, 11, dtype=torch.bool), 1.0)
    with pytest.raises(RuntimeError, match="contiguous head dims"):
        fn(q, k.transpose(2, 3).contiguous().transpose(2, 3)[:, :, :, :64], k, None, 1.0)
