"""The consistent batch: the embedded engine's sampling loop on `consistent.py`'s
batch-invariant forward (`EmbeddedEngine(numerics="consistent")`).

`ConsistentDecodeBatch` is a `RegionBatch` (`regions.py`: the KV cache a zero-filled
store of slots per layer, each sequence owning a region of prompt + budget slots that
its queries read by index, so nothing is padded or merged and a row's numbers never
depend on its neighbours) whose forward is `ConsistentModel`'s. A
seeded request therefore gives the same tokens and the same logprobs, exactly, alone or
in any batch, and a token's logprob is exactly what the trainer's
`attention="consistent"` recomputes.

Why it is a module of its own: it is the one batch that needs the consistent forward;
the engine picks it, the fast batch (`fast_batch.py`) or the standard one (`batch.py`).

Prefix caching: a token's KV depends only on its ancestors, so a cached prefix copied
into a row's region is what prefilling it again would write, bit for bit; a run with
the cache samples exactly what a run without it does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.engine.prefix import PrefixCache
from tidal.engine.regions import RegionBatch

if TYPE_CHECKING:
    import torch


class ConsistentDecodeBatch(RegionBatch):
    """`RegionBatch` on `ConsistentModel`'s batch-invariant forward (`consistent.py`).

    Each sequence's queries read their keys by slot index from its region of the
    zero-filled store. A token's logits then do not depend on the other rows, their number
    or padding, bit for bit.
    """

    def __init__(
        self, model: Any, *, max_context: int, pad_id: int, prefix: PrefixCache | None = None
    ) -> None:
        from tidal.engine.consistent import ConsistentModel

        super().__init__(model, max_context=max_context, pad_id=pad_id, prefix=prefix)
        self._cm = ConsistentModel(model)

    def _run(self, ids_T: torch.Tensor, pos_T: torch.Tensor, row_T: torch.Tensor,
             starts_R: torch.Tensor, out_rows: torch.Tensor) -> torch.Tensor:
        import torch

        from tidal.engine.consistent import KEY_BLOCK, KeyLists

        width = int(pos_T.max()) + 1
        width += (-width) % KEY_BLOCK
        cap = self._capacity()
        keys = (starts_R[:, None] + torch.arange(width, device=self._device)).clamp_(max=cap - 1)
        lists = KeyLists(keys, row_T, pos_T + 1)
        with torch.inference_mode():
            h = self._cm.hidden(ids_T, pos_T, lists, self._store, starts_R[row_T] + pos_T)
            out: torch.Tensor = self._cm.logits(h.index_select(0, out_rows))
            return out
