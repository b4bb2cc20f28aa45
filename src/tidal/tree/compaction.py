"""Inferred compaction: a fresh context that carries an earlier call's summary.

Why: tidal's own harness declares a compaction (the first call of a fresh context sends
`X-Tidal-Parent-Call: <summary call>`), but third-party harnesses (Claude Code, Codex,
OpenHands, mini-swe-agent forks) compact silently: they start a new context such as
[system, task, "Summary of your progress so far: <summary>"] with no tidal header. That
call extends no earlier context, so without this module it is a new root (or a `fork`
where it shares the system prompt), and compaction samples and summary rewards never
see it. What such a call does carry is the summary itself: the output tokens an earlier
call of its session produced. `CarriedSummaries.source` finds that call.

The rule, for call C of a session (call S is the candidate summary):
- C is eligible only where no explicit link applies and nothing else types it: it is
  not a retry, its prompt extends no earlier context (no continuation/parallel), and
  its `parent_call_id`, if any, names no call of its own session (`episode.py`);
- S is an earlier call of the same session (commit order);
- the summary text T is S's output without its end token (the last token of a
  `finish_reason == "stop"` output: a harness re-sends the decoded text, never that
  token), m = len(T);
- the core of T, T[TRIM : m - TRIM] (TRIM = 2: re-rendering the text inside another
  message may change a token or two at its edges, as BPE merges at a boundary differ),
  occurs as one contiguous run of token ids in C's prompt; the run extends to each side
  by up to TRIM more tokens that still equal T's, and the whole run must be at least
  MIN_TOKENS (8) long and at least MIN_SHARE (80%) of m, so a short output ("ok", a
  tool call's name) never makes a compaction;
- the run reaches past `shared_len`, the point where C's prompt leaves the contexts of
  earlier calls: a run wholly inside that shared prefix was carried there already;
- the newest such S (latest committed before C) decides, and C compacts from it unless
  - every qualifying run is S's own turn re-sent: the OWN_TURN_TOKENS (16) tokens of
    S's prompt that end OWN_TURN_GAP (8) tokens before its end (so skipping the
    assistant header and generation prompt, which a chat template may render
    differently in history) occur among the OWN_TURN_WINDOW (32) tokens before T's
    place in C's prompt. Then C re-sends the history (a re-rendered or edited one:
    a changed system prompt, masked old tool results, a template that renders past
    turns unlike the generation prompt), which is a fork, not a compaction; or
  - S is already the source of a compaction edge of an earlier call (declared or
    inferred): one summary starts one fresh context, so re-sending a compacted
    context, edited, is not a new compaction.
  In both cases older outputs are not searched: a history that is re-sent carries
  every earlier turn, and one of them whose preceding tool result was edited must not
  pass for a summary.

Cost per eligible call C, with R_C = C's new prompt tokens (its prompt past
`shared_len`) plus a margin of the longest earlier summary + 2*TRIM + OWN_TURN_WINDOW,
and n calls in the session: a 64-bit hash of every 4-token window of that region
(numpy, O(R_C)), each looked up among the session's summaries' first core 4-grams,
sorted once per session (O(R_C log n)); then, newest summary first and stopping at the
first one carried, an O(len) comparison only at positions where a core's first and
last 4-grams both match. Over a session: O(n log n + sum R_C log n), i.e. linear (up to
the log) in the tokens the trie stores for the eligible calls, even for a harness
whose every call re-renders the whole history; a continuation (most calls) costs
nothing.

Deliberately simplified: only token ids are compared (there is no tokenizer here), so a
summary the harness edited beyond TRIM tokens at its edges, or wrapped differently
inside (a re-flowed paragraph), is not recognised; its fresh context stays a root or a
fork, as before. The own-turn test reads only a short probe: a history re-sent with
an edit among the 16 probe tokens of its newest output's prompt (the end of the latest
tool result) reads as a compaction from that output.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tidal.ledger.types import Call
from tidal.tree.trie import IdArray, SessionTrie

TRIM = 2
MIN_TOKENS = 8
MIN_SHARE = (4, 5)  # 80%, as a fraction so that ceil() stays exact
OWN_TURN_TOKENS = 16
OWN_TURN_GAP = 8  # the assistant header / generation prompt a re-render may change
OWN_TURN_WINDOW = OWN_TURN_TOKENS + 2 * OWN_TURN_GAP
_GRAM = 4  # prefilter keys: a core's first and last _GRAM tokens
_MUL = np.uint64(0x9E3779B97F4A7C15)

KeyArray = npt.NDArray[np.uint64]


def summary_text(call: Call) -> IdArray:
    """The summary a call's output stands for: its output ids without the end token."""
    out = call.output_ids
    if call.finish_reason == "stop" and out.shape[0]:
        return out[:-1]
    return out


def required_run(m: int) -> int:
    """The shortest run that counts as carrying a summary of m tokens."""
    num, den = MIN_SHARE
    return max(MIN_TOKENS, -(-num * m // den))


def gram_keys(ids: IdArray) -> KeyArray:
    """A 64-bit polynomial hash of every window of _GRAM tokens (wrapping arithmetic)."""
    n = int(ids.shape[0]) - _GRAM + 1
    if n <= 0:
        return np.zeros(0, np.uint64)
    u = ids.astype(np.uint64)
    h = u[:n].copy()
    for t in range(1, _GRAM):
        h *= _MUL
        h += u[t : t + n]
    return h


def _row_keys(rows: npt.NDArray[np.int64]) -> KeyArray:
    """`gram_keys` of each row of an [N, _GRAM] array (one gram per row)."""
    u = rows.astype(np.uint64)
    h = u[:, 0].copy()
    for t in range(1, _GRAM):
        h *= _MUL
        h += u[:, t]
    return h


class CarriedSummaries:
    """Per session: which earlier call's summary a call's prompt carries (module rule).

    Built once per session (each output read once); `source` is asked for the eligible
    calls in commit order."""

    def __init__(self, trie: SessionTrie) -> None:
        self.trie = trie
        self.texts = [summary_text(sc.call) for sc in trie.calls]
        self.ok = [int(t.shape[0]) >= MIN_TOKENS for t in self.texts]
        # A core has >= MIN_TOKENS - 2*TRIM = _GRAM tokens: key its first and last gram.
        heads = np.zeros((len(self.texts), _GRAM), np.int64)
        tails = np.zeros((len(self.texts), _GRAM), np.int64)
        for i, (t, ok) in enumerate(zip(self.texts, self.ok, strict=True)):
            if ok:
                m = int(t.shape[0])
                heads[i] = t[TRIM : TRIM + _GRAM]
                tails[i] = t[m - TRIM - _GRAM : m - TRIM]
        self.first = _row_keys(heads)
        self.last = _row_keys(tails)
        ok_calls = np.flatnonzero(self.ok)  # calls long enough to be a summary
        order = np.argsort(self.first[ok_calls], kind="stable")
        self.keys = self.first[ok_calls][order]  # their first core grams, sorted
        self.key_calls = ok_calls[order]  # the call of each key
        self.longest: list[int] = []  # longest summary before each call
        best = 0
        for t, ok in zip(self.texts, self.ok, strict=True):
            self.longest.append(best)
            if ok:
                best = max(best, int(t.shape[0]))

    def source(self, index: int, used: set[int]) -> int:
        """The summary call that call `index` compacts from, or -1: the newest earlier
        call S whose summary its prompt carries, unless that run is only S's own turn
        re-sent or S is in `used` (already the source of a compaction)."""
        place = self.trie.places[index]
        if place.shared_len >= place.prompt_len or place.prompt_end < 0 or not self.keys.size:
            return -1
        # Only runs reaching past shared_len count: read the prompt from a margin before
        # it that holds the longest summary, its trimmed edges and the own-turn check.
        start = max(0, place.shared_len - self.longest[index] - 2 * TRIM - OWN_TURN_WINDOW)
        region = self.trie.path_ids(place.prompt_end, start)
        grams = gram_keys(region)
        if grams.shape[0] == 0:
            return -1
        # Positions whose gram is some call's first core gram (looked up in the sorted
        # keys), then the earlier calls owning those keys, newest first.
        slot = np.minimum(np.searchsorted(self.keys, grams), self.keys.shape[0] - 1)
        pos = np.flatnonzero(self.keys[slot] == grams)
        if not pos.shape[0]:
            return -1
        hit_keys = grams[pos]
        uniq = np.unique(hit_keys)
        lo = np.searchsorted(self.keys, uniq, "left")
        n = np.searchsorted(self.keys, uniq, "right") - lo
        owners = self.key_calls[np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))]
        for j in np.sort(owners[owners < index])[::-1].tolist():
            found = self._carried(j, region, grams, pos[hit_keys == self.first[j]],
                                  place.shared_len - start)
            if found is not None:  # the newest carried output decides
                return j if found and j not in used else -1
        return -1

    def _carried(
        self, j: int, region: IdArray, grams: KeyArray, at: npt.NDArray[np.intp], shared: int
    ) -> bool | None:
        """Does `region` (a prompt tail, `grams` its 4-gram keys, `shared` in its
        coordinates) carry call j's summary, its core starting at one of `at`? None: no
        qualifying run; False: only as j's own turn (history); True: as a summary."""
        t = self.texts[j]
        m = int(t.shape[0])
        core = t[TRIM : m - TRIM]
        lc = int(core.shape[0])
        size = int(region.shape[0])
        need = required_run(m)
        # The core must fit, the run reach past `shared`, and the core's last gram match.
        at = at[(at + lc <= size) & (at + lc + TRIM > shared)]
        at = at[grams[at + lc - _GRAM] == self.last[j]]
        found: bool | None = None
        for p in at.tolist():
            if not np.array_equal(region[p : p + lc], core):
                continue
            left = 0
            while left < TRIM and p - left > 0 and region[p - left - 1] == t[TRIM - left - 1]:
                left += 1
            right = 0
            while (right < TRIM and p + lc + right < size
                   and region[p + lc + right] == t[m - TRIM + right]):
                right += 1
            if lc + left + right < need or p + lc + right <= shared:
                continue
            if not self._own_turn(j, region, p - TRIM):
                return True
            found = False
        return found

    def _own_turn(self, j: int, region: IdArray, at: int) -> bool:
        """Is call j's summary at position `at` of `region` its own turn re-sent: do the
        OWN_TURN_TOKENS of its prompt that end OWN_TURN_GAP before the prompt's end
        occur among the OWN_TURN_WINDOW tokens before `at`?"""
        pj = self.trie.places[j]
        end = max(0, pj.prompt_len - OWN_TURN_GAP)
        begin = max(0, end - OWN_TURN_TOKENS)
        if end - begin < _GRAM or pj.prompt_end < 0:
            return False  # too short a prompt to tell: not history
        probe = self.trie.path_ids(pj.prompt_end, begin)[: end - begin]
        window = region[max(0, at - OWN_TURN_WINDOW) : max(0, at)]
        if window.shape[0] < probe.shape[0]:
            return False
        views = np.lib.stride_tricks.sliding_window_view(window, probe.shape[0])
        return bool((views == probe).all(axis=1).any())
