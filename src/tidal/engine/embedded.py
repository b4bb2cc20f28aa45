"""The embedded engine: a transformers causal LM, in process, on CPU or CUDA.

`EmbeddedEngine` loads a checkpoint directory (or "tiny") and serves `generate` calls from
any number of threads through a request queue and a worker thread doing continuous
batching (`DecodeBatch`): an idle worker collects what arrives within `batch_wait_s` (up
to `max_batch_size` sequences) into one left-padded prefill; while sequences run, queued
ones are prefilled and merged into the running batch between decode steps, and finished
ones are returned at once. The sampling loop is written here, not delegated to
`generate()`, so that each reported logprob is exactly that of the distribution the
token was drawn from (see `sampling.py`).

Semantics shared with the vLLM engine:
- only `SamplingParams.stop_token_ids` stop a sequence (no implicit EOS: the caller, which
  owns the chat template, says what ends a turn); the stop token is included in the output;
- a prompt must be non-empty, of in-vocabulary ids, and shorter than `max_context`;
  generation stops with "length" at `max_tokens` or when the context is full;
- prompt i of a request seeded `s` samples with seed `mix_seed(s, i)`; a seeded request
  gives the same tokens when run again, whoever shares its batch, up to float noise.

`numerics="consistent"` samples from `consistent.py`'s batch-invariant forward instead
(`ConsistentDecodeBatch`, a slot-store KV cache): a token's logprob is then exactly what
the trainer's `attention="consistent"` recomputes.

Weight updates (`update_weights`, `load_state_dict`) stop admission, let the running
sequences finish, then swap the weights: a sequence never mixes two policy versions.

Prefix caching (`prefix_cache_mb`, on by default): a finished sequence's KV is kept
(`prefix.py`), and a prompt that starts with a kept sequence prefills only the rest, so
an agent's call k+1 computes only the tokens added since call k. The cache is emptied
by every weight update. `Generation.extra["cached_tokens"]` says how many prompt tokens
a call read from it. In standard numerics a reused KV differs from a fresh prefill's at
float-noise level (like padding, below); in consistent numerics not at all.

Deliberately simplified:
- A merged batch is as wide as its longest context (left padding, masked): a short
  sequence next to a long one pays attention over the padding.
- Padding changes logits only at floating-point noise level (reductions of different
  shapes): ~1e-6 in fp32 on the tiny model, which the tests bound.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tidal.engine.base import EngineError, Generation, SamplingParams, TopLogprobs, mix_seed
from tidal.engine.prefix import PrefixCache, PrefixStats
from tidal.engine.sampling import processed_logprobs, sample_tokens
from tidal.engine.tiny import resolve_model

if TYPE_CHECKING:
    import torch

_SEED_MASK = (1 << 63) - 1
NUMERICS = ("standard", "consistent")


@dataclass(frozen=True)
class SequenceRequest:
    """One prompt to continue, with its sampling parameters and its own RNG seed."""

    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class SequenceResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top_logprobs: TopLogprobs | None = None
    cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise EngineError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


class DecodeBatch:
    """The running batch of a continuous-batching sampling loop over one model.

    Rows are sequences; `admit` prefills new sequences (left-padded among themselves) and
    merges their KV cache into the running one (left-padding the shorter cache; padded
    columns are masked out), `step` runs one decode forward for all live rows, and
    `pop_finished` hands back the sequences that stopped. Rows keep their own RNG,
    sampling parameters and position ids, so a sequence's tokens do not depend on when
    it joined or who shares the batch (up to floating-point noise). With a `prefix`
    cache, a finished sequence's KV is kept there and a new prompt prefills only what
    follows its longest cached prefix. The model-specific part (`_prefill`, `_decode`,
    `_keep`, `_extract`, `can_merge`) is what `ConsistentDecodeBatch` replaces.
    """

    def __init__(
        self, model: Any, *, max_context: int, pad_id: int, prefix: PrefixCache | None = None
    ) -> None:
        import torch

        self._model = model
        self._max_context = max_context
        self._pad_id = pad_id
        self._prefix = prefix
        self._device = next(model.parameters()).device
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self._device)
        self._next_pos = torch.zeros((0,), dtype=torch.long, device=self._device)
        self._last = torch.zeros((0,), dtype=torch.long, device=self._device)
        self._temperature = torch.zeros((0,), device=self._device)
        self._top_k = torch.zeros((0,), dtype=torch.long, device=self._device)
        self._top_p = torch.zeros((0,), device=self._device)
        self._rows: list[_Row] = []
        self._finished: list[tuple[Any, SequenceResult]] = []

    def __len__(self) -> int:
        return len(self._rows)

    def admit(self, requests: Sequence[SequenceRequest], tags: Sequence[Any]) -> None:
        """Prefill `requests`, sample their first tokens and add them to the batch."""
        import torch

        if not requests:
            return
        n = len(requests)
        rows = []
        hits: list[tuple[int, Any]] = []
        for r, tag in zip(requests, tags, strict=True):
            gen = torch.Generator(device=self._device)
            gen.manual_seed(r.seed)
            budget = min(r.params.max_tokens, self._max_context - len(r.prompt))
            hit = self._prefix.lookup(r.prompt) if self._prefix is not None else (0, None)
            hits.append(hit)
            rows.append(_Row(tag, gen, frozenset(r.params.stop_token_ids), budget,
                             r.prompt, hit[0], r.params.top_logprobs))
        logits = self._prefill(requests, [row.budget for row in rows], hits)
        temperature = torch.tensor([r.params.temperature for r in requests], device=self._device)
        top_k = torch.tensor([r.params.top_k for r in requests], device=self._device)
        top_p = torch.tensor([r.params.top_p for r in requests], device=self._device)
        lengths = torch.tensor([len(r.prompt) for r in requests], device=self._device)
        self._rows += rows
        self._next_pos = torch.cat([self._next_pos, lengths])
        self._temperature = torch.cat([self._temperature, temperature.float()])
        self._top_k = torch.cat([self._top_k, top_k.long()])
        self._top_p = torch.cat([self._top_p, top_p.float()])
        first = len(self._rows) - n
        self._last = torch.cat([self._last, torch.zeros(n, dtype=torch.long, device=self._device)])
        self._sample(logits, list(range(first, len(self._rows))))
        self._retire()

    def step(self) -> None:
        """One decode forward for every live row, then sample and retire finished rows."""
        if not self._rows:
            return
        logits = self._decode()
        self._next_pos = self._next_pos + 1
        self._sample(logits, list(range(len(self._rows))))
        self._retire()

    # -- the model-specific part: prefill, decode, and the KV cache's rows -----------------

    def _prefill(
        self,
        requests: Sequence[SequenceRequest],
        budgets: list[int],
        hits: Sequence[tuple[int, Any]],
    ) -> Any:
        """Run the new prompts, add their KV cache rows after the running ones, and return
        their last positions' logits [n, V].

        Row i's columns are [pad | its cached prefix (hits[i]) | pad | its new tokens]: the
        cached prefixes are right-aligned in the past part of a fresh cache, the new tokens
        left-padded after it, and the padding masked out."""
        import torch
        from transformers import DynamicCache

        n = len(requests)
        cached = [c for c, _ in hits]
        lengths = [len(r.prompt) - c for r, c in zip(requests, cached, strict=True)]
        past, width = max(cached), max(lengths)
        ids = torch.full((n, width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, past + width), dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        for i, (r, c) in enumerate(zip(requests, cached, strict=True)):
            ids[i, width - lengths[i] :] = torch.tensor(r.prompt[c:], dtype=torch.long)
            mask[i, past - c : past] = 1
            mask[i, past + width - lengths[i] :] = 1
            positions[i, width - lengths[i] :] = torch.arange(c, len(r.prompt))
        ids, mask = ids.to(self._device), mask.to(self._device)
        positions = positions.to(self._device)
        cache = DynamicCache(config=self._model.config)
        if past:
            for layer, (k0, _) in enumerate(next(kv for c, kv in hits if c)):
                keys = k0.new_zeros((n, k0.shape[0], past, k0.shape[-1]))
                values = torch.zeros_like(keys)
                for i, (c, kv) in enumerate(hits):
                    if c:
                        keys[i, :, past - c :] = kv[layer][0][:, :c]
                        values[i, :, past - c :] = kv[layer][1][:, :c]
                cache.update(keys, values, layer)
        with torch.inference_mode():
            out = self._model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        if self._rows:
            self._merge(cache, mask)
        else:
            self._cache, self._mask = cache, mask
        return out.logits[:, -1, :]

    def _decode(self) -> Any:
        """One forward of every row's last token; logits [B, V]."""
        import torch

        self._mask = torch.cat([self._mask, self._mask.new_ones((len(self._rows), 1))], dim=-1)
        with torch.inference_mode():
            out = self._model(
                input_ids=self._last[:, None],
                attention_mask=self._mask,
                position_ids=self._next_pos[:, None],
                past_key_values=self._cache,
                use_cache=True,
            )
        return out.logits[:, -1, :]

    def _extract(self, row: int, n: int) -> tuple[Any, int]:
        """Row `row`'s KV for its first `n` positions, as the prefix cache keeps it: per
        layer (keys, values) of shape [kv heads, n, head dim]; and its size in bytes."""
        cols = self._mask[row].nonzero()[:n, 0]
        kv = [(layer.keys[row].index_select(1, cols), layer.values[row].index_select(1, cols))
              for layer in self._cache.layers]
        return kv, sum(2 * k.nelement() * k.element_size() for k, _ in kv)

    def _keep(self, sel: Any) -> None:
        """Keep the KV cache rows `sel` (the live sequences, in order)."""
        self._cache.batch_select_indices(sel)
        self._mask = self._mask[sel]
        # Drop leading columns that no remaining row attends to.
        lead = int((self._mask.cumsum(-1) == 0).sum(-1).min())
        if lead > 0 and self.can_merge:
            self._mask = self._mask[:, lead:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[..., lead:, :]
                layer.values = layer.values[..., lead:, :]

    @property
    def can_merge(self) -> bool:
        """Whether new rows can join while others run: needs plain full-attention KV layers
        (sliding-window or linear-attention caches cannot be left-padded or trimmed)."""
        if self._cache is None:
            return True
        return all(type(layer).__name__ == "DynamicLayer" for layer in self._cache.layers)

    def live_tags(self) -> list[Any]:
        return [row.tag for row in self._rows]

    def clear(self) -> None:
        """Drop every row (after an error) and forget finished results."""
        self.__init__(  # type: ignore[misc]
            self._model, max_context=self._max_context, pad_id=self._pad_id, prefix=self._prefix
        )

    def pop_finished(self) -> list[tuple[Any, SequenceResult]]:
        done, self._finished = self._finished, []
        return done

    def _sample(self, logits: Any, rows: list[int]) -> None:
        import torch

        sel = torch.tensor(rows, device=self._device)
        temperature = self._temperature[sel]
        lp = processed_logprobs(logits, temperature, self._top_k[sel], self._top_p[sel])
        tokens = sample_tokens(lp, temperature <= 0, [self._rows[i].generator for i in rows])
        token_lp = lp.gather(-1, tokens[:, None])[:, 0]
        self._last[sel] = tokens
        n_top = max(self._rows[i].n_top for i in rows)
        tops = _top_pairs(lp, n_top) if n_top else [[] for _ in rows]
        for i, tok, tok_lp, top in zip(rows, tokens.tolist(), token_lp.tolist(), tops,
                                       strict=True):
            row = self._rows[i]
            row.output_ids.append(tok)
            row.logprobs.append(tok_lp)
            if row.n_top:  # tokens outside top-k / top-p have -inf: not alternatives
                row.top.append(tuple(p for p in top[: row.n_top] if p[1] != float("-inf")))
            if tok in row.stops:
                row.finish = "stop"
            elif len(row.output_ids) >= row.budget:
                row.finish = "length"

    def _retire(self) -> None:
        import torch

        keep = [i for i, row in enumerate(self._rows) if row.finish is None]
        if len(keep) == len(self._rows):
            return
        for i, row in enumerate(self._rows):
            if row.finish is not None:
                self._remember(i)
                top = tuple(row.top) if row.n_top else None
                result = SequenceResult(row.output_ids, row.logprobs, row.finish, top, row.cached)
                self._finished.append((row.tag, result))
        if not keep:
            finished = self._finished
            self.__init__(  # type: ignore[misc]  # back to an empty batch
                self._model, max_context=self._max_context, pad_id=self._pad_id,
                prefix=self._prefix,
            )
            self._finished = finished
            return
        sel = torch.tensor(keep, device=self._device)
        self._keep(sel)
        self._rows = [self._rows[i] for i in keep]
        self._next_pos, self._last = self._next_pos[sel], self._last[sel]
        self._temperature, self._top_k, self._top_p = (
            self._temperature[sel],
            self._top_k[sel],
            self._top_p[sel],
        )

    def _remember(self, i: int) -> None:
        """Keep finished row i's KV in the prefix cache: its prompt and all its output but
        the last token (which was sampled, never run through the model)."""
        row = self._rows[i]
        n = int(self._next_pos[i])
        if self._prefix is None or n < self._prefix.block:
            return
        tokens = row.prompt + tuple(row.output_ids[:-1])
        assert len(tokens) == n, (len(tokens), n)
        kv, nbytes = self._extract(i, n)
        self._prefix.insert(tokens, kv, nbytes)

    def _merge(self, cache: Any, mask: Any) -> None:
        """Append the rows of a freshly prefilled `cache` to the running one."""
        import torch

        old_t, new_t = self._mask.shape[-1], mask.shape[-1]
        width = max(old_t, new_t)

        def left_pad(x: Any, t: int) -> Any:
            if t == width:
                return x
            pad = x.new_zeros((*x.shape[:-2], width - t, x.shape[-1]))
            return torch.cat([pad, x], dim=-2)

        for ours, theirs in zip(self._cache.layers, cache.layers, strict=True):
            ours.keys = torch.cat([left_pad(ours.keys, old_t), left_pad(theirs.keys, new_t)])
            ours.values = torch.cat([left_pad(ours.values, old_t), left_pad(theirs.values, new_t)])
        self._mask = torch.cat(
            [
                torch.nn.functional.pad(self._mask, (width - old_t, 0)),
                torch.nn.functional.pad(mask, (width - new_t, 0)),
            ]
        )


class ConsistentDecodeBatch(DecodeBatch):
    """`DecodeBatch` on `ConsistentModel`'s batch-invariant forward (`consistent.py`).

    The KV cache is one slot store per layer ([S, G, D], zero-filled): each sequence owns
    a region of prompt + budget slots, written as it goes; its queries read their keys
    by slot index. A token's logits then do not depend on the other rows, their number
    or padding, bit for bit. Regions of retired rows are reclaimed when the store
    fills (the live regions are copied to a new, larger store).
    """

    def __init__(
        self, model: Any, *, max_context: int, pad_id: int, prefix: PrefixCache | None = None
    ) -> None:
        import torch

        from tidal.engine.consistent import ConsistentModel

        super().__init__(model, max_context=max_context, pad_id=pad_id, prefix=prefix)
        self._cm = ConsistentModel(model)
        self._store: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._used = 0
        self._start = torch.zeros((0,), dtype=torch.long, device=self._device)

    @property
    def can_merge(self) -> bool:
        return True

    def _capacity(self) -> int:
        return int(self._store[0][0].shape[0]) if self._store else 0

    def _reserve(self, need: int) -> None:
        """Make room for `need` more slots after `_used`, compacting live regions."""
        import torch

        if self._used + need <= self._capacity():
            return
        sizes = [int(p) - len(r.output_ids) + 1 + r.budget
                 for p, r in zip(self._next_pos.tolist(), self._rows, strict=True)]
        cap = max(2 * self._capacity(), sum(sizes) + need, 4096)
        cfg = self._cm
        like = self._cm.model.model.embed_tokens.weight
        store = [
            (like.new_zeros((cap, cfg.n_kv, cfg.head_dim)),
             like.new_zeros((cap, cfg.n_kv, cfg.head_dim)))
            for _ in range(cfg.n_layers)
        ]
        starts, pos = [], 0
        for old, n, size in zip(self._start.tolist(), self._next_pos.tolist(), sizes,
                                strict=True):
            for (k, v), (nk, nv) in zip(self._store, store, strict=True):
                nk[pos : pos + n] = k[old : old + n]
                nv[pos : pos + n] = v[old : old + n]
            starts.append(pos)
            pos += size
        self._store, self._used = store, pos
        self._start = torch.tensor(starts, dtype=torch.long, device=self._device)

    def _run(self, ids_T: Any, pos_T: Any, row_T: Any, starts_R: Any, out_rows: Any) -> Any:
        import torch

        from tidal.engine.consistent import KEY_BLOCK, KeyLists

        width = int(pos_T.max()) + 1
        width += (-width) % KEY_BLOCK
        cap = self._capacity()
        keys = (starts_R[:, None] + torch.arange(width, device=self._device)).clamp_(max=cap - 1)
        lists = KeyLists(keys, row_T, pos_T + 1)
        with torch.inference_mode():
            h = self._cm.hidden(ids_T, pos_T, lists, self._store, starts_R[row_T] + pos_T)
            return self._cm.logits(h.index_select(0, out_rows))

    def _prefill(
        self,
        requests: Sequence[SequenceRequest],
        budgets: list[int],
        hits: Sequence[tuple[int, Any]],
    ) -> Any:
        """Reserve each prompt's region, copy its cached prefix (hits) into the region's
        first slots, and run the rest: a token's KV depends only on its ancestors, so the
        copy is what prefilling it again would write, bit for bit."""
        import torch

        lengths = [len(r.prompt) for r in requests]
        self._reserve(sum(lengths) + sum(budgets))
        starts, pos = [], self._used
        for n, b in zip(lengths, budgets, strict=True):
            starts.append(pos)
            pos += n + b
        self._used = pos
        for s, (c, kv) in zip(starts, hits, strict=True):
            if c:
                for (k, v), (ck, cv) in zip(self._store, kv, strict=True):
                    k[s : s + c] = ck[:c]
                    v[s : s + c] = cv[:c]
        dev = self._device
        starts_R = torch.tensor(starts, dtype=torch.long, device=dev)
        ids_T = torch.tensor([t for r, (c, _) in zip(requests, hits, strict=True)
                              for t in r.prompt[c:]], dtype=torch.long, device=dev)
        pos_T = torch.cat([torch.arange(c, n, device=dev)
                           for n, (c, _) in zip(lengths, hits, strict=True)])
        row_T = torch.cat([torch.full((n - c,), i, device=dev)
                           for i, (n, (c, _)) in enumerate(zip(lengths, hits, strict=True))])
        last = torch.tensor([n - c for n, (c, _) in zip(lengths, hits, strict=True)],
                            device=dev).cumsum(0) - 1
        logits = self._run(ids_T, pos_T, row_T, starts_R, last)
        self._start = torch.cat([self._start, starts_R])
        return logits

    def _decode(self) -> Any:
        import torch

        rows = torch.arange(len(self._rows), device=self._device)
        return self._run(self._last, self._next_pos, rows, self._start, rows)

    def _keep(self, sel: Any) -> None:
        self._start = self._start[sel]

    def _extract(self, row: int, n: int) -> tuple[Any, int]:
        """Per layer (keys, values) of row `row`'s first n slots, [n, kv heads, head dim]."""
        s = int(self._start[row])
        kv = [(k[s : s + n].clone(), v[s : s + n].clone()) for k, v in self._store]
        return kv, sum(2 * k.nelement() * k.element_size() for k, _ in kv)


def _plain_kv(model: Any) -> bool:
    """Whether every layer's KV cache is plain full attention (prefix-cacheable): a
    sliding-window layer keeps only its last window, which a later prompt cannot reuse."""
    from transformers import DynamicCache

    return all(type(layer).__name__ == "DynamicLayer"
               for layer in DynamicCache(config=model.config).layers)


def _top_pairs(lp: Any, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely (token id, logprob) pairs of each row of `lp` [B, V]."""
    values, ids = lp.topk(k, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(),
                                                          strict=True)]


@dataclass
class _Row:
    tag: Any
    generator: Any
    stops: frozenset[int]
    budget: int
    prompt: tuple[int, ...]
    cached: int  # prompt tokens read from the prefix cache
    n_top: int = 0  # alternatives to keep per token (SamplingParams.top_logprobs)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish: str | None = None


def decode_batch(
    model: Any,
    requests: Sequence[SequenceRequest],
    *,
    max_context: int,
    pad_id: int,
) -> list[SequenceResult]:
    """Sample continuations of `requests` admitted together (one left-padded prefill)."""
    batch = DecodeBatch(model, max_context=max_context, pad_id=pad_id)
    batch.admit(requests, list(range(len(requests))))
    results: dict[int, SequenceResult] = {}
    while True:
        for tag, res in batch.pop_finished():
            results[tag] = res
        if not len(batch):
            break
        batch.step()
    return [results[i] for i in range(len(requests))]


@dataclass
class _Pending:
    request: SequenceRequest
    future: Future[tuple[SequenceResult, int, int]]  # result, policy version, batch size
    version: int = 0  # set at admission
    batch_size: int = 0  # rows in the batch right after admission


class EmbeddedEngine:
    """Transformers model behind the `Engine` protocol, with a batching request queue."""

    def __init__(
        self,
        model: str | Path = "tiny",
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        policy_version: int = 0,
        model_name: str | None = None,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.005,
        seed: int | None = None,
        max_context: int | None = None,
        numerics: str = "standard",
        prefix_cache_mb: float = 256.0,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if max_batch_size < 1:
            raise EngineError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_wait_s < 0:
            raise EngineError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
        if numerics not in NUMERICS:
            raise EngineError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        if prefix_cache_mb < 0:
            raise EngineError(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"device {device!r} requested but CUDA is not available")
        self._dir = resolve_model(model)
        self._device = torch.device(device)
        self._dtype = _parse_dtype(dtype)
        self._model = AutoModelForCausalLM.from_pretrained(
            str(self._dir),
            dtype=self._dtype,
            attn_implementation="sdpa",
            local_files_only=True,
        ).to(self._device)  # type: ignore[arg-type]
        self._model.eval()
        self._numerics = numerics
        if numerics == "consistent":
            from tidal.engine.consistent import ConsistencyError, ConsistentModel

            try:
                ConsistentModel(self._model)
            except ConsistencyError as e:
                raise EngineError(str(e)) from e
        config = self._model.config
        self._vocab_size = int(config.vocab_size)
        self._max_context = int(config.max_position_embeddings)
        if max_context is not None:
            if not 1 < max_context <= self._max_context:
                raise EngineError(
                    f"max_context must be in (1, {self._max_context}] for this model, "
                    f"got {max_context}"
                )
            self._max_context = max_context
        pad = getattr(config, "pad_token_id", None)
        self._pad_id = int(pad) if pad is not None else 0
        self._prefix = (
            PrefixCache(int(prefix_cache_mb * 2**20))
            if prefix_cache_mb > 0 and (numerics == "consistent" or _plain_kv(self._model))
            else None
        )
        self._model_name = model_name or (model if model == "tiny" else self._dir.name)
        self._version = int(policy_version)
        self._max_batch = max_batch_size
        self._wait_s = batch_wait_s
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self._model_lock = threading.Lock()  # held while sequences run or weights change
        self._update_lock = threading.Lock()  # one weight update at a time
        self._update_waiting = threading.Event()
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._closed = False
        self._submit_lock = threading.Lock()
        self._worker = threading.Thread(target=self._serve, name="tidal-engine", daemon=True)
        self._worker.start()

    # -- protocol ---------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def model_dir(self) -> Path:
        return self._dir

    @property
    def model(self) -> Any:
        """The underlying transformers model (read it under no concurrent update)."""
        return self._model

    @property
    def prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's counters (lookups, hits, tokens reused, entries, bytes);
        None when it is off (`prefix_cache_mb=0`, or a model with sliding-window layers)."""
        return self._prefix.stats if self._prefix is not None else None

    def generate(
        self, prompts: Sequence[Sequence[int] | npt.NDArray[np.int32]], params: SamplingParams
    ) -> list[Generation]:
        if self._closed:
            raise EngineError("engine is closed")
        if not isinstance(params, SamplingParams):
            raise EngineError(f"params must be SamplingParams, got {type(params).__name__}")
        checked = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        if not checked:
            return []
        pending = []
        for i, prompt in enumerate(checked):
            if params.seed is not None:
                seed = mix_seed(params.seed, i)
            else:
                with self._rng_lock:
                    seed = int(self._rng.integers(0, _SEED_MASK))
            fut: Future[tuple[SequenceResult, int, int]] = Future()
            pending.append(_Pending(SequenceRequest(prompt, params, seed), fut))
        with self._submit_lock:
            if self._closed:
                raise EngineError("engine is closed")
            for item in pending:
                self._queue.put(item)
        results = []
        for item in pending:
            res, version, batch = item.future.result()
            results.append(
                Generation(
                    output_ids=np.asarray(res.output_ids, dtype=np.int32),
                    logprobs=np.asarray(res.logprobs, dtype=np.float32),
                    finish_reason=res.finish_reason,
                    policy_version=version,
                    extra={"batch_size": float(batch), "cached_tokens": float(res.cached_tokens)},
                    top_logprobs=res.top_logprobs,
                )
            )
        return results

    def update_weights(self, source: str | Path, version: int) -> None:
        """Load the weights of a checkpoint directory (safetensors) and set the version."""
        import json

        from safetensors.torch import load_file

        path = Path(source)
        if not path.is_dir():
            raise EngineError(f"update_weights: no checkpoint directory at {path}")
        cfg_path = path / "config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            ours = self._model.config
            for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
                if key in cfg and cfg[key] != getattr(ours, key, None):
                    raise EngineError(
                        f"update_weights: {path} has {key}={cfg[key]!r}, the served model has "
                        f"{getattr(ours, key, None)!r}; weights cannot change the architecture"
                    )
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise EngineError(f"update_weights: no *.safetensors files in {path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        self.load_state_dict(state, version)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """In-process weight sync: copy `state_dict` into the model, set the policy version.

        Keys must match the model's; a tied lm_head.weight may be given (as in
        `model.state_dict()`) or omitted. Waits for running sequences to finish.
        """
        import torch

        if version < 0:
            raise EngineError(f"policy version must be >= 0, got {version}")
        params = dict(self._model.named_parameters(remove_duplicate=False))  # tied keys too
        params.update(dict(self._model.named_buffers(remove_duplicate=False)))
        unexpected = sorted(set(state_dict) - set(params))
        if unexpected:
            raise EngineError(f"load_state_dict: unexpected keys {unexpected[:5]}")
        tied = {"lm_head.weight"} if self._model.config.tie_word_embeddings else set()
        named_params = dict(self._model.named_parameters(remove_duplicate=False))
        missing = sorted(k for k in named_params if k not in state_dict and k not in tied)
        if missing:
            raise EngineError(f"load_state_dict: missing keys {missing[:5]}")
        for key, value in state_dict.items():
            if tuple(value.shape) != tuple(params[key].shape):
                raise EngineError(
                    f"load_state_dict: {key} has shape {tuple(value.shape)}, "
                    f"expected {tuple(params[key].shape)}"
                )
        with self._update_lock:
            self._update_waiting.set()  # the worker stops admitting and drains
            try:
                with self._model_lock, torch.no_grad():
                    for key, value in state_dict.items():
                        params[key].copy_(value.to(device=self._device, dtype=params[key].dtype))
                    self._version = int(version)
                    if self._prefix is not None:
                        self._prefix.clear()  # its KV was computed with the old weights
            finally:
                self._update_waiting.clear()

    def close(self) -> None:
        """Stop the worker thread once queued requests are served."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._worker.join()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _check_prompt(
        self, index: int, prompt: Sequence[int] | npt.NDArray[Any]
    ) -> tuple[int, ...]:
        arr = np.asarray(prompt)
        if arr.ndim != 1:
            raise EngineError(f"prompt {index} must be a flat sequence of token ids")
        if arr.size == 0:
            raise EngineError(f"prompt {index} is empty")
        if not np.issubdtype(arr.dtype, np.integer):
            raise EngineError(f"prompt {index} must hold integer token ids, got {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self._vocab_size:
            bad = lo if lo < 0 else hi
            raise EngineError(
                f"prompt {index} has token id {bad} outside the vocabulary [0, {self._vocab_size})"
            )
        if arr.size >= self._max_context:
            raise EngineError(
                f"prompt {index} is {arr.size} tokens; the context is {self._max_context} "
                "(the prompt must leave room for at least one generated token)"
            )
        return tuple(int(x) for x in arr.tolist())

    def _serve(self) -> None:
        """Worker loop: continuous batching, one model lock per busy period.

        While sequences are live the worker holds the model lock and, between decode steps,
        admits queued sequences (up to `max_batch_size`). A weight update raises
        `_update_waiting`: admission stops, the live sequences finish, the lock is released
        and the update applies, so no sequence ever mixes two weight versions.
        """
        kind = ConsistentDecodeBatch if self._numerics == "consistent" else DecodeBatch
        batch = kind(self._model, max_context=self._max_context, pad_id=self._pad_id,
                     prefix=self._prefix)
        closing = False
        while True:
            if not len(batch):
                if closing:
                    return
                first = self._queue.get()
                if first is None:
                    return
                items, closing = self._collect(self._max_batch - 1, self._wait_s)
                items.insert(0, first)
                with self._model_lock:
                    self._busy_period(batch, items)
            # _busy_period returns only once the batch is empty again.
            if closing and not len(batch):
                return

    def _collect(self, n: int, wait_s: float) -> tuple[list[_Pending], bool]:
        """Up to `n` queued items, waiting at most `wait_s`; True if close() was seen."""
        items: list[_Pending] = []
        deadline = time.monotonic() + wait_s
        while len(items) < n:
            remaining = deadline - time.monotonic()
            try:
                if remaining > 0:
                    item = self._queue.get(timeout=remaining)
                else:
                    item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return items, True
            items.append(item)
        return items, False

    def _busy_period(self, batch: DecodeBatch, items: list[_Pending]) -> None:
        closing = False
        try:
            while True:
                self._admit(batch, items)
                for pending, res in batch.pop_finished():
                    pending.future.set_result((res, pending.version, pending.batch_size))
                if not len(batch):
                    break
                batch.step()
                items = []
                if not closing and not self._update_waiting.is_set() and batch.can_merge:
                    items, closing = self._collect(self._max_batch - len(batch), 0.0)
                for pending, res in batch.pop_finished():
                    pending.future.set_result((res, pending.version, pending.batch_size))
        except Exception as e:  # surface model errors to every caller in the batch
            err = EngineError(f"generation failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            for pending in [*batch.live_tags(), *items]:
                if not pending.future.done():
                    pending.future.set_exception(err)
            batch.clear()
        if closing:
            self._queue.put(None)  # seen while busy: let _serve see it again

    def _admit(self, batch: DecodeBatch, items: list[_Pending]) -> None:
        live = [p for p in items if p.future.set_running_or_notify_cancel()]
        if not live:
            return
        for p in live:
            p.version = self._version
        size = len(batch) + len(live)
        batch.admit([p.request for p in live], live)
        for p in live:
            p.batch_size = size
