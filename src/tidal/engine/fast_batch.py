"""The fast batch: the embedded engine's sampling loop on the fast fused step (`fused.py`)
over a region store (`regions.py`), for the models that have one (`fused.unsupported`).

Prefill and decode are the same step: a flat list of tokens through fused, pre-packed
weights, each token's key and value written into its sequence's region and its
attention read from there by the decode-attention kernel (`decode_attention.py`), which
reads a sequence's slots and nothing else. So a prefill is as fast per token as the
linear layers allow (no left padding among the prompts admitted together, no
transformers forward), and sequences joining or leaving the batch copy no one's KV:
transformers' cache, left-padded to the longest row, was copied whole at every
admission and every retirement, and every row's attention read the padding too. For the
same reason a prompt admitted while rows run is prefilled in their next decode step
(`folds`): one forward, one pass over the weights, where a prefill of its own made every
live row wait for it.

Numerics: the standard engine's float noise (fused.py's docstring), not bit-identity with
transformers' forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.engine.fused import fast_decoder
from tidal.engine.prefix import PrefixCache
from tidal.engine.regions import RegionBatch

if TYPE_CHECKING:
    import torch

# Tokens per forward of a prefill: a long prompt runs in chunks of this many (in order, so
# each chunk's tokens attend to the KV the earlier chunks wrote), bounding activations.
PREFILL_CHUNK = 2048


class FastDecodeBatch(RegionBatch):
    """`RegionBatch` on `FastDecoder.forward` (see the module). Only for models with a fast
    step: `fast_decoder(model)` is not None. Its store is head-major: the kernel streams
    one KV head's keys of a region, which are then contiguous."""

    head_major = True
    folds = True  # prompts admitted while rows run are prefilled in their decode step

    def __init__(
        self, model: Any, *, max_context: int, pad_id: int, prefix: PrefixCache | None = None
    ) -> None:
        if fast_decoder(model) is None:
            from tidal.engine.fused import unsupported

            raise ValueError(f"no fast step for this model: {unsupported(model)}")
        super().__init__(model, max_context=max_context, pad_id=pad_id, prefix=prefix)
        self._fast_checked = False  # the fast decoder's thorough check: once per busy period

    def _store_dtype(self) -> torch.dtype:
        fast = fast_decoder(self._model, thorough=False)
        assert fast is not None
        return fast.kv_dtype

    def _run(self, ids_T: torch.Tensor, pos_T: torch.Tensor, row_T: torch.Tensor,
             starts_R: torch.Tensor, out_rows: torch.Tensor) -> torch.Tensor:
        import torch

        fast = fast_decoder(self._model, thorough=not self._fast_checked)
        self._fast_checked = True
        assert fast is not None
        starts_T = starts_R[row_T]
        n = int(ids_T.shape[0])
        with torch.inference_mode():
            if n <= PREFILL_CHUNK:
                return fast.forward(ids_T, pos_T, starts_T, self._store, out_rows)
            # chunk by chunk; each chunk returns the logits of the wanted tokens it holds
            parts = []
            for a in range(0, n, PREFILL_CHUNK):
                b = min(n, a + PREFILL_CHUNK)
                mine = out_rows[(out_rows >= a) & (out_rows < b)] - a
                logits = fast.forward(ids_T[a:b], pos_T[a:b], starts_T[a:b], self._store, mine)
                parts.append(logits)
            return torch.cat(parts)
