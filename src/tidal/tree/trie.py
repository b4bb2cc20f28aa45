"""Exact token-prefix trie of one session's calls.

Every call contributes its context (prompt followed by output) as one root-to-node path.
The ledger's `PromptDelta` (base call, prefix length, suffix) is used only as a fast
starting point: insertion walks to position `prefix_len` on the base call's path, then
keeps matching the suffix against existing children (numpy comparisons on whole runs)
before branching, so the trie is the exact longest-shared-prefix tree whatever base the
store picked. Cost is linear in stored tokens plus one short walk per call.

Nodes are radix runs: a run of tokens from one source (one call's prompt suffix, or one
call's output), split where paths diverge and where a call's prompt or context ends (so
every call's prompt end and context end is a node end). A prompt token that is also an
earlier call's output by prefix is the same node, still a model token sampled once by
that earlier call. An output token that matches an existing *prompt* node is upgraded to
a model token (the model did sample it); one that matches an earlier *output* keeps the
first sampler's logprob and version (an identical regeneration is a duplicate path).

Shape letters: N nodes, T tokens of a node.

Deliberately simplified: the builder keeps mutable nodes (`_Node`) while inserting and
freezes them into `TrieNode`s at the end; comparing the text of non-prefix history
(re-rendered or edited turns) is not attempted, such a call simply branches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tidal.ledger.types import StoredCall

IdArray = npt.NDArray[np.int32]
LogprobArray = npt.NDArray[np.float32]


class TreeError(ValueError):
    """Malformed input to the processor; the message names the session and the call."""


@dataclass(frozen=True, eq=False)
class TrieNode:
    """One radix run. `depth` counts the tokens before its first token on its path.

    `call` is the index (in the session's commit order) of the call that wrote the run:
    the sampler for a model run, the call whose prompt suffix introduced it otherwise.
    """

    index: int
    parent: int  # -1 for a top-level node (child of the virtual root)
    depth: int
    token_ids: IdArray  # [T]
    model: bool
    logprobs: LogprobArray | None  # [T] for model runs
    policy_version: int  # -1 for non-model runs
    call: int
    children: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def end(self) -> int:
        return self.depth + len(self)


@dataclass(frozen=True)
class CallPlace:
    """Where one call sits in the trie, and what the prefix relation says about it.

    `prompt_end` / `context_end` are node indices whose end is the end of the call's
    prompt / context (-1: empty, at the virtual root). `prefix_parent` is the latest
    earlier call whose whole context is a prefix of this call's prompt (the deepest one),
    `retry_of` the first earlier call with exactly the same prompt, `fork_from` the call
    that wrote the run this call's prompt branches off (when it extends no earlier
    context). All are call indices, -1 when none. `shared_len` is how many leading
    prompt tokens earlier calls' paths already held (the prompt's longest common prefix
    with the trie as it was before this call; the prompt length when it adds nothing):
    where the call's own new prompt tokens start.
    """

    index: int
    call_id: str
    prompt_end: int
    context_end: int
    prompt_len: int
    context_len: int
    prefix_parent: int
    retry_of: int
    fork_from: int
    shared_len: int = 0  # the builder always sets it


@dataclass(frozen=True, eq=False)
class SessionTrie:
    """The exact prefix trie of one session. Nodes are in pre-order (parents first)."""

    session_id: str
    calls: tuple[StoredCall, ...]
    places: tuple[CallPlace, ...]
    nodes: tuple[TrieNode, ...]
    roots: tuple[int, ...]  # top-level nodes, in pre-order

    @property
    def unique_tokens(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def leaves(self) -> list[int]:
        return [n.index for n in self.nodes if not n.children]

    @property
    def path_tokens(self) -> int:
        """Sum over root-to-leaf paths of their length."""
        return sum(n.end for n in self.nodes if not n.children)

    def path(self, node: int) -> list[int]:
        """Node indices from the top-level node down to `node`."""
        out: list[int] = []
        while node != -1:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    def path_ids(self, node: int, start: int = 0) -> IdArray:
        """The tokens from the root (or from path position `start`) to the end of `node`.

        Walks up only as far as `start`, so a path's tail costs its own length plus the
        nodes it spans, not the whole path."""
        parts: list[IdArray] = []
        while node != -1:
            n = self.nodes[node]
            if n.end <= start:
                break
            parts.append(n.token_ids[max(0, start - n.depth):])
            if n.depth <= start:
                break
            node = n.parent
        parts.reverse()
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def is_ancestor(self, anc: int, node: int) -> bool:
        """True when `anc` is `node` or lies on its path (-1, the root, is everyone's)."""
        if anc == -1:
            return True
        target = self.nodes[anc].depth
        while node != -1 and self.nodes[node].depth >= target:
            if node == anc:
                return True
            node = self.nodes[node].parent
        return False


# ---------------------------------------------------------------------------- builder


class _Node:
    __slots__ = (
        "call", "children", "depth", "ends", "logprobs", "model", "parent", "pv", "tokens",
    )

    def __init__(
        self,
        parent: _Node | None,
        depth: int,
        tokens: IdArray,
        *,
        model: bool,
        logprobs: LogprobArray | None,
        pv: int,
        call: int,
    ) -> None:
        self.parent = parent
        self.depth = depth
        self.tokens = tokens
        self.model = model
        self.logprobs = logprobs
        self.pv = pv
        self.call = call
        self.children: dict[int, _Node] = {}
        self.ends: list[int] = []  # calls whose context ends at this node's end


def _lcp(a: IdArray, b: IdArray) -> int:
    m = min(int(a.shape[0]), int(b.shape[0]))
    if m == 0:
        return 0
    neq = a[:m] != b[:m]
    return int(np.argmax(neq)) if neq.any() else m


def _split(node: _Node, k: int) -> _Node:
    """Cut `node` after k tokens. The new object is the head; `node` stays the tail, so
    every reference to it (call ends, children's parents) stays valid."""
    assert 0 < k < node.tokens.shape[0]
    parent = node.parent
    assert parent is not None
    head = _Node(
        parent,
        node.depth,
        node.tokens[:k],
        model=node.model,
        logprobs=None if node.logprobs is None else node.logprobs[:k],
        pv=node.pv,
        call=node.call,
    )
    key = int(node.tokens[0])
    node.tokens = node.tokens[k:]
    if node.logprobs is not None:
        node.logprobs = node.logprobs[k:]
    node.depth += k
    node.parent = head
    head.children[int(node.tokens[0])] = node
    parent.children[key] = head
    return head


class _Builder:
    """Inserts calls in commit order. Holds the mutable trie while it grows."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.root = _Node(None, 0, np.zeros(0, np.int32), model=False, logprobs=None, pv=-1,
                          call=-1)
        self.prompt_end: list[_Node] = []
        self.context_end: list[_Node] = []
        self.prompt_owner: dict[int, int] = {}  # id(prompt end node) -> first call

    def _locate(self, base: int, prefix_len: int) -> tuple[_Node, int]:
        node = self.context_end[base]
        while node is not self.root and node.depth >= prefix_len:
            assert node.parent is not None
            node = node.parent
        return node, prefix_len - node.depth

    def _boundary(self, node: _Node, off: int) -> _Node:
        """Make the position (node, off) a node end; return the node ending there."""
        if off < node.tokens.shape[0]:
            return _split(node, off)
        return node

    def _match(
        self,
        node: _Node,
        off: int,
        arr: IdArray,
        *,
        call: int,
        logprobs: LogprobArray | None,
        pv: int,
    ) -> tuple[_Node, int]:
        """Follow/extend the trie with `arr` from position (node, off)."""
        i, n = 0, int(arr.shape[0])
        model = logprobs is not None
        while i < n:
            if off < node.tokens.shape[0]:
                m = _lcp(node.tokens[off:], arr[i:])
                if model and m > 0 and not node.model:
                    # The model sampled tokens that a prompt already held: upgrade them.
                    if off > 0:
                        _split(node, off)
                        off = 0
                    if m < node.tokens.shape[0]:
                        node = _split(node, m)
                    assert logprobs is not None
                    node.model, node.logprobs, node.pv, node.call = (
                        True, logprobs[i : i + m], pv, call,
                    )
                i += m
                off += m
                if i < n and off < node.tokens.shape[0]:
                    node = _split(node, off)  # diverges inside the run
                    off = int(node.tokens.shape[0])
                continue
            child = node.children.get(int(arr[i]))
            if child is None:
                new = _Node(
                    node,
                    node.depth + int(node.tokens.shape[0]),
                    arr[i:],
                    model=model,
                    logprobs=None if logprobs is None else logprobs[i:],
                    pv=pv if model else -1,
                    call=call,
                )
                node.children[int(arr[i])] = new
                return new, int(new.tokens.shape[0])
            node, off = child, 0
        return node, off

    def insert(self, index: int, sc: StoredCall, by_id: dict[str, int]) -> CallPlace:
        delta = sc.prompt
        where = f"session {self.session_id!r}, call {sc.call_id!r}"
        if delta.base_call_id is None:
            if delta.prefix_len != 0:
                raise TreeError(f"{where}: prefix length {delta.prefix_len} without a base call")
            node, off = self.root, 0
        else:
            base = by_id.get(delta.base_call_id)
            if base is None or base >= index:
                raise TreeError(
                    f"{where}: prefix reference to call {delta.base_call_id!r}, which is not "
                    "an earlier call of the session (missing prefix reference)"
                )
            base_len = self.context_end[base].depth + int(self.context_end[base].tokens.shape[0])
            if not 0 <= delta.prefix_len <= base_len:
                raise TreeError(
                    f"{where}: prefix length {delta.prefix_len} exceeds the context length "
                    f"{base_len} of base call {delta.base_call_id!r}"
                )
            node, off = self._locate(base, delta.prefix_len)
        out = sc.call.output_ids
        lps = sc.call.output_logprobs
        if lps.shape[0] != out.shape[0]:
            raise TreeError(f"{where}: {lps.shape[0]} logprobs for {out.shape[0]} output tokens")
        node, off = self._match(node, off, delta.suffix_ids, call=index, logprobs=None, pv=-1)
        pend = self._boundary(node, off)
        retry_of = self.prompt_owner.setdefault(id(pend), index)
        prefix_parent, fork_from = self._prefix_parent(pend, index)
        # The nodes this call's prompt created are the bottom of its prompt path (no
        # output has upgraded them yet): the shared prefix ends where they start.
        shared_len = delta.prompt_len
        nd: _Node | None = pend
        while nd is not None and nd is not self.root and nd.call == index:
            shared_len = nd.depth
            nd = nd.parent
        node, off = self._match(pend, int(pend.tokens.shape[0]), out, call=index, logprobs=lps,
                                pv=sc.call.policy_version)
        cend = self._boundary(node, off)
        cend.ends.append(index)
        self.prompt_end.append(pend)
        self.context_end.append(cend)
        return CallPlace(
            index=index,
            call_id=sc.call_id,
            prompt_end=-1,  # filled in by `freeze`
            context_end=-1,
            prompt_len=delta.prompt_len,
            context_len=sc.context_len,
            prefix_parent=prefix_parent,
            retry_of=-1 if retry_of == index else retry_of,
            fork_from=fork_from,
            shared_len=shared_len,
        )

    def _prefix_parent(self, pend: _Node, index: int) -> tuple[int, int]:
        node: _Node | None = pend
        fork_from = -1
        while node is not None and node is not self.root:
            if node.ends:
                return node.ends[0], -1
            if fork_from == -1 and node.call != index:
                fork_from = node.call
            node = node.parent
        return -1, fork_from

    def freeze(self, calls: tuple[StoredCall, ...], places: list[CallPlace]) -> SessionTrie:
        order: list[_Node] = []
        stack = sorted(self.root.children.values(), key=lambda c: c.call, reverse=True)
        while stack:
            nd = stack.pop()
            order.append(nd)
            stack.extend(sorted(nd.children.values(), key=lambda c: c.call, reverse=True))
        idx = {id(nd): i for i, nd in enumerate(order)}
        nodes = tuple(
            TrieNode(
                index=i,
                parent=-1 if nd.parent is self.root else idx[id(nd.parent)],
                depth=nd.depth,
                token_ids=nd.tokens,
                model=nd.model,
                logprobs=nd.logprobs,
                policy_version=nd.pv,
                call=nd.call,
                children=tuple(
                    idx[id(c)] for c in sorted(nd.children.values(), key=lambda c: c.call)
                ),
            )
            for i, nd in enumerate(order)
        )
        fixed = tuple(
            CallPlace(
                index=p.index,
                call_id=p.call_id,
                prompt_end=idx.get(id(self.prompt_end[p.index]), -1),
                context_end=idx.get(id(self.context_end[p.index]), -1),
                prompt_len=p.prompt_len,
                context_len=p.context_len,
                prefix_parent=p.prefix_parent,
                retry_of=p.retry_of,
                fork_from=p.fork_from,
                shared_len=p.shared_len,
            )
            for p in places
        )
        roots = tuple(i for i, n in enumerate(nodes) if n.parent == -1)
        return SessionTrie(self.session_id, calls, fixed, nodes, roots)


def build_trie(session_id: str, calls: Sequence[StoredCall]) -> SessionTrie:
    """Build the exact prefix trie of one session's calls, given in commit order.

    Raises `TreeError` (naming the session and call) on an empty session, a call of
    another session, a duplicate call id, or a prefix reference that is missing, points
    forward or is longer than its base's context.
    """
    if not calls:
        raise TreeError(f"session {session_id!r} has no calls")
    b = _Builder(session_id)
    by_id: dict[str, int] = {}
    places: list[CallPlace] = []
    for i, sc in enumerate(calls):
        if sc.session_id != session_id:
            raise TreeError(
                f"session {session_id!r}, call {sc.call_id!r}: belongs to session "
                f"{sc.session_id!r}"
            )
        if sc.call_id in by_id:
            raise TreeError(f"session {session_id!r}, call {sc.call_id!r}: duplicate call id")
        places.append(b.insert(i, sc, by_id))
        by_id[sc.call_id] = i
    return b.freeze(tuple(calls), places)
