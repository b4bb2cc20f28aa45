"""Consistent numerics: one forward whose logits do not depend on what shares the batch.

Generation and training compute a token's log-probability differently: the engine
decodes one token per sequence against a KV cache, in batches that change every step;
the trainer runs whole packed tree streams. The float operations differ in shape, so
kernels pick different reduction orders and the two log-probabilities differ in the last
bits (fp32) or more (bf16): the train/inference mismatch that `LossConfig.correction`
corrects. `ConsistentModel` removes it instead. Its forward computes every token's
hidden state from the token, its position and its ancestors' keys/values only, with
every kernel called at a fixed shape, so the same token in the same context gets
bitwise the same logits whether the engine decodes it in a batch of 1 or 16 or the
trainer recomputes it inside a 4,000-token tree stream:

- linear layers run on fixed row tiles (padded): a matmul's result for a row then never
  depends on how many rows came with it (BLAS libraries choose other kernels for 1-3
  rows than for 16, and GPUs split reductions by shape). `TILE_ROWS` is the reference;
  another tile of `ROW_TILES` (4..256) is used only where it was checked to give every
  row the reference's bits (`tile_sizes`), so a decode batch of 8 is not padded to 16
  and a long stream reads each weight once per 256 rows;
- attention runs on fixed query chunks (`QUERY_CHUNK` the reference, `QUERY_CHUNKS`
  where they agree: `chunk_sizes`) against blocks of exactly `KEY_BLOCK` keys, each
  query's keys gathered in position order from its own list and combined block by
  block with an online softmax (blocks past a query's length are exact no-ops: their
  weights are 0 and the running maximum does not move);
- RMSNorm, RoPE (angles computed elementwise), SiLU and log-softmax work row by row;
  the vocabulary projection and its log-softmax run 256 rows at a time
  (`tiled_logprobs`), never as one [N, V] matrix.

Gradients need no bitwise identity: the linear layers' backward is one full-size
matmul, attention's is plain softmax attention per query chunk (`_BlockAttention`),
the log-softmax's comes from the softmax its forward kept.

Both sides use it: `EmbeddedEngine(numerics="consistent")` samples from it (its KV cache
is a slot store, `ConsistentDecodeBatch` in `consistent_batch.py`), and the trainer's
`attention="consistent"` backend recomputes and trains with it (`tidal.train`), so the
recorded rollout log-probability of a token equals the trainer's bit for bit when the
weights are the same (`tests/engine/test_consistent.py`).

Deliberately simplified: plain PyTorch ops, no fused kernels (bench/consistent.py
measures the cost against the standard path: ~1.1-1.2x); Qwen2, Qwen3 and Llama
decoders with full attention and default RoPE only; sampling must be at temperature 1
without top-k/top-p for the trainer's plain log-softmax to be the distribution sampled
from (other settings are a different distribution, not a numerical mismatch).

Shape letters: T tokens (queries), S key/value slots, R key lists, L keys of a list,
C queries of a chunk, B keys of a block, H query heads, G key/value heads (H / G = rep
query heads share one), D head dim, V vocabulary, M rows, K input features.
"""

# ruff: noqa: N815 - shape-suffix field names (len_T) are the project convention
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.functional import silu

TILE_ROWS = 16  # the reference row tile: every row's result is what this tile gives
ROW_TILES = (4, 8, 16, 64, 256)  # the tiles used where they agree with it (`tile_sizes`)
QUERY_CHUNK = 16  # the reference query chunk of attention
QUERY_CHUNKS = (4, 8, 16, 64, 256)
KEY_BLOCK = 64
WIDE_ROWS = 256  # rows per block of the vocabulary projection in `tiled_logprobs`
KEEP_PROBS_BYTES = 2 << 30  # the largest softmax `tiled_logprobs` keeps for backward
BACKWARD_BYTES = 64 << 20  # attention scores per query chunk in backward
SUPPORTED = ("qwen2", "qwen3", "llama")


# attention as a function of (q [T, H, D], k [S, G, D], v [S, G, D]) -> [T, H, D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ConsistencyError(ValueError):
    """The model cannot run with consistent numerics; the message says why."""


_AGREES: dict[tuple[Any, ...], bool] = {}


def tile_plan(m: int, sizes: tuple[int, ...]) -> list[int]:
    """Tile sizes covering m rows, from `sizes` (sorted): the largest that fit, then the
    smallest that holds the rest if it wastes at most half of itself, zero-padded."""
    plan, left = [], m
    while left > 0:
        holds = [t for t in sizes if left <= t <= 2 * left]
        if holds:
            plan.append(holds[0])
            break
        fits = [t for t in sizes if t <= left]
        plan.append(fits[-1] if fits else sizes[0])
        left -= plan[-1]
    return plan


def _agreeing(key: tuple[Any, ...], candidates: tuple[int, ...], ref: int,
              run: Any) -> tuple[int, ...]:
    """The candidate sizes whose results equal the reference size's, bit for bit, on
    random inputs (`run(n_rows, size)`: the n rows computed in pieces of `size`); the
    reference is always kept. Checked once per key: two kernels that order a row's sums
    differently disagree on random data."""
    sizes = _SIZES.get(key)
    if sizes is None:
        ok = [ref]
        with torch.no_grad():
            for size in candidates:
                if size != ref:
                    n = max(size, ref)
                    if torch.equal(run(n, size), run(n, ref)):
                        ok.append(size)
        sizes = _SIZES[key] = tuple(sorted(ok))
    return sizes


_SIZES: dict[tuple[Any, ...], tuple[int, ...]] = {}


def _mm_pieces(x_M_K: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None,
               plan: list[int]) -> torch.Tensor:
    """x @ w_t (+ bias), one kernel call per tile of the plan; a last tile that the rows
    do not fill is zero-padded."""
    m = x_M_K.shape[0]
    out = x_M_K.new_empty((m, w_t.shape[1]))
    start = 0
    for size in plan:
        n = min(size, m - start)
        x = x_M_K[start : start + n]
        o = out[start : start + n]
        if n < size:
            x = torch.cat([x, x.new_zeros(size - n, x.shape[1])])
            o = x.new_empty((size, w_t.shape[1]))
        if bias is None:
            torch.mm(x, w_t, out=o)
        else:
            torch.addmm(bias, x, w_t, out=o)
        if n < size:
            out[start:] = o[:n]
        start += n
    return out


def tile_sizes(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...]:
    """The row tiles of `x @ weight.T` that give every row bit for bit what a TILE_ROWS
    tile does, on this device, dtype and thread count. Where more than one agrees, a
    batch of 8 runs as one 8-row tile (no padding to 16) and 1,000 rows as 256-row
    tiles (the weight read once per 256 rows, not per 16)."""
    key = ("linear", tuple(weight.shape), weight.dtype, weight.device, bias is not None,
           torch.get_num_threads())
    w_t, b = weight.detach().t(), None if bias is None else bias.detach()

    def run(n: int, size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(n, weight.shape[1], generator=gen).to(weight)
        return _mm_pieces(x, w_t, b, [size] * (n // size))

    return _agreeing(key, ROW_TILES, TILE_ROWS, run)


def _tiled_mm(x_M_K: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on fixed row tiles (`tile_sizes`, `tile_plan`)."""
    plan = tile_plan(x_M_K.shape[0], tile_sizes(weight, bias))
    return _mm_pieces(x_M_K, weight.t(), bias, plan)


class _TiledLinear(torch.autograd.Function):
    """Forward on fixed row tiles; backward as plain full-size matmuls (gradients need
    no bitwise invariance, and one big matmul is far cheaper than a tile each)."""

    @staticmethod
    def forward(
        ctx: Any, x_M_K: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x_M_K, weight)
        ctx.has_bias = bias is not None
        return _tiled_mm(x_M_K, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_M_K, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad @ weight if need_x else None
        grad_w = grad.t() @ x_M_K if need_w else None
        grad_b = grad.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b


def tiled_linear(
    x_M_K: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear` computed on fixed row tiles (zero-padded): each output row is a
    function of its input row alone, whatever M is."""
    out = _TiledLinear.apply(x_M_K, weight, bias)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


class _TiledLogprobs(torch.autograd.Function):
    """log_softmax(float32 logits)[target] per row, the logits on fixed tiles, WIDE_ROWS
    rows at a time. For backward the forward keeps the softmax [M, V] when it fits in
    KEEP_PROBS_BYTES (as a plain forward keeps its logits); otherwise the [M, V] never
    exists whole and backward recomputes each row block's logits with one matmul."""

    @staticmethod
    def forward(
        ctx: Any, h_M_K: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        target_M: torch.Tensor,
    ) -> torch.Tensor:
        m, vocab = h_M_K.shape[0], weight.shape[0]
        keep = (torch.is_grad_enabled() and any(ctx.needs_input_grad[:3])
                and m * vocab * 4 <= KEEP_PROBS_BYTES)
        probs = h_M_K.new_empty((m, vocab), dtype=torch.float32) if keep else None
        out = h_M_K.new_empty(m, dtype=torch.float32)
        for i in range(0, m, WIDE_ROWS):
            rows = slice(i, i + WIDE_ROWS)
            lp = _tiled_mm(h_M_K[rows], weight, bias).float().log_softmax(-1)
            out[rows] = lp.gather(1, target_M[rows, None])[:, 0]
            if probs is not None:
                torch.exp(lp, out=probs[rows])
        ctx.save_for_backward(h_M_K, weight, bias, target_M, probs)
        return out

    @staticmethod
    def backward(ctx: Any, grad_M: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h_M_K, weight, bias, target_M, probs = ctx.saved_tensors
        need_h, need_w, need_b, _ = ctx.needs_input_grad
        grad_h = torch.empty_like(h_M_K) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        for i in range(0, h_M_K.shape[0], WIDE_ROWS):
            rows = slice(i, i + WIDE_ROWS)
            h, g = h_M_K[rows], grad_M[rows]
            p = (probs[rows] if probs is not None
                 else torch.nn.functional.linear(h, weight, bias).float().softmax(-1))
            d_logits = p.mul(-g[:, None])  # d lp[t] / d logits
            d_logits.scatter_add_(1, target_M[rows, None], g[:, None].float())
            d_logits = d_logits.to(weight.dtype)
            if grad_h is not None:
                torch.mm(d_logits, weight, out=grad_h[rows])
            if grad_w is not None:
                grad_w.addmm_(d_logits.t(), h)
            if grad_b is not None:
                grad_b += d_logits.sum(0)
        return grad_h, grad_w, grad_b, None


def tiled_logprobs(
    h_M_K: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    target_M: torch.Tensor,
) -> torch.Tensor:
    """Float32 log-probabilities [M] of `target_M` under `tiled_linear(h, weight, bias)`'s
    logits: bitwise `tiled_linear(...).float().log_softmax(-1)` at the targets."""
    out = _TiledLogprobs.apply(h_M_K, weight, bias, target_M)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32 (as transformers' Qwen2/Llama norm)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclass(frozen=True)
class KeyLists:
    """Which slots each query attends to: `keys_R_L[list_T[t], :len_T[t]]`."""

    keys_R_L: torch.Tensor
    list_T: torch.Tensor
    len_T: torch.Tensor


def _attend(
    q_T_H_D: torch.Tensor,
    k_S_G_D: torch.Tensor,
    v_S_G_D: torch.Tensor,
    keys: KeyLists,
    scale: float,
    *,
    plan: list[int],
) -> torch.Tensor:
    """Attention output [T, H, D] on query chunks of exactly the plan's sizes (a last
    one zero-padded) against key blocks of exactly KEY_BLOCK, combined with an online
    softmax."""
    _, H, D = q_T_H_D.shape
    G = k_S_G_D.shape[1]
    rep = H // G
    out = []
    cols = torch.arange(KEY_BLOCK, device=q_T_H_D.device)
    c = 0
    for chunk in plan:
        q = q_T_H_D[c : c + chunk]
        lst, ln = keys.list_T[c : c + chunk], keys.len_T[c : c + chunk]
        c += chunk
        n = q.shape[0]
        if n < chunk:  # a fixed chunk shape: pad with queries of one key
            q = torch.cat([q, q.new_zeros(chunk - n, H, D)])
            lst = torch.cat([lst, lst.new_zeros(chunk - n)])
            ln = torch.cat([ln, ln.new_ones(chunk - n)])
        q_C_G_rep_D = q.view(chunk, G, rep, D)
        rows = keys.keys_R_L.index_select(0, lst)
        m = q.new_full((chunk, G, rep, 1), float("-inf"))
        den = q.new_zeros((chunk, G, rep, 1))
        acc = q.new_zeros((chunk, G, rep, D))
        for j in range(0, int(ln.max()), KEY_BLOCK):
            idx = rows[:, j : j + KEY_BLOCK].reshape(-1)
            k = k_S_G_D.index_select(0, idx).view(chunk, KEY_BLOCK, G, D)
            v = v_S_G_D.index_select(0, idx).view(chunk, KEY_BLOCK, G, D)
            k, v = k.permute(0, 2, 3, 1), v.transpose(1, 2)  # [C, G, D, B], [C, G, B, D]
            s = torch.matmul(q_C_G_rep_D, k) * scale  # [C, G, rep, B]
            valid = (j + cols)[None, :] < ln[:, None]  # [C, B]
            s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            den = den * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, v)
            m = m_new
        out.append((acc / den).view(chunk, H, D)[:n])
    return torch.cat(out) if len(out) > 1 else out[0]


def chunk_sizes(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, ...]:
    """The query chunks of attention that give every query bit for bit what a
    QUERY_CHUNK chunk does (checked once per shape, as `tile_sizes`)."""
    key = ("attention", heads, kv_heads, head_dim, dtype, device, torch.get_num_threads())
    n_keys = 2 * KEY_BLOCK + 5
    width = n_keys + (-n_keys) % KEY_BLOCK

    def run(n: int, size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(r, h, head_dim, generator=gen).to(dtype=dtype, device=device)
                   for r, h in ((n, heads), (n_keys, kv_heads), (n_keys, kv_heads)))
        lists = KeyLists(
            torch.randint(0, n_keys, (n, width), generator=gen).to(device),
            torch.arange(n, device=device),
            torch.randint(1, n_keys + 1, (n,), generator=gen).to(device),
        )
        return _attend(q, k, v, lists, 0.125, plan=[size] * (n // size))

    return _agreeing(key, QUERY_CHUNKS, QUERY_CHUNK, run)


def _attention(
    q_T_H_D: torch.Tensor, k_S_G_D: torch.Tensor, v_S_G_D: torch.Tensor, keys: KeyLists,
    scale: float,
) -> torch.Tensor:
    """`_attend` on the query chunks that agree with QUERY_CHUNK ones (`chunk_sizes`):
    a decode batch of 8 in one chunk of 8, a long stream in chunks of 256."""
    T, H, D = q_T_H_D.shape
    sizes = chunk_sizes(H, k_S_G_D.shape[1], D, q_T_H_D.dtype, q_T_H_D.device)
    return _attend(q_T_H_D, k_S_G_D, v_S_G_D, keys, scale, plan=tile_plan(T, sizes))


class _BlockAttention(torch.autograd.Function):
    """`_attention` forward; backward as plain softmax attention, recomputed per query
    chunk over each query's gathered keys (gradients need no bitwise invariance)."""

    @staticmethod
    def forward(  # noqa: PLR0917 - autograd passes apply's arguments positionally
        ctx: Any, q_T_H_D: torch.Tensor, k_S_G_D: torch.Tensor, v_S_G_D: torch.Tensor,
        keys_R_L: torch.Tensor, list_T: torch.Tensor, len_T: torch.Tensor, scale: float,
        grad_fn: AttentionFn | None,
    ) -> torch.Tensor:
        out = _attention(q_T_H_D, k_S_G_D, v_S_G_D, KeyLists(keys_R_L, list_T, len_T), scale)
        ctx.save_for_backward(q_T_H_D, k_S_G_D, v_S_G_D, out, keys_R_L, list_T, len_T)
        ctx.scale = scale
        ctx.grad_fn = grad_fn
        return out

    @staticmethod
    def backward(ctx: Any, grad_T_H_D: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q_T_H_D, k_S_G_D, v_S_G_D, out_T_H_D, keys_R_L, list_T, len_T = ctx.saved_tensors
        if ctx.grad_fn is not None:  # the same attention through fused kernels
            with torch.enable_grad():
                qkv = [x.detach().requires_grad_() for x in (q_T_H_D, k_S_G_D, v_S_G_D)]
                dq, dk, dv = torch.autograd.grad(ctx.grad_fn(*qkv), qkv, grad_T_H_D)
            return dq, dk, dv, None, None, None, None, None
        scale = ctx.scale
        T, H, D = q_T_H_D.shape
        G = k_S_G_D.shape[1]
        rep = H // G
        dq = torch.empty_like(q_T_H_D)
        dk = torch.zeros_like(k_S_G_D)
        dv = torch.zeros_like(v_S_G_D)
        # a chunk's queries against the union of their keys (a tree stream's neighbours
        # share most ancestors), the [H, C, U] scores near BACKWARD_BYTES
        per_query = max(int(len_T.max()), 1) * H * 4 * 4
        chunk = max(QUERY_CHUNK, BACKWARD_BYTES // per_query)
        for c in range(0, T, chunk):
            sl = slice(c, c + chunk)
            ln = len_T[sl]
            L = int(ln.max())
            rows = keys_R_L.index_select(0, list_T[sl])[:, :L]  # [C, L]
            n = rows.shape[0]
            valid = torch.arange(L, device=rows.device)[None, :] < ln[:, None]
            union = torch.unique(rows[valid])  # sorted slots: [U]
            u = union.shape[0]
            where = torch.searchsorted(union, rows.contiguous()).clamp_(max=u - 1)
            where.masked_fill_(~valid, u)  # keys past a query's length: a spare column
            seen = torch.zeros(n, u + 1, dtype=torch.bool, device=rows.device)
            seen.scatter_(1, where, True)  # [C, U]: key u is in query c's list
            mask = seen[None, :, :u].expand(rep, n, u).reshape(rep * n, u)

            def heads(x: torch.Tensor, m: int = n) -> torch.Tensor:  # [m, H, D] -> [G, rep*m, D]
                return x.reshape(m, G, rep, D).permute(1, 2, 0, 3).reshape(G, rep * m, D)

            q, g, o = heads(q_T_H_D[sl]), heads(grad_T_H_D[sl]), heads(out_T_H_D[sl])
            k = k_S_G_D.index_select(0, union).transpose(0, 1)  # [G, U, D]
            v = v_S_G_D.index_select(0, union).transpose(0, 1)
            s = torch.bmm(q, k.transpose(1, 2)) * scale  # [G, rep*C, U]
            p = s.masked_fill_(~mask, float("-inf")).softmax(-1)
            dp = torch.bmm(g, v.transpose(1, 2))
            ds = p * (dp - (g * o).sum(-1, keepdim=True)) * scale
            dq[sl] = torch.bmm(ds, k).view(G, rep, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
            dk.index_add_(0, union, torch.bmm(ds.transpose(1, 2), q).transpose(0, 1))
            dv.index_add_(0, union, torch.bmm(p.transpose(1, 2), g).transpose(0, 1))
        return dq, dk, dv, None, None, None, None, None


def block_attention(
    q_T_H_D: torch.Tensor,
    k_S_G_D: torch.Tensor,
    v_S_G_D: torch.Tensor,
    keys: KeyLists,
    scale: float,
    *,
    grad_fn: AttentionFn | None = None,
) -> torch.Tensor:
    """Attention output [T, H, D]: query t attends to the slots of its key list (its
    ancestors then itself, in position order). `keys.keys_R_L` is padded to a multiple of
    KEY_BLOCK with any valid slot index; padding and keys past a query's length get
    weight exactly 0, and all values must be finite.

    Differentiable (`_BlockAttention`): the gradients are those of `grad_fn(q, k, v)`
    when given (the same attention through fused kernels: the trainer's tree attention),
    else of plain softmax attention over each query chunk's keys."""
    if torch.is_grad_enabled() and (q_T_H_D.requires_grad or k_S_G_D.requires_grad
                                    or v_S_G_D.requires_grad):
        out = _BlockAttention.apply(  # type: ignore[no-untyped-call]
            q_T_H_D, k_S_G_D, v_S_G_D, keys.keys_R_L, keys.list_T, keys.len_T, scale,
            grad_fn)
        assert isinstance(out, torch.Tensor)
        return out
    return _attention(q_T_H_D, k_S_G_D, v_S_G_D, keys, scale)


class ConsistentModel:
    """The batch-invariant forward of a transformers Qwen2/Qwen3/Llama causal LM, reading
    its parameters in place (weight updates and gradients reach the same tensors)."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        kind = getattr(cfg, "model_type", None)
        if kind not in SUPPORTED:
            raise ConsistencyError(
                f"consistent numerics support {', '.join(SUPPORTED)} models, not {kind!r}"
            )
        if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (
            getattr(cfg, "layer_types", None) or ()
        ):
            raise ConsistencyError("consistent numerics do not support sliding-window layers")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ConsistencyError(f"consistent numerics need SiLU MLPs, not {cfg.hidden_act!r}")
        rope = getattr(model.model, "rotary_emb", None)
        if rope is None or getattr(rope, "rope_type", "default") != "default":
            raise ConsistencyError("consistent numerics support the default RoPE only")
        self.model = model
        self.layers = list(model.model.layers)
        self.eps = float(cfg.rms_norm_eps)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.scale = self.head_dim**-0.5
        self.rope = rope

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def _rope(self, pos_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.rope.inv_freq.float()
        freqs = pos_T.float()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, D]
        scaling = float(getattr(self.rope, "attention_scaling", 1.0))
        return emb.cos() * scaling, emb.sin() * scaling

    def hidden(
        self,
        ids_T: torch.Tensor,
        pos_T: torch.Tensor,
        keys: KeyLists,
        cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        slots_T: torch.Tensor | None = None,
        *,
        attention_grad: AttentionFn | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (after the last norm).

        Without `cache`, the key/value slots are the T tokens themselves (a tree stream:
        `keys` index into it). With `cache` (per layer (k_S_G_D, v_S_G_D)), the tokens'
        keys/values are first written at `slots_T`, and `keys` index the cache.
        `attention_grad`: the same attention as a plain differentiable function, whose
        gradients attention's backward takes (`block_attention`)."""
        T = ids_T.shape[0]
        x = self.model.model.embed_tokens(ids_T)
        cos, sin = self._rope(pos_T)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        H, G, D = self.n_heads, self.n_kv, self.head_dim
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            h = rms_norm(x, layer.input_layernorm.weight, self.eps)
            q = tiled_linear(h, att.q_proj.weight, att.q_proj.bias).view(T, H, D)
            k = tiled_linear(h, att.k_proj.weight, att.k_proj.bias).view(T, G, D)
            v = tiled_linear(h, att.v_proj.weight, att.v_proj.bias).view(T, G, D)
            if hasattr(att, "q_norm"):  # Qwen3: per-head norms before RoPE
                q = rms_norm(q, att.q_norm.weight, self.eps)
                k = rms_norm(k, att.k_norm.weight, self.eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if cache is not None:
                if slots_T is None:
                    raise ValueError("a cache needs slots_T")
                ks, vs = cache[i]
                ks.index_copy_(0, slots_T, k.to(ks.dtype))
                vs.index_copy_(0, slots_T, v.to(vs.dtype))
                k, v = ks, vs
            o = block_attention(q, k, v, keys, self.scale, grad_fn=attention_grad)
            x = x + tiled_linear(o.reshape(T, H * D), att.o_proj.weight, att.o_proj.bias)
            h = rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            gate = tiled_linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = tiled_linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
            x = x + tiled_linear(silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        return rms_norm(x, self.model.model.norm.weight, self.eps)

    def logits(self, hidden_M: torch.Tensor) -> torch.Tensor:
        """Float32 logits [M, V] of hidden rows."""
        head = self.model.get_output_embeddings()
        return tiled_linear(hidden_M, head.weight, getattr(head, "bias", None)).float()

    def logprobs(self, hidden_M: torch.Tensor, target_M: torch.Tensor) -> torch.Tensor:
        """Float32 log-probabilities [M] of the targets: bitwise
        `logits(hidden).log_softmax(-1)` at them, without the [M, V] logits."""
        head = self.model.get_output_embeddings()
        return tiled_logprobs(hidden_M, head.weight, getattr(head, "bias", None), target_M)


def stream_key_lists(
    blocks: Any, n_tokens: int, device: torch.device
) -> KeyLists:
    """Key lists of a packed tree stream without context (`tidal.train.packing`): each
    `AttentionBlock`'s queries share its key list, query r of the block using its first
    `n_full + r + 1` keys (ancestors root first, then its own chain up to itself)."""
    width = max(int(b.key_idx_K.shape[0]) for b in blocks)
    width += (-width) % KEY_BLOCK
    keys = np.zeros((len(blocks), width), dtype=np.int64)
    list_T = np.zeros(n_tokens, dtype=np.int64)
    len_T = np.zeros(n_tokens, dtype=np.int64)
    for r, b in enumerate(blocks):
        keys[r, : b.key_idx_K.shape[0]] = b.key_idx_K
        list_T[b.q_start : b.q_end] = r
        len_T[b.q_start : b.q_end] = b.n_full + 1 + np.arange(b.q_end - b.q_start)

    def t(a: Any) -> torch.Tensor:
        return torch.as_tensor(a, device=device)

    return KeyLists(t(keys), t(list_T), t(len_T))
