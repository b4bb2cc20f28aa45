"""A batch whose KV cache is a store of regions: what the consistent and the fast batches
share.

`RegionBatch` keeps `DecodeBatch`'s interface and bookkeeping (rows, seeded sampling,
retiring, the prefix cache) and replaces its KV cache: per layer one zero-filled store of
slots ([S, KV heads, head dim] for keys and for values), each sequence owning a region of
prompt + budget slots from `_start[row]`, written as it goes. A query token reads its
keys by slot, so nothing is padded, merged or copied when sequences join or leave;
regions of retired rows are reclaimed when the store fills: the live regions are
copied, packed, to a new store twice the size of what they and the new ones take (so
the store follows the live sequences, growing or shrinking, and a move is amortized
over as many slots as it copies).

Prefill and decode are one operation on a flat list of tokens (`_run`): each token with
its id, position and row; a prefill's are a prompt's tokens after its cached prefix, a
decode step's each row's last sampled token, and a decode step that admits new prompts
(`_decode_admitting`, where the batch `folds`) has both. Subclasses supply the forward:
`consistent_batch.py` (the batch-invariant forward) and `fast_batch.py` (the fast fused
step). A cached prefix (prefix caching) is copied into a new row's region before its
other tokens run: a token's KV depends only on its ancestors, so the copy is what
prefilling them again would write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tidal.engine.batch import DecodeBatch, SequenceRequest
from tidal.engine.prefix import PrefixCache

if TYPE_CHECKING:
    import torch


class RegionBatch(DecodeBatch):
    """`DecodeBatch` over a region store (see the module). Subclasses implement `_run`.

    The store's keys and values are [S, KV, D] tensors; with `head_major` they are views of
    [KV, S, D] buffers, so that one KV head's slots are contiguous (what an attention
    that streams a head's keys wants), else contiguous themselves (a slot's heads
    together)."""

    head_major = False

    def __init__(
        self, model: Any, *, max_context: int, pad_id: int, prefix: PrefixCache | None = None
    ) -> None:
        import torch

        super().__init__(model, max_context=max_context, pad_id=pad_id, prefix=prefix)
        config = model.config
        heads = int(config.num_attention_heads)
        self._geometry = (int(config.num_hidden_layers), int(config.num_key_value_heads),
                          int(getattr(config, "head_dim", None) or config.hidden_size // heads))
        self._store: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._used = 0
        self._start = torch.zeros((0,), dtype=torch.long, device=self._device)

    @property
    def can_merge(self) -> bool:
        return True

    def _run(self, ids_T: torch.Tensor, pos_T: torch.Tensor, row_T: torch.Tensor,
             starts_R: torch.Tensor, out_rows: torch.Tensor) -> torch.Tensor:
        """Logits [len(out_rows), V] of tokens `ids_T` at positions `pos_T` of rows `row_T`
        (indices into `starts_R`, the rows' region starts): each token's key and value are
        written at slot starts_R[row] + pos and it attends to its region up to itself;
        `out_rows` picks the tokens whose logits are returned."""
        raise NotImplementedError

    def _store_dtype(self) -> torch.dtype:
        """The store's dtype: the model's (the fast batch's may be narrower)."""
        dtype: torch.dtype = self._model.get_input_embeddings().weight.dtype
        return dtype

    def _capacity(self) -> int:
        return int(self._store[0][0].shape[0]) if self._store else 0

    def _reserve(self, need: int) -> None:
        """Make room for `need` more slots after `_used`, compacting live regions."""
        import torch

        if self._used + need <= self._capacity():
            return
        sizes = [int(p) - len(r.output_ids) + 1 + r.budget
                 for p, r in zip(self._next_pos.tolist(), self._rows, strict=True)]
        # twice what the live regions and the new ones take: as many slots free as used
        # after the move, whatever the store's size was (it shrinks after a busy spell)
        cap = max(2 * (sum(sizes) + need), 4096)
        layers, kv_heads, head_dim = self._geometry
        dtype = self._store_dtype()

        def new() -> torch.Tensor:
            if self.head_major:  # [S, KV, D] views of [KV, S, D] buffers
                return torch.zeros((kv_heads, cap, head_dim), dtype=dtype,
                                   device=self._device).transpose(0, 1)
            return torch.zeros((cap, kv_heads, head_dim), dtype=dtype, device=self._device)

        moves, pos = [], 0  # (old start, new start, slots written) per live region
        for old, n, size in zip(self._start.tolist(), self._next_pos.tolist(), sizes,
                                strict=True):
            moves.append((old, pos, n))
            pos += size
        if not moves:  # nothing live to keep: the old store goes before the new one
            self._store = []
            self._store = [(new(), new()) for _ in range(layers)]
        else:  # a layer at a time, each old layer freed as its copy replaces it, so the
            for i, (k, v) in enumerate(self._store):  # two stores are never whole at once
                nk, nv = new(), new()
                for old, at, n in moves:
                    nk[at : at + n] = k[old : old + n]
                    nv[at : at + n] = v[old : old + n]
                self._store[i] = (nk, nv)
        self._used = pos
        self._start = torch.tensor([at for _, at, _ in moves], dtype=torch.long,
                                   device=self._device)

    def _place(
        self,
        requests: Sequence[SequenceRequest],
        budgets: list[int],
        hits: Sequence[tuple[int, Any]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reserve each new prompt's region and copy its cached prefix (hits) into the
        region's first slots. Returns the tokens left to run (ids, positions, and rows
        numbered from 0 among the new ones), the new regions' starts, and the index of each
        prompt's last token among them. The live rows' regions may have moved (`_start`)."""
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
        return ids_T, pos_T, row_T, starts_R, last

    def _prefill(
        self,
        requests: Sequence[SequenceRequest],
        budgets: list[int],
        hits: Sequence[tuple[int, Any]],
    ) -> Any:
        """Place the new prompts (`_place`) and run what the prefix cache did not hold."""
        import torch

        ids_T, pos_T, row_T, starts_R, last = self._place(requests, budgets, hits)
        logits = self._run(ids_T, pos_T, row_T, starts_R, last)
        self._start = torch.cat([self._start, starts_R])
        return logits

    def _decode_admitting(
        self,
        requests: Sequence[SequenceRequest],
        budgets: list[int],
        hits: Sequence[tuple[int, Any]],
    ) -> tuple[Any, Any]:
        """The live rows' last tokens, then the new prompts' (`_place`), as one flat list
        through one `_run`: a decode step and a prefill for one pass over the weights."""
        import torch

        ids_T, pos_T, row_T, starts_R, last = self._place(requests, budgets, hits)
        live = len(self._rows)
        rows = torch.arange(live, device=self._device)
        logits = self._run(torch.cat([self._last, ids_T]), torch.cat([self._next_pos, pos_T]),
                           torch.cat([rows, row_T + live]), torch.cat([self._start, starts_R]),
                           torch.cat([rows, last + live]))
        self._start = torch.cat([self._start, starts_R])
        return logits[:live], logits[live:]

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
