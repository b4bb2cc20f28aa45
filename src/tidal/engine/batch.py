"""The standard KV batch: the embedded engine's sampling loop over a transformers model.

`DecodeBatch` is the running batch of continuous batching: `admit` prefills new
sequences in one left-padded forward and merges their KV cache into the running one
(the shorter cache left-padded, the padding masked), `step` runs one decode forward for
every live row, and finished rows are dropped and handed back at once (`pop_finished`);
leading columns no row attends to are trimmed. The sampling loop is written here, not
delegated to `generate()`, so that each reported logprob is exactly that of the
distribution the token was drawn from (see `sampling.py`). Only a request's
`stop_token_ids` stop a row (the stop token is included); a row stops with "length" at
`max_tokens` or when the context is full. Each row samples from its own seeded
generator, so a seeded request gives the same tokens whoever shares its batch, up to
float noise.

Why it is a module of its own: it is the engine's numerics without its threads. Nothing
here knows about queues, locks or weight versions (`embedded.py` feeds it), so it can be
run to the end synchronously (`decode_batch`) and compared with single-sequence runs,
and the region batches (`regions.py`: the consistent one and the fast one, which the
engine runs for the models `fused.py` supports) replace only its model-specific part
(`_prefill`, `_decode`, `_keep`, `_extract`, `can_merge`; the fast one also
`_decode_admitting`, a decode step that prefills new prompts too) and keep the
bookkeeping.
This one is for the rest: other architectures, sliding-window caches, CUDA.

Prefix caching: with a `PrefixCache` (`prefix.py`), a finished sequence's KV is kept,
and a prompt that starts with a kept sequence prefills only the rest, so an agent's
call k+1 computes only the tokens added since call k. `SequenceResult.cached_tokens`
says how many prompt tokens a row read from it. In standard numerics a reused KV
differs from a fresh prefill's at float-noise level (like padding, below).

Deliberately simplified:
- A merged batch is as wide as its longest context (left padding, masked): a short
  sequence next to a long one pays attention over the padding.
- Padding changes logits only at floating-point noise level (reductions of different
  shapes): ~1e-6 in fp32 on the tiny model, which the tests bound.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.engine.base import SamplingParams, TopLogprobs
from tidal.engine.prefix import PrefixCache
from tidal.engine.sampling import processed_logprobs, sample_tokens

# Prompt tokens a request must share with an earlier one admitted with it, beyond what the
# prefix cache holds, to wait for that one's prefill (`DecodeBatch.admit`).
SHARED_GAIN = 64


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
    `_keep`, `_extract`, `can_merge`, and `_decode_admitting` where the batch `folds`) is
    what the region batches (`regions.py`) replace.
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

    folds = False  # whether `step` prefills new requests in its decode forward

    def admit(self, requests: Sequence[SequenceRequest], tags: Sequence[Any]) -> None:
        """Prefill `requests`, sample their first tokens and add them to the batch.

        With a prefix cache, each new prompt is cached as soon as it is prefilled, and the
        requests sharing more of their prompt with an earlier one of `requests` than the
        cache holds (`PrefixCache.waiting`: at least `SHARED_GAIN` tokens) are prefilled
        in a second pass, after it: a group's identical prompts are computed once."""
        for part in self._passes(requests):
            self._admit([requests[i] for i in part], [tags[i] for i in part])

    def step(self, requests: Sequence[SequenceRequest] = (), tags: Sequence[Any] = ()) -> None:
        """One decode forward for every live row, then sample and retire finished rows.

        `requests` (with their `tags`) join first. A batch that `folds` prefills them in
        that same forward, beside the live rows' tokens (in a second pass after it, those
        `admit` would make wait for another's prefill); any other admits them, then
        decodes. Either way each sequence samples what it would have: the live rows their
        next token, the new ones their first."""
        if requests and not (self.folds and self._rows):
            self.admit(requests, tags)
            requests = ()
        if not self._rows:
            return
        if not requests:
            logits = self._decode()
            self._next_pos = self._next_pos + 1
            self._sample(logits, list(range(len(self._rows))))
            self._retire()
            return
        first, *later = self._passes(requests)
        now = [requests[i] for i in first]
        rows, hits = self._new_rows(now, [tags[i] for i in first])
        live = len(self._rows)
        decode_logits, new_logits = self._decode_admitting(now, [r.budget for r in rows], hits)
        self._next_pos = self._next_pos + 1
        self._sample(decode_logits, list(range(live)))
        self._add_rows(now, rows, new_logits)
        self._retire()
        for part in later:
            self._admit([requests[i] for i in part], [tags[i] for i in part])

    def _passes(self, requests: Sequence[SequenceRequest]) -> list[list[int]]:
        """The indices of `requests` to prefill one pass after the other (`admit`)."""
        if self._prefix is not None and len(requests) > 1:
            later = set(self._prefix.waiting([r.prompt for r in requests], gain=SHARED_GAIN))
            if later:
                return [[i for i in range(len(requests)) if i not in later], sorted(later)]
        return [list(range(len(requests)))]

    def _admit(self, requests: Sequence[SequenceRequest], tags: Sequence[Any]) -> None:
        if not requests:
            return
        rows, hits = self._new_rows(requests, tags)
        logits = self._prefill(requests, [row.budget for row in rows], hits)
        self._add_rows(requests, rows, logits)
        self._retire()

    def _new_rows(self, requests: Sequence[SequenceRequest],
                  tags: Sequence[Any]) -> tuple[list[_Row], list[tuple[int, Any]]]:
        """The rows of new `requests` (each with its seeded generator and token budget) and
        what the prefix cache holds of each prompt."""
        import torch

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
        return rows, hits

    def _add_rows(self, requests: Sequence[SequenceRequest], rows: list[_Row],
                  logits: Any) -> None:
        """Append prefilled `rows` to the batch and sample their first tokens from `logits`
        (their prompts' last positions')."""
        import torch

        n = len(requests)
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
        for i in range(first, len(self._rows)):
            self._remember_prompt(i)
        self._last = torch.cat([self._last, torch.zeros(n, dtype=torch.long, device=self._device)])
        self._sample(logits, list(range(first, len(self._rows))))

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
        from transformers.cache_utils import DynamicLayer

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
        cache.layers = [_growing_layer_class()() if type(layer) is DynamicLayer else layer
                        for layer in cache.layers]
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
        """One forward of every row's last token through transformers; logits [B, V]."""
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

    def _decode_admitting(
        self,
        requests: Sequence[SequenceRequest],
        budgets: list[int],
        hits: Sequence[tuple[int, Any]],
    ) -> tuple[Any, Any]:
        """One forward of every live row's last token and of new prompts (as `_prefill`
        takes them): the live rows' logits [B, V] and the prompts' last positions' [n, V].
        Only batches that `fold` have it."""
        raise NotImplementedError

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
        return all(isinstance(layer, _growing_layer_class()) for layer in self._cache.layers)

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

    def _remember_prompt(self, i: int) -> None:
        """Keep new row i's prompt KV in the prefix cache when it computed at least a
        block of it (its finished sequence replaces the entry later)."""
        row = self._rows[i]
        if self._prefix is None or len(row.prompt) - row.cached < self._prefix.block:
            return
        kv, nbytes = self._extract(i, len(row.prompt))
        self._prefix.insert(row.prompt, kv, nbytes)

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


def _top_pairs(lp: Any, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely (token id, logprob) pairs of each row of `lp` [B, V]."""
    values, ids = lp.topk(k, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(),
                                                          strict=True)]


@functools.cache
def _growing_layer_class() -> type:
    """`GrowingLayer`, defined on first use so that importing this module does not import
    transformers."""
    import torch
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]
        """A full-attention KV layer whose keys and values are views of buffers with room
        to spare along the sequence axis, so that a decode step writes one column instead
        of copying the whole cache (`DynamicLayer.update` is a `torch.cat`: at batch 64 and
        1k tokens, 3 GB copied a step across SmolLM2's 30 layers). Whoever replaces
        `keys`/`values` (row selection, trimming, merging) just makes the next update
        copy them into a fresh buffer."""

        _kbuf: torch.Tensor | None = None
        _vbuf: torch.Tensor | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                   *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys: Any = self.keys
            n = keys.shape[-2] if keys.numel() else 0
            end = n + key_states.shape[-2]
            if not self._views_of_buffers(end):
                self._regrow(n, end, key_states)
            assert self._kbuf is not None and self._vbuf is not None
            self._kbuf[..., n:end, :].copy_(key_states)
            self._vbuf[..., n:end, :].copy_(value_states)
            self.keys, self.values = self._kbuf[..., :end, :], self._vbuf[..., :end, :]
            return self.keys, self.values

        def _views_of_buffers(self, end: int) -> bool:
            k, v, keys, values = self._kbuf, self._vbuf, self.keys, self.values
            return (k is not None and v is not None and keys is not None and values is not None
                    and end <= k.shape[-2] and keys.numel() > 0
                    and keys.data_ptr() == k.data_ptr() and values.data_ptr() == v.data_ptr()
                    and keys.shape[:-2] == k.shape[:-2] and keys.stride() == k.stride())

        def _regrow(self, n: int, end: int, like: torch.Tensor) -> None:
            shape = (*like.shape[:-2], end + max(64, end // 4), like.shape[-1])
            kbuf, vbuf = like.new_empty(shape), like.new_empty(shape)
            if n:
                keys: Any = self.keys
                values: Any = self.values
                kbuf[..., :n, :].copy_(keys)
                vbuf[..., :n, :].copy_(values)
            self._kbuf, self._vbuf = kbuf, vbuf

    return GrowingLayer


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
