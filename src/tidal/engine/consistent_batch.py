"""The consistent batch: the embedded engine's sampling loop on `consistent.py`'s
batch-invariant forward (`EmbeddedEngine(numerics="consistent")`).

`ConsistentDecodeBatch` keeps `DecodeBatch`'s interface and bookkeeping (rows, seeded
sampling, retiring, the prefix cache) and replaces its model-specific part: the forward
is `ConsistentModel`'s, and the KV cache is one zero-filled slot store per layer, each
sequence owning a region of prompt + budget slots that its queries read by index, so
nothing is padded or merged and a row's numbers never depend on its neighbours. A
seeded request therefore gives the same tokens and the same logprobs, exactly, alone or
in any batch, and a token's logprob is exactly what the trainer's
`attention="consistent"` recomputes.

Why it is a module of its own: it is the one batch that needs the slot store and the
consistent forward; the standard batch (`batch.py`) and the threaded engine
(`embedded.py`) stay free of both, and the engine picks one class or the other.

Prefix caching: a token's KV depends only on its ancestors, so a cached prefix copied
into a row's region is what prefilling it again would write, bit for bit; a run with
the cache samples exactly what a run without it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tidal.engine.batch import DecodeBatch, SequenceRequest
from tidal.engine.prefix import PrefixCache


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
