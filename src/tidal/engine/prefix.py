"""A prefix cache: the KV caches of finished sequences, found again by longest prefix.

An agent's calls share their history: call k+1's prompt is call k's prompt, its output
and the tool results that followed. Without a cache the engine prefills the whole
history again on every call, so a session of K calls costs O(K x context) forward work;
with it, each call computes only its new tokens, and the work grows with the session's
unique tokens. `DecodeBatch` inserts a sequence's KV when it finishes (and a prompt's as
soon as it is prefilled) and looks up each new prompt's longest cached prefix before
prefilling the rest; prompts admitted together that share a prefix the cache does not
hold yet wait for the first of them (`waiting`).

The cache is a pure data structure: it stores an opaque KV payload per entry (the batch
that made it knows its layout) with the entry's token ids and byte size, and finds the
entry sharing the longest prefix with a prompt through chained block hashes (vLLM's
scheme): block b of a sequence is indexed by a hash of its tokens and of block b-1's
hash, so a lookup walks the prompt's blocks until one is not indexed. A hit is verified
token by token (a hash collision costs a miss, never a wrong KV), then extended
inside the next, partial block.

Deliberately simplified, against vLLM's paged blocks:
- An entry owns its whole KV. Sessions that branch from one history (subagents, retries)
  each hold a copy of the shared part; an entry that a newer one extends is dropped, so
  a linear session holds one entry, not one per call.
- Eviction is least-recently-used, whole entries, within a byte budget.
- Entries shorter than one block are not kept: such a hit saves almost nothing.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

BLOCK = 16


@dataclass
class _Entry:
    key: int
    tokens: npt.NDArray[np.int32]
    kv: Any
    nbytes: int
    blocks: list[int]


@dataclass
class PrefixStats:
    """Counters since the cache was made (`clear` keeps them), and its present size."""

    lookups: int = 0
    hits: int = 0
    tokens_looked_up: int = 0  # prompt tokens of all lookups
    tokens_reused: int = 0  # of those, read from the cache instead of computed
    entries: int = 0
    nbytes: int = 0
    evicted: int = 0


class PrefixCache:
    """Longest-prefix lookup of KV payloads, LRU within `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, *, block: int = BLOCK) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.capacity_bytes = capacity_bytes
        self.block = block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recent first
        self._index: dict[int, list[_Entry]] = {}  # block hash -> entries, newest last
        self._keys = itertools.count()
        self._nbytes = 0
        self._stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stats(self) -> PrefixStats:
        return replace(self._stats, entries=len(self._entries), nbytes=self._nbytes)

    def lookup(self, prompt: Sequence[int] | npt.NDArray[Any]) -> tuple[int, Any]:
        """(n, kv): the longest cached prefix of `prompt`, at most `len(prompt) - 1` tokens
        long (the last prompt token is always computed, for its logits), and the payload
        of the entry holding it (whose first n positions are that prefix); (0, None) if
        none. A hit makes the entry the most recently used."""
        tokens = np.asarray(prompt, dtype=np.int32)
        self._stats.lookups += 1
        self._stats.tokens_looked_up += int(tokens.size)
        limit = int(tokens.size) - 1
        entry, n = self._longest(tokens, limit)
        if entry is None or n == 0:
            return 0, None
        self._entries.move_to_end(entry.key)
        self._stats.hits += 1
        self._stats.tokens_reused += n
        return n, entry.kv

    def waiting(self, prompts: Sequence[Sequence[int]], *, gain: int) -> list[int]:
        """Indices of the prompts that share at least `gain` tokens more (in whole blocks)
        with an earlier prompt of `prompts` than the cache holds of them. Prefilled after
        the others, once those are cached, they compute only what is their own: a GRPO
        group's identical first prompts, arriving together, cost one prefill, not eight.
        Only prompts not waiting themselves count as earlier. Changes nothing."""
        seen: set[int] = set()
        out = []
        for i, prompt in enumerate(prompts):
            tokens = np.asarray(prompt, dtype=np.int32)
            shared = held = 0
            chain = []
            for end, h in self._hashes(tokens, int(tokens.size) - 1):
                chain.append(h)
                if h in seen and shared == end - self.block:
                    shared = end
                if h in self._index and held == end - self.block:
                    held = end
            if shared - held >= gain:
                out.append(i)
            else:
                seen.update(chain)
        return out

    def insert(self, tokens: Sequence[int] | npt.NDArray[Any], kv: Any, nbytes: int) -> bool:
        """Keep `kv`, the payload of the sequence `tokens` (one position per token).

        Entries that `tokens` extends are dropped; nothing is kept when an entry already
        holds all of `tokens`, or when `tokens` is shorter than a block or the payload
        alone is over the budget. Returns whether the payload was kept."""
        arr = np.asarray(tokens, dtype=np.int32)
        if arr.size < self.block or nbytes > self.capacity_bytes:
            return False
        blocks = [h for _, h in self._hashes(arr, int(arr.size))]
        covered = set()
        for h in blocks:
            for e in self._index.get(h, ()):
                covered.add(e.key)
        for key in covered:
            e = self._entries[key]
            common = min(e.tokens.size, arr.size)
            if not np.array_equal(e.tokens[:common], arr[:common]):
                continue  # a branch from a shared prefix (or a hash collision)
            if e.tokens.size >= arr.size:
                self._entries.move_to_end(e.key)
                return False
            self._remove(e)  # `tokens` extends it
        entry = _Entry(next(self._keys), arr.copy(), kv, int(nbytes), blocks)
        self._entries[entry.key] = entry
        for h in blocks:
            self._index.setdefault(h, []).append(entry)
        self._nbytes += entry.nbytes
        while self._nbytes > self.capacity_bytes:
            self._stats.evicted += 1
            self._remove(next(iter(self._entries.values())))
        return True

    def clear(self) -> None:
        """Drop every entry (the weights changed: cached KV is stale)."""
        self._entries.clear()
        self._index.clear()
        self._nbytes = 0

    # -- internals -----------------------------------------------------------------------

    @staticmethod
    def _chain(previous: int, block: bytes) -> int:
        """A block's hash: of its tokens and of the block before it."""
        return hash((previous, block))

    def _hashes(self, tokens: npt.NDArray[np.int32], limit: int) -> Iterator[tuple[int, int]]:
        """(end, chained hash) of each full block of `tokens[:limit]`, in order."""
        h, b = 0, self.block
        for start in range(0, limit - b + 1, b):
            h = self._chain(h, tokens[start : start + b].tobytes())
            yield start + b, h

    def _longest(self, tokens: npt.NDArray[np.int32], limit: int) -> tuple[_Entry | None, int]:
        best: _Entry | None = None
        n = 0
        for end, h in self._hashes(tokens, limit):  # stops at the first block not indexed
            found = self._index.get(h)
            if not found:
                break
            best, n = found[-1], end
        if best is None or not np.array_equal(best.tokens[:n], tokens[:n]):
            return None, 0  # nothing indexed, or a hash collision
        stop = min(int(best.tokens.size), limit)
        if stop > n:  # extend into the partial block
            diff = np.flatnonzero(best.tokens[n:stop] != tokens[n:stop])
            n = n + int(diff[0]) if diff.size else stop
        return best, n

    def _remove(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        for h in entry.blocks:
            bucket = self._index.get(h)
            if bucket is None:
                continue
            bucket[:] = [e for e in bucket if e is not entry]
            if not bucket:
                del self._index[h]
        self._nbytes -= entry.nbytes
