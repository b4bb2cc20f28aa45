"""The standard batch's fast decode step: one token per row through fused, pre-packed weights.

A decode step through transformers' forward at batch 16 spends about as long around its
matmuls as in them: per layer, separate q/k/v and gate/up projections (seven skinny
matmuls), the attention mask and position bookkeeping rebuilt every forward, and, as soon
as one row of the batch is padded, `repeat_kv` copying the whole KV cache once per query
head group before SDPA (transformers only passes `enable_gqa` when there is no mask).
`FastDecoder.decode` runs the same step as one loop over the layers: q/k/v and gate/up
are one matmul each (weights concatenated along the output dimension, so each output is
the same dot product as before), every linear layer's weight is packed once for oneDNN's
matmul (`torch.ops.mkldnn._linear_pointwise`: at 16 rows the step's linear layers take
~55 ms instead of ~100 with `F.linear`'s MKL sgemm on a 2-core AVX2 machine, the LM head
2.5x faster), the mask is built once per step, and the attention reads each grouped KV
head once for the query heads that share it (`tidal.engine.decode_attention`, a C++
kernel built on first use; where it cannot be built, SDPA with `enable_gqa=True`, with or
without a mask, reads the grouped heads as they are). The small ops between the matmuls
are one op each from the same extension (`decode_attention.Glue`): the residual add with
the RMS norm after it, rotary with the q/k/v split, silu(gate) x up; rotary's cos and sin
come from a table made once. Where the extension cannot be built, or the weights are not
fp32, the same loop runs the same ops through torch (`decode_attention.TORCH_GLUE`:
transformers' RMSNorm and rotary, op for op). The KV cache is the batch's own
(`GrowingLayer`s of a `DynamicCache`), written through `update`, so prefill (still
transformers' forward), merging, trimming and the prefix cache are untouched.

Numerics: the standard engine's float noise, not bit-identity. Before the attention kernel,
the fused small ops and rotary's table, and without the packing (`packed=False`:
`F.linear` on the concatenated weights), the sampled logprobs were the transformers
forward's bit for bit, for the tiny model and SmolLM2-135M (each output is the same dot
product, in the same kernel);
oneDNN's kernel sums in another order than MKL's, which moved SmolLM2's logprobs by up to
3e-5 (30 layers) and the tiny model's by 3e-6, the same tokens; the attention kernel and
the small ops sum in another order than SDPA and torch (within ~1e-6 of them). The
consistent batch (`consistent_batch.py`) never comes here.

bf16 (`matmul_dtype`, `kv_dtype`: `engine.matmul_dtype`, `engine.kv_dtype`): with bf16
matmuls the fused copies of an fp32 model's linear weights are kept in bf16 (packed for
oneDNN's bf16 kernel, +0.27 GB instead of +0.5 for SmolLM2), a linear layer's input is
rounded to bf16 and its output, summed in fp32 and rounded once to bf16, comes back as
fp32: half the weight bytes a step streams, on a CPU where oneDNN runs bf16 matmuls
(`bf16_matmuls()`: AVX-512, natively with AVX512_BF16 or AMX; elsewhere it is refused).
With a bf16 KV store each key and value is rounded to bf16 as it is written and widened
back to fp32 as the attention reads it (any CPU). The norms, rotary, the attention's
arithmetic and sampling stay fp32. The logprobs are then a bf16 rounding away from the
fp32 trainer's, not its float noise: the loss's correction weighs that mismatch.

Weights: the fused and packed copies are derived from the model's parameters, so they go
stale when the parameters change. `fast_decoder(model)` (the only way the batch gets one)
compares a stamp of the parameters it copied (storage pointer and version counter: an
in-place `copy_`, as `EmbeddedEngine.update_weights` does, bumps the version) on every
decode step (~50 us) and, once per busy period of the batch, also whether the modules
still hold those parameter objects; it rebuilds the copies (~0.4 s for SmolLM2) when
anything changed. `EmbeddedEngine.update_weights` (LoRA arrives there merged) rebuilds
them at once too, so the first step after an update does not pay for it. A change that
bypasses the version counter (`param.data.copy_(...)`) is not seen: call `refresh(model)`
after one.

What is supported: transformers' Llama-family decoders (`model_type` llama, qwen2 or
mistral: RMSNorm, rotary, grouped-query attention with optional q/k/v biases, a SiLU-gated
MLP) on CPU, with full-attention KV layers only (a sliding-window cache is not a
`GrowingLayer`, so the batch keeps transformers' forward for it). Anything else (another
architecture, CUDA) gets `None` and the batch runs transformers' forward as before. Memory:
the packed copies double the memory of the linear weights (+0.5 GB for SmolLM2-135M in
fp32); without oneDNN (or for other dtypes) only q/k/v and gate/up are copied,
concatenated, and used with `F.linear`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.nn.functional import linear

from tidal.engine import decode_attention
from tidal.engine.decode_attention import Glue, Kernel

SUPPORTED = frozenset({"llama", "qwen2", "mistral"})
# their norms: weight * (x * rsqrt(mean(x^2) + variance_epsilon)), computed in fp32
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})

# The row count oneDNN packs the weights for (it works for any count): the engine's default
# max_batch_size. At 16 and at 4 rows, packing for 8 to 256 rows ran within ~5% of each
# other on the machine measured; packing for 1 row was 30% slower at 16 rows.
PACK_ROWS = 16


class Linear:
    """y = x W^T + b for a 2-D x, through a weight packed for oneDNN (`packed=True`) or
    through `F.linear` on the plain weight. Built from one or more `nn.Linear`s whose
    weights are concatenated along the output dimension."""

    def __init__(self, modules: Sequence[torch.nn.Linear], *, packed: bool,
                 dtype: torch.dtype | None = None) -> None:
        weights = [m.weight.detach() for m in modules]
        biases = [m.bias.detach() if m.bias is not None else None for m in modules]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.bias: torch.Tensor | None = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0])
                                   for w, b in zip(weights, biases, strict=True)])
        # `dtype` (bf16 for an fp32 model, `FastDecoder`'s matmul_dtype): the weight and
        # bias are kept in it, the input is rounded to it and the output comes back in the
        # model's dtype
        self.dtype = weight.dtype if dtype is None else dtype
        self.out_dtype = weight.dtype
        weight = weight.to(self.dtype)
        if self.bias is not None:
            self.bias = self.bias.to(self.dtype)
        self.packed = packed
        # The plain weight is kept only on the F.linear path (a single module's is its own
        # parameter, not a copy); the packed one is a copy in oneDNN's blocked layout.
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
                       if packed else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype != self.out_dtype:
            x = x.to(self.dtype)
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        else:
            y = linear(x, self.weight, self.bias)
        return y if y.dtype == self.out_dtype else y.to(self.out_dtype)

    @property
    def flops_per_row(self) -> int:
        return 2 * self.in_features * self.out_features


@dataclass(frozen=True)
class _Layer:
    norm1: torch.nn.Module
    norm2: torch.nn.Module
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    scaling: float


def _rms_params(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """An RMS norm module's weight and epsilon (read each step: the module may be given
    another weight)."""
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    return weight, float(norm.variance_epsilon)  # type: ignore[arg-type]


def unsupported(model: Any) -> str | None:
    """Why `model` has no fast decode step (None: it has one)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {sorted(SUPPORTED)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return "the model has sliding-window layers"
    if kind == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "the model has a sliding window"
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return "the model has no parameters"
    if device.type != "cpu":
        return f"the fast decode step is for CPU, the model is on {device}"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm",
                                                            "rotary_emb")):
        return "not a transformers decoder (model.model.{embed_tokens,layers,norm,rotary_emb})"
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return "the output embedding is not a linear layer"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or hasattr(attn, "q_norm"):
            return "a layer is not self_attn + mlp without q/k norms"
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                  mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if type(m) is not torch.nn.Linear:
                return f"{type(m).__name__} is not a plain nn.Linear"
        for m in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(m).__name__ not in RMS_NORMS:
                return f"{type(m).__name__} is not one of {sorted(RMS_NORMS)}"
    if type(inner.norm).__name__ not in RMS_NORMS:
        return f"{type(inner.norm).__name__} is not one of {sorted(RMS_NORMS)}"
    return None


def _onednn_ok(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here for `dtype` (fp32; bf16 only where
    `bf16_matmuls()`), and agrees with F.linear (bf16: to its rounding)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16 and not bf16_matmuls():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(40, 24, generator=gen).to(dtype)
        b = torch.randn(40, generator=gen).to(dtype)
        x = torch.randn(3, 24, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return bool(torch.allclose(y.float(), linear(x.float(), w.float(), b.float()),
                               rtol=tol, atol=tol))


def bf16_matmuls() -> bool:
    """Whether oneDNN runs bf16 matmuls on this CPU (its own check: AVX-512, natively
    with AVX512_BF16 or AMX). On AVX2 alone torch's bf16 linear ran 2.3x slower than
    fp32's (docs/engine.md)."""
    return bool(torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class FastDecoder:
    """The decode step of a supported model (`unsupported(model) is None`) over the
    batch's `GrowingLayer` KV cache, with fused (and, with oneDNN, packed) weights. Get
    one through `fast_decoder(model)`, which keeps it fresh. `attention`: "kernel"
    (`tidal.engine.decode_attention`; an error where it cannot be built), "sdpa", or None
    for the kernel where it builds and the weights are fp32, else SDPA.
    `small_ops`: the norms, rotary and the MLP's activation as one op each ("fused",
    `decode_attention.Glue`; an error where they cannot be built) or through torch's ops
    ("torch"); None: fused where they build and the weights are fp32.
    `matmul_dtype`: the linear layers' weights and inputs (torch.bfloat16 for an fp32
    model: half the bytes a step streams, on a CPU where oneDNN runs bf16 matmuls,
    `bf16_matmuls()`; their outputs, the norms and the attention stay fp32); None: the
    model's dtype. `kv_dtype`: the KV store's (torch.bfloat16 for an fp32 model: half the
    bytes the attention reads and the prefix cache holds; each key and value is rounded to
    bf16 as it is written, read back widened to fp32); None: the model's dtype."""

    def __init__(self, model: Any, *, packed: bool | None = None,
                 attention: Literal["kernel", "sdpa"] | None = None,
                 small_ops: Literal["fused", "torch"] | None = None,
                 matmul_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"no fast decode step: {why}")
        self.model = model
        inner = model.model
        config = model.config
        attn0 = inner.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(config.num_key_value_heads)
        self.intermediate = int(inner.layers[0].mlp.gate_proj.out_features)
        dtype = next(model.parameters()).dtype
        self.matmul_dtype = dtype if matmul_dtype is None else matmul_dtype
        onednn = _onednn_ok(self.matmul_dtype)
        if self.matmul_dtype != dtype:
            if (dtype, self.matmul_dtype) != (torch.float32, torch.bfloat16):
                raise ValueError(f"matmul_dtype {self.matmul_dtype} for a {dtype} model: only "
                                 "an fp32 model's matmuls can run in bf16")
            if not onednn:
                raise ValueError("matmul_dtype bfloat16: oneDNN runs no bf16 matmuls on this "
                                 "CPU (it needs AVX-512; natively AVX512_BF16 or AMX)")
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        if self.kv_dtype != dtype and (dtype, self.kv_dtype) != (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_dtype {self.kv_dtype} for a {dtype} model: only an fp32 "
                             "model's KV store can be bf16")
        self.packed = onednn if packed is None else packed
        # None: the kernel where it builds (fp32 only), else SDPA
        self.attention: Kernel | None = None
        if attention == "kernel" or (attention is None and dtype == torch.float32):
            self.attention = decode_attention.kernel()
            if self.attention is None and attention == "kernel":
                raise ValueError("no decode-attention kernel here (see the warning)")
        built = None
        if small_ops == "fused" or (small_ops is None and dtype == torch.float32):
            built = decode_attention.glue()
            if built is None and small_ops == "fused":
                raise ValueError("no fused small ops here (see the warning)")
        self.glue: Glue = built or decode_attention.TORCH_GLUE
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [P, D]
        # rope types whose frequencies depend on the length seen compute cos/sin each step
        kind = str(getattr(inner.rotary_emb, "rope_type", "default"))
        self._rotary_table = "dynamic" not in kind and kind != "longrope"
        self._params: list[torch.Tensor] = []
        self._stamp: list[tuple[int, int]] = []
        self.layers: list[_Layer] = []
        self.lm_head: Linear | None = None
        self.rebuild()

    def _sources(self) -> list[torch.Tensor]:
        """The parameters the fused copies are made of, in a fixed order."""
        out: list[torch.Tensor] = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                      mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                out.extend(p for p in m._parameters.values() if p is not None)
        out.extend(p for p in self.model.get_output_embeddings()._parameters.values()
                   if p is not None)
        return out

    @staticmethod
    def _stamp_of(params: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        return [(p.data_ptr(), p._version) for p in params]

    @property
    def stale(self) -> bool:
        """Whether a source parameter changed since the copies were made: written in place
        (its version counter moved), given other storage (`.data = ...`, `.to(...)`), or
        replaced by another parameter object in its module."""
        return (self._stamp_of(self._params) != self._stamp
                or any(a is not b for a, b in zip(self._sources(), self._params, strict=True)))

    @property
    def written(self) -> bool:
        """`stale`'s cheap half, for every step: a source parameter written in place or
        given other storage (not: replaced by another object in its module)."""
        return self._stamp_of(self._params) != self._stamp

    def rebuild(self) -> None:
        """(Re)make the fused and packed copies from the model's present parameters."""
        packed, dt = self.packed, self.matmul_dtype
        layers = []
        with torch.no_grad():
            for layer in self.model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                layers.append(_Layer(
                    norm1=layer.input_layernorm,
                    norm2=layer.post_attention_layernorm,
                    qkv=Linear([attn.q_proj, attn.k_proj, attn.v_proj], packed=packed,
                               dtype=dt),
                    o=Linear([attn.o_proj], packed=packed, dtype=dt),
                    gate_up=Linear([mlp.gate_proj, mlp.up_proj], packed=packed, dtype=dt),
                    down=Linear([mlp.down_proj], packed=packed, dtype=dt),
                    scaling=float(attn.scaling),
                ))
            # Drop the old copies before making the new head (the biggest single copy).
            self.layers, self.lm_head = layers, None
            self.lm_head = Linear([self.model.get_output_embeddings()], packed=packed,
                                  dtype=dt)
        self._params = self._sources()
        self._stamp = self._stamp_of(self._params)

    def linears(self) -> list[Linear]:
        """Every linear layer a decode step runs, in order (for benchmarks)."""
        assert self.lm_head is not None
        return [lin for layer in self.layers
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary's cos and sin [B, D] at `positions` [B]: rows of a table the model's own
        rotary embedding computed once for positions 0..P-1 (grown when a position passes
        P), instead of a cos and a sin every step."""
        inner = self.model.model
        if not self._rotary_table:
            cos, sin = inner.rotary_emb(inner.embed_tokens.weight[:1], positions[:, None])
            return cos[:, 0].contiguous(), sin[:, 0].contiguous()
        top = int(positions.max()) + 1
        if self._rotary is None or self._rotary[0].shape[0] < top:
            size = max(1024, 1 << (top - 1).bit_length())
            probe = inner.embed_tokens.weight[:1]
            cos, sin = inner.rotary_emb(probe, torch.arange(size)[None])
            self._rotary = cos[0].contiguous(), sin[0].contiguous()
        cos, sin = self._rotary
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor,
                store: Sequence[tuple[torch.Tensor, torch.Tensor]],
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the tokens `ids` [N] at `positions` [N] of sequences whose regions in
        `store` (per layer, keys and values [S, KV, D]) begin at `starts` [N]: each token's
        key and value are written at slot `starts + positions`, then it attends to its
        region's slots up to its own. Tokens of one sequence may be several (a prefill,
        in order) or one (a decode step). Returns [len(out_rows), V] for the tokens
        `out_rows` picks (all: [N, V])."""
        assert self.lm_head is not None
        glue, kernel = self.glue, self.attention
        N, D, H, KV = ids.shape[0], self.head_dim, self.n_heads, self.n_kv
        inner = self.model.model
        slots, lengths = starts + positions, positions + 1
        h = inner.embed_tokens(ids)  # [N, hidden], the residual stream (updated in place)
        cos, sin = self._cos_sin(positions)
        delta: torch.Tensor | None = None  # the last MLP's output, not yet added to h
        for layer, (keys, values) in zip(self.layers, store, strict=True):
            w, eps = _rms_params(layer.norm1)
            x = glue.rms_norm(h, w, eps) if delta is None else glue.add_rms_norm(h, delta, w, eps)
            q, k, v = glue.rope_split(layer.qkv(x), cos, sin, H, KV)
            keys.index_copy_(0, slots, k.to(keys.dtype))
            values.index_copy_(0, slots, v.to(values.dtype))
            attend = kernel or decode_attention.reference
            a = attend(q, keys, values, starts, lengths, layer.scaling)
            x = glue.add_rms_norm(h, layer.o(a.reshape(N, H * D)), *_rms_params(layer.norm2))
            delta = layer.down(glue.silu_mul(layer.gate_up(x)))
        assert delta is not None
        if out_rows is not None and out_rows.shape[0] != N:
            h, delta = h.index_select(0, out_rows), delta.index_select(0, out_rows)
        return self.lm_head(glue.add_rms_norm(h, delta, *_rms_params(inner.norm)))


_DECODERS: weakref.WeakKeyDictionary[Any, FastDecoder | None] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def fast_decoder(model: Any, *, thorough: bool = True, matmul_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None) -> FastDecoder | None:
    """`model`'s fast decode step, made on first use and rebuilt when its parameters
    changed since (`FastDecoder.stale`; with `thorough=False` only `written`, the check a
    batch makes on each step, ~20 us, its thorough one once per busy period); None when
    the model is not supported (`unsupported`). `matmul_dtype` and `kv_dtype`
    (`FastDecoder`'s), where given, are the model's from then on (a decoder made with
    others is replaced); None keeps what it has (at first the model's dtype)."""
    with _LOCK:
        if model not in _DECODERS:
            _DECODERS[model] = (FastDecoder(model, matmul_dtype=matmul_dtype, kv_dtype=kv_dtype)
                                if unsupported(model) is None else None)
        known = _DECODERS[model]
        if known is not None:  # what is not asked for stays as it is
            want = (matmul_dtype or known.matmul_dtype, kv_dtype or known.kv_dtype)
            if want != (known.matmul_dtype, known.kv_dtype):
                _DECODERS[model] = FastDecoder(model, matmul_dtype=want[0], kv_dtype=want[1])
        decoder = _DECODERS[model]
        if decoder is not None and (decoder.stale if thorough else decoder.written):
            decoder.rebuild()
        return decoder


def refresh(model: Any) -> None:
    """Rebuild `model`'s fused copies now if it has a fast decoder (after a weight update,
    or a change its parameters' version counters did not record)."""
    with _LOCK:
        decoder = _DECODERS.get(model)
        if decoder is not None:
            decoder.rebuild()
