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

- linear layers run on tiles of exactly `TILE_ROWS` rows (padded): a matmul's result
  for a row then never depends on how many rows came with it (BLAS libraries choose
  other kernels for 1-3 rows than for 16, and GPUs split reductions by shape);
- attention runs on chunks of exactly `QUERY_CHUNK` queries against blocks of exactly
  `KEY_BLOCK` keys, each query's keys gathered in position order from its own list and
  combined block by block with an online softmax (blocks past a query's length are
  exact no-ops: their weights are 0 and the running maximum does not move);
- RMSNorm, RoPE (angles computed elementwise), SiLU and log-softmax work row by row.

Both sides use it: `EmbeddedEngine(numerics="consistent")` samples from it (its KV cache
is a slot store, `ConsistentDecodeBatch` in `consistent_batch.py`), and the trainer's
`attention="consistent"` backend recomputes and trains with it (`tidal.train`), so the
recorded rollout log-probability of a token equals the trainer's bit for bit when the
weights are the same (`tests/engine/test_consistent.py`).

Deliberately simplified: plain PyTorch ops, no fused kernels, so it is several times
slower than the standard path (bench/consistent.py measures it); Qwen2, Qwen3 and Llama
decoders with full attention and default RoPE only; sampling must be at temperature 1
without top-k/top-p for the trainer's plain log-softmax to be the distribution sampled
from (other settings are a different distribution, not a numerical mismatch).

Shape letters: T tokens (queries), S key/value slots, R key lists, L keys of a list,
C queries of a chunk, B keys of a block, H query heads, G key/value heads (H / G = rep
query heads share one), D head dim, V vocabulary, M rows, K input features.
"""

# ruff: noqa: N815 - shape-suffix field names (len_T) are the project convention
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.functional import silu

TILE_ROWS = 16
QUERY_CHUNK = 32
KEY_BLOCK = 64
SUPPORTED = ("qwen2", "qwen3", "llama")


class ConsistencyError(ValueError):
    """The model cannot run with consistent numerics; the message says why."""


class _TiledLinear(torch.autograd.Function):
    """Forward on fixed row tiles; backward as plain full-size matmuls (gradients need
    no bitwise invariance, and one big matmul is far cheaper than a tile each)."""

    @staticmethod
    def forward(
        ctx: Any, x_M_K: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x_M_K, weight)
        ctx.has_bias = bias is not None
        m = x_M_K.shape[0]
        pad = (-m) % TILE_ROWS
        if pad:
            x_M_K = torch.cat([x_M_K, x_M_K.new_zeros(pad, x_M_K.shape[1])])
        out = x_M_K.new_empty((m + pad, weight.shape[0]))
        w_t = weight.t()
        for i in range(0, m + pad, TILE_ROWS):
            rows = slice(i, i + TILE_ROWS)
            if bias is None:
                torch.mm(x_M_K[rows], w_t, out=out[rows])
            else:
                torch.addmm(bias, x_M_K[rows], w_t, out=out[rows])
        return out[:m] if pad else out

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
    """`F.linear` computed on row tiles of exactly TILE_ROWS (zero-padded): each output
    row is a function of its input row alone, whatever M is."""
    out = _TiledLinear.apply(x_M_K, weight, bias)  # type: ignore[no-untyped-call]
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


def block_attention(
    q_T_H_D: torch.Tensor,
    k_S_G_D: torch.Tensor,
    v_S_G_D: torch.Tensor,
    keys: KeyLists,
    scale: float,
) -> torch.Tensor:
    """Attention output [T, H, D]: query t attends to the slots of its key list (its
    ancestors then itself, in position order). `keys.keys_R_L` is padded to a multiple of
    KEY_BLOCK with any valid slot index; padding and keys past a query's length get
    weight exactly 0, and all values must be finite."""
    T, H, D = q_T_H_D.shape
    G = k_S_G_D.shape[1]
    rep = H // G
    out = []
    for c in range(0, T, QUERY_CHUNK):
        q = q_T_H_D[c : c + QUERY_CHUNK]
        lst, ln = keys.list_T[c : c + QUERY_CHUNK], keys.len_T[c : c + QUERY_CHUNK]
        n = q.shape[0]
        if n < QUERY_CHUNK:  # a fixed chunk shape: pad with queries of one key
            q = torch.cat([q, q.new_zeros(QUERY_CHUNK - n, H, D)])
            lst = torch.cat([lst, lst.new_zeros(QUERY_CHUNK - n)])
            ln = torch.cat([ln, ln.new_ones(QUERY_CHUNK - n)])
        q_C_G_rep_D = q.view(QUERY_CHUNK, G, rep, D)
        rows = keys.keys_R_L.index_select(0, lst)
        m = q.new_full((QUERY_CHUNK, G, rep, 1), float("-inf"))
        den = q.new_zeros((QUERY_CHUNK, G, rep, 1))
        acc = q.new_zeros((QUERY_CHUNK, G, rep, D))
        cols = torch.arange(KEY_BLOCK, device=q.device)
        for j in range(0, int(ln.max()), KEY_BLOCK):
            idx = rows[:, j : j + KEY_BLOCK].reshape(-1)
            k = k_S_G_D.index_select(0, idx).view(QUERY_CHUNK, KEY_BLOCK, G, D)
            v = v_S_G_D.index_select(0, idx).view(QUERY_CHUNK, KEY_BLOCK, G, D)
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
        out.append((acc / den).view(QUERY_CHUNK, H, D)[:n])
    return torch.cat(out) if len(out) > 1 else out[0]


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
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (after the last norm).

        Without `cache`, the key/value slots are the T tokens themselves (a tree stream:
        `keys` index into it). With `cache` (per layer (k_S_G_D, v_S_G_D)), the tokens'
        keys/values are first written at `slots_T`, and `keys` index the cache."""
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
            o = block_attention(q, k, v, keys, self.scale)
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
