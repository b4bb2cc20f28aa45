"""Ancestor-masked attention for packed tree streams, plugged into transformers models.

One interface, three backends, chosen per stream (`StreamPlan.backend`):
- `blocks` (default on CPU): one SDPA call per chain of the stream (see
  `packing.AttentionBlock`): the chain's queries attend to its gathered ancestors (all
  visible) and to itself (causal). Cost: the exact attention FLOPs of the tree (each
  token against its own ancestors) plus one gather of the ancestor keys per chain.
- `dense`: one SDPA call with a 4D bool mask [1, 1, T, C + T] built from the interval
  test `pre[k] <= pre[q] < end[k]` (same tree). Simple reference; costs T x (C + T)
  mask memory and full quadratic attention FLOPs.
- `flex` (default on CUDA): FlexAttention with a block mask from the same interval test,
  O(T) metadata. FlexAttention has no backward on CPU, so CPU never selects it.
- `consistent`: not an attention kernel but the whole forward: the stream runs through
  `tidal.engine.consistent.ConsistentModel`, whose logits are bitwise those an engine
  with `numerics="consistent"` sampled from (trees must fit one stream; slower).

The model is switched to the attention implementation `"tidal_tree"`, which runs the
tree backend when a `StreamPlan` arrives as the model's `attention_mask` (transformers'
mask creation hands it to tidal's mask function, which passes it to every layer
untouched: Qwen2, Llama and the other decoders alike) and plain SDPA otherwise, so
`generate` and ordinary forwards keep working.

A plan can also carry per-layer context keys/values (ancestors computed in an earlier
stream) and capture this stream's keys/values, which is how a partitioned tree gets
its exact gradients (`tidal.train.trainer`).

Shape letters: H query heads, G key/value heads, T stream tokens, C context tokens,
Q block queries, K block keys, D head dim.

Deliberately simplified: sliding-window layers are refused (the plan has no window);
the flex path has not been exercised on a GPU in this repository's tests (no CUDA here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from tidal.train.packing import AttentionBlock, PackedStream, TreeTrainingError

IMPLEMENTATION = "tidal_tree"
BACKENDS = ("auto", "blocks", "dense", "flex", "consistent")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "blocks"
    if backend == "flex" and device.type != "cuda":
        raise ValueError("the flex backend needs CUDA (FlexAttention has no CPU backward)")
    return backend


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, g, k, d = x.shape
    return x[:, :, None].expand(b, g, n_rep, k, d).reshape(b, g * n_rep, k, d)


def _interval_mask(
    tree_q: torch.Tensor,
    pre_q: torch.Tensor,
    tree_k: torch.Tensor,
    pre_k: torch.Tensor,
    end_k: torch.Tensor,
) -> torch.Tensor:
    """[1, 1, Q, K] bool: key k is an ancestor of (or is) query q."""
    same = tree_k[None, :] == tree_q[:, None]
    inside = (pre_k[None, :] <= pre_q[:, None]) & (pre_q[:, None] < end_k[None, :])
    return (same & inside)[None, None]


@dataclass(frozen=True, eq=False)
class _BlockGroup:
    """Blocks with the same visible-to-all keys and query length: one batched SDPA call.

    `q_idx` None means a single contiguous block without ancestors at q_start.
    """

    q_start: int
    q_len: int
    n_blocks: int
    q_idx: torch.Tensor | None  # [n * Q] stream positions, block-major
    own_idx: torch.Tensor | None  # [n * Q] key indices of the blocks' own tokens
    shared_idx: torch.Tensor | None  # [A] key indices visible to every query of the group
    mask: torch.Tensor | None  # [Q, A + Q] bool


def _group_blocks(
    stream: PackedStream, device: torch.device, max_mask_bytes: int
) -> tuple[list[_BlockGroup], torch.Tensor | None]:
    """Group a stream's blocks (siblings under the same ancestors batch together)."""
    by_key: dict[tuple[bytes, int], list[AttentionBlock]] = {}
    for blk in stream.blocks:
        q = blk.q_end - blk.q_start
        by_key.setdefault((blk.key_idx_K[: blk.n_full].tobytes(), q), []).append(blk)
    groups: list[_BlockGroup] = []
    order: list[np.ndarray] = []
    need = 0
    for blks in sorted(by_key.values(), key=lambda b: b[0].q_start):
        b0 = blks[0]
        q_len, n, a = b0.q_end - b0.q_start, len(blks), b0.n_full
        order.append(np.concatenate([np.arange(b.q_start, b.q_end) for b in blks]))
        if n == 1 and a == 0:
            groups.append(_BlockGroup(b0.q_start, q_len, 1, None, None, None, None))
            continue
        mask = None
        if a:
            need += q_len * (a + q_len) * 5 * n  # bool mask plus a float bias per batch row
            if need > max_mask_bytes:
                raise TreeTrainingError(
                    f"stream of {stream.tree_ids}: attention masks need more than "
                    f"{max_mask_bytes} bytes; lower max_tokens or q_chunk"
                )
            mask = torch.ones(q_len, a + q_len, dtype=torch.bool, device=device)
            mask[:, a:] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()

        def t(x: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(x, dtype=torch.int64, device=device)

        groups.append(
            _BlockGroup(
                q_start=b0.q_start,
                q_len=q_len,
                n_blocks=n,
                q_idx=t(order[-1]),
                own_idx=t(np.concatenate([b.key_idx_K[b.n_full :] for b in blks])),
                shared_idx=t(b0.key_idx_K[:a]) if a else None,
                mask=mask,
            )
        )
    flat = np.concatenate(order)
    if (flat == np.arange(flat.size)).all():
        return groups, None
    inv = np.empty_like(flat)
    inv[flat] = np.arange(flat.size)
    return groups, torch.as_tensor(inv, dtype=torch.int64, device=device)


class StreamPlan:
    """Device-side attention plan of one stream; also carries context K/V in and out.

    `ctx_kv[layer]` = (k_1_G_C_D, v_1_G_C_D) for streams with context; when `capture`
    is set, `captured[layer]` receives this stream's (k_1_G_T_D, v_1_G_T_D).
    """

    # A plan is handed to the model as its `attention_mask`. Llama's decoder (and most
    # others) runs every mask through transformers' `create_causal_mask`, which reads a
    # mask's `ndim` and `shape` and then calls the mask function registered for the
    # attention implementation: tidal's (`_plan_mask`) returns the plan itself, so it
    # reaches every layer's attention unchanged, whatever the architecture.
    ndim = 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        n = self.stream.n_tokens
        return (1, 1, n, self.stream.n_context + n)

    def __init__(
        self,
        stream: PackedStream,
        device: torch.device,
        *,
        backend: str,
        max_mask_bytes: int,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        capture: bool = False,
    ) -> None:
        self.backend = resolve_backend(backend, device)
        self.stream = stream
        self.device = device
        self.ctx_kv = ctx_kv
        self.capture = capture
        self.captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        T, C = stream.n_tokens, stream.n_context
        self._groups: list[_BlockGroup] = []
        self._out_order: torch.Tensor | None = None
        self._dense_mask: torch.Tensor | None = None
        self._block_mask: Any = None
        if self.backend == "consistent" and (C or stream.partition is not None):
            raise TreeTrainingError(
                f"stream of {stream.tree_ids}: consistent numerics need each tree in one "
                f"stream (this tree has more tokens than max_tokens); raise max_tokens"
            )
        if self.backend == "blocks":
            self._groups, self._out_order = _group_blocks(stream, device, max_mask_bytes)
        elif self.backend == "dense":
            need = T * (C + T) * 5
            if need > max_mask_bytes:
                raise TreeTrainingError(
                    f"stream of {stream.tree_ids}: a dense {T}x{C + T} mask needs {need} "
                    f"bytes, over the limit of {max_mask_bytes}; lower max_tokens or use "
                    "the blocks backend"
                )
            self._dense_mask = _interval_mask(*self._interval_arrays())

    def _interval_arrays(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.stream
        C = s.n_context

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(a, dtype=torch.int64, device=self.device)

        tk = np.concatenate([np.full(C, s.ctx_tree, dtype=np.int64), s.tree_T])
        pk = np.concatenate([s.ctx_pre_C, s.pre_T])
        ek = np.concatenate([s.ctx_end_C, s.end_T])
        return t(s.tree_T), t(s.pre_T), t(tk), t(pk), t(ek)

    def dense_mask(self) -> torch.Tensor:
        """The [1, 1, T, C + T] ancestor mask (built on demand for any backend)."""
        if self._dense_mask is None:
            return _interval_mask(*self._interval_arrays())
        return self._dense_mask

    def attend(
        self,
        layer: int,
        query_1_H_T_D: torch.Tensor,
        key_1_G_T_D: torch.Tensor,
        value_1_G_T_D: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """Attention output [1, H, T, D] of one layer."""
        if self.capture:
            self.captured[layer] = (key_1_G_T_D, value_1_G_T_D)
        if self.stream.n_context and self.ctx_kv is None:
            raise TreeTrainingError(
                f"stream of {self.stream.tree_ids} needs its ancestors' keys/values (ctx_kv)"
            )
        if self.ctx_kv is not None:
            kc, vc = self.ctx_kv[layer]
            key = torch.cat([kc.to(key_1_G_T_D.dtype), key_1_G_T_D], dim=2)
            value = torch.cat([vc.to(value_1_G_T_D.dtype), value_1_G_T_D], dim=2)
        else:
            key, value = key_1_G_T_D, value_1_G_T_D
        n_rep = query_1_H_T_D.shape[1] // key.shape[1]
        if self.backend == "dense":
            return sdpa(
                query_1_H_T_D,
                _repeat_kv(key, n_rep),
                _repeat_kv(value, n_rep),
                attn_mask=self.dense_mask(),
                scale=scaling,
            )
        if self.backend == "flex":
            return self._flex(query_1_H_T_D, key, value, scaling, n_rep)
        C = self.stream.n_context
        outs = []
        for g in self._groups:
            if g.q_idx is None:  # one contiguous chain without ancestors: plain causal
                q = query_1_H_T_D[:, :, g.q_start : g.q_start + g.q_len]
                k = key[:, :, C + g.q_start : C + g.q_start + g.q_len]
                v = value[:, :, C + g.q_start : C + g.q_start + g.q_len]
                outs.append(sdpa(q, k, v, is_causal=True, scale=scaling, enable_gqa=n_rep > 1))
                continue
            assert g.own_idx is not None
            n = g.n_blocks
            H, D = query_1_H_T_D.shape[1], query_1_H_T_D.shape[3]
            G = key.shape[1]
            q = query_1_H_T_D.index_select(2, g.q_idx).view(H, n, g.q_len, D).transpose(0, 1)
            k_own = key.index_select(2, g.own_idx).view(G, n, g.q_len, D).transpose(0, 1)
            v_own = value.index_select(2, g.own_idx).view(G, n, g.q_len, D).transpose(0, 1)
            if g.shared_idx is not None:
                k_sh = key.index_select(2, g.shared_idx).expand(n, -1, -1, -1)
                v_sh = value.index_select(2, g.shared_idx).expand(n, -1, -1, -1)
                k_all = torch.cat([k_sh, k_own], dim=2)
                v_all = torch.cat([v_sh, v_own], dim=2)
                o = sdpa(q, k_all, v_all, attn_mask=g.mask, scale=scaling, enable_gqa=n_rep > 1)
            else:
                o = sdpa(q, k_own, v_own, is_causal=True, scale=scaling, enable_gqa=n_rep > 1)
            outs.append(o.transpose(0, 1).reshape(1, H, n * g.q_len, D))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out if self._out_order is None else out.index_select(2, self._out_order)

    def _flex(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, n_rep: int
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask

        if self._block_mask is None:
            tq, pq, tk, pk, ek = self._interval_arrays()

            def mask_mod(
                b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
            ) -> torch.Tensor:
                return (tk[ki] == tq[qi]) & (pk[ki] <= pq[qi]) & (pq[qi] < ek[ki])

            self._block_mask = create_block_mask(
                mask_mod, None, None, q.shape[2], k.shape[2], device=str(q.device)
            )
        out = _compiled_flex()(
            q, k, v, block_mask=self._block_mask, scale=scaling, enable_gqa=n_rep > 1
        )
        assert isinstance(out, torch.Tensor)
        return out


_FLEX: Any = None


def _compiled_flex() -> Any:
    global _FLEX  # noqa: PLW0603 - compile once per process
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True)
    return _FLEX


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: tree attention for a StreamPlan, SDPA otherwise."""
    if not isinstance(attention_mask, StreamPlan):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise TreeTrainingError("tree attention does not support sliding-window layers")
    if dropout:
        raise TreeTrainingError("tree attention does not support attention dropout")
    layer = int(getattr(module, "layer_idx", 0))
    out = attention_mask.attend(layer, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def _plan_mask(**kwargs: Any) -> Any:
    """The mask function of the tree attention: a `StreamPlan` passes through unchanged;
    any other mask (a plain forward) is built as SDPA's."""
    from transformers.masking_utils import sdpa_mask

    mask = kwargs.get("attention_mask")
    return mask if isinstance(mask, StreamPlan) else sdpa_mask(**kwargs)


def enable_tree_attention(model: torch.nn.Module) -> None:
    """Register the tree attention and switch `model` to it (SDPA for plain forwards)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, tree_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, _plan_mask)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != IMPLEMENTATION:
        model.set_attn_implementation(IMPLEMENTATION)  # type: ignore[operator]
