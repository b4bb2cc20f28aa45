"""Rendering: a conversation through the real chat template, cut into per-message blocks.

How "render only the new messages" works: the whole conversation is rendered with the
model's own chat template (so the canonical text of every non-model message is exactly
what the template makes of it), then cut at the family's block marker (`<|im_start|>`
for ChatML) into blocks, and each block is mapped back to the message(s) it renders.
`tidal.gateway.tito` then builds the prompt block by block: recorded token ids for the
model's own turns, tokenized template text for the rest.

Why splicing is exact for ChatML: the block markers are special tokens, and a tokenizer
splits its input at special tokens before running BPE, so the token ids of a rendered
text equal the concatenation of the ids of its blocks. Tokenizing block by block is
therefore the same as tokenizing the whole render, and lets each block's ids be cached.

Limits per family:
- ChatML (Qwen2/2.5/3): one block per message; consecutive tool results share one user
  block; a system block always comes first (the template invents one when the
  conversation has none). Qwen3's template strips `<think>` from earlier assistant
  turns: irrelevant here, since assistant blocks are replaced by recorded tokens.
- A family whose markers are not special tokens (plain-text formats) would need
  boundary-aware tokenization; not built in.

Client text is text (`Renderer.escape`, `Renderer.encode`): a message, tool result, tool
call or tool schema may hold the text of a special token (an agent that cats a
tokenizer config sends `<|im_start|>`). Before rendering, every special token's text in
client strings is replaced by a private-use escape (`\ue000` + one code character; a
client's own `\ue000` is escaped too), so it can neither open a block nor change a role;
a block holding escapes is tokenized at the template's own special tokens and, between
them, with the escapes undone and `split_special_tokens=True`: the client's
`<|im_start|>` becomes the ids of its characters, never id 151644. Blocks without escapes
are tokenized exactly as before. This assumes the template renders strings as they are
or through `tojson` without `ensure_ascii` (Qwen's do); `tidal.gateway.tito` records each
such message as `special_token_text` drift.

Incremental rendering (`Renderer.extend_blocks`): a session's next request usually only
appends messages, so its blocks are the previous request's blocks minus the generation
prompt and the last message block (whose text may depend on what follows it, e.g. an
open run of tool results), plus the blocks of a short render: the leading system message
(if any), the messages from that last block on, the generation prompt. That is exact for
a template whose block text depends only on its own message(s), the neighbours' roles and,
for the leading system block, the tools; Qwen2.5's ChatML template is such a template.
Whether a tokenizer's template is one is checked once per template, by comparing the
incremental and the full render on probe conversations (every split point); a template
that fails (Qwen3's re-renders earlier assistant turns when a user message follows) is
always rendered whole. A short render's system block must also equal the cached one, and
a conversation whose last block starts at a mid-conversation system message (which the
short render would take for the leading one) is rendered whole.

Deliberately simplified: the full path re-renders the whole conversation (Jinja is
~0.1 ms for short chats; O(conversation) text for long ones) while token ids are cached
per block text; the model's blocks are never tokenized from text at all.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.gateway.drift import ClientToolCall
from tidal.gateway.family import ChatFamily, GatewayError
from tidal.gateway.messages import Message, template_message

SYNTHETIC = -1  # message index of a block no message produced (default system prompt)
ESC = "\ue000"  # private use: opens the escape of a special token's text in client strings
_ESC_BASE = 0xE001  # ESC + chr(_ESC_BASE + k): the k-th escaped string (k = 0: ESC itself)
_UNESCAPE_RE = re.compile(re.escape(ESC) + ".", re.S)

_PROBE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "probe",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
_PROBE_CALLS = (ClientToolCall("p1", "f", '{"x": 1}'), ClientToolCall("p2", "f", '{"x": 2}'))
_PROBES: tuple[tuple[Message, ...], ...] = (
    (
        Message("system", "sys"),
        Message("user", "u1"),
        Message("assistant", "<think>r</think>a1"),
        Message("user", "u2"),
        Message("assistant", "", _PROBE_CALLS),
        Message("tool", "r1", tool_call_id="p1"),
        Message("tool", "r2", tool_call_id="p2"),
        Message("assistant", "a2"),
        Message("system", "mid"),
        Message("user", "u3"),
        Message("tool", "r3", tool_call_id="p1"),
        Message("assistant", "<think>r</think>a3"),
        Message("user", "u4"),
    ),
    (
        Message("user", "u1"),
        Message("assistant", "a1", _PROBE_CALLS[:1]),
        Message("tool", "r1", tool_call_id="p1"),
        Message("tool", "r2", tool_call_id="p2"),
        Message("user", "ü2"),
        Message("system", "mid"),
        Message("assistant", "-"),
        Message("user", "u3"),
    ),
)
_INCREMENTAL_OK: dict[tuple[str, str], bool] = {}  # (chat template, family) -> probes passed


@dataclass(frozen=True)
class Block:
    """One rendered block: its text, the role in its header, and the messages it renders
    (`first`..`last` inclusive; SYNTHETIC for an invented system block or the generation
    prompt, which has `generation=True`)."""

    text: str
    role: str
    first: int
    last: int
    generation: bool = False


def split_blocks(text: str, family: ChatFamily) -> list[str]:
    """Cut a rendered conversation at each block marker; the marker starts each block."""
    parts = text.split(family.block_start)
    if parts[0].strip():
        raise GatewayError(
            f"chat template output starts with text before the first {family.block_start!r}: "
            "not the structure of the family " + family.name
        )
    return [family.block_start + p for p in parts[1:]]


def _role_of(block: str, family: ChatFamily) -> str:
    head = block[len(family.block_start) :]
    nl = head.find("\n")
    return head[:nl] if nl >= 0 else head


def map_blocks(
    blocks: Sequence[str],
    messages: Sequence[Message],
    family: ChatFamily,
    *,
    generation: bool = True,
) -> list[Block]:
    """Map blocks to the messages that produced them (the family's grouping rule)."""
    out: list[Block] = []
    bi = 0

    def take(role: str, first: int, last: int, gen: bool = False) -> None:
        nonlocal bi
        if bi >= len(blocks):
            raise GatewayError(
                f"chat template rendered {len(blocks)} blocks, fewer than the messages need "
                f"(family {family.name}); cannot splice recorded tokens"
            )
        got = _role_of(blocks[bi], family)
        if got != role:
            raise GatewayError(
                f"chat template block {bi} has role {got!r} where message {first} needs "
                f"{role!r} (family {family.name}); cannot splice recorded tokens"
            )
        out.append(Block(blocks[bi], role, first, last, gen))
        bi += 1

    i = 0
    if not messages or messages[0].role != "system":
        take("system", SYNTHETIC, SYNTHETIC)
    while i < len(messages):
        m = messages[i]
        if m.role == "tool":
            j = i
            if family.tool_results_grouped:
                while j + 1 < len(messages) and messages[j + 1].role == "tool":
                    j += 1
            take(family.tool_block_role, i, j)
            i = j + 1
        else:
            take(m.role, i, i)
            i += 1
    if generation:
        take("assistant", SYNTHETIC, SYNTHETIC, gen=True)
    if bi != len(blocks):
        raise GatewayError(
            f"chat template rendered {len(blocks)} blocks but the messages account for {bi} "
            f"(family {family.name}); cannot splice recorded tokens"
        )
    return out


class Renderer:
    """Renders conversations with a tokenizer's chat template and tokenizes blocks (with
    an LRU cache of block ids). Thread-safe."""

    def __init__(self, tokenizer: Any, family: ChatFamily, cache_size: int = 65536) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._arrays: OrderedDict[str, npt.NDArray[np.int32]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._init_escapes(tokenizer, family)
        # ids a client may send (/v1/completions): the tokenizer's, added tokens included
        self.vocab_size = int(len(tokenizer) if hasattr(tokenizer, "__len__") else
                              tokenizer.vocab_size)
        self.header_ids = self.encode(family.header("assistant"))
        self.block_end_ids = self.encode(family.block_end)
        self.separator_ids = self.encode(family.separator)
        self.header_array = np.asarray(self.header_ids, dtype=np.int32)
        self.separator_array = np.asarray(self.separator_ids, dtype=np.int32)
        self.closing_array = np.asarray(self.block_end_ids + self.separator_ids, dtype=np.int32)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in family.stop_tokens]
        self.stop_ids: tuple[int, ...] = tuple(int(i) for i in ids if isinstance(i, int))
        if len(self.block_end_ids) != 1:
            raise GatewayError(
                f"{family.block_end!r} is not a single special token in this tokenizer"
            )
        key = (str(getattr(tokenizer, "chat_template", "")), family.name)
        ok = _INCREMENTAL_OK.get(key)
        if ok is None:
            ok = _INCREMENTAL_OK[key] = self._probe_incremental()
        self.incremental = ok

    def _init_escapes(self, tokenizer: Any, family: ChatFamily) -> None:
        """The special tokens' texts (`special_token_ids`) and the family's markers, which
        client strings may not carry into a render, and their escapes (module docstring)."""
        self.special_ids = special_token_ids(tokenizer)
        texts = sorted(
            {*self.special_ids, family.block_start, family.block_end}, key=lambda t: (-len(t), t)
        )
        self.special_texts: tuple[str, ...] = tuple(texts)
        alts = "|".join(map(re.escape, texts))
        self._special_re = re.compile(alts)
        self._escape_re = re.compile(f"{re.escape(ESC)}|{alts}")
        self._escape_code = {t: ESC + chr(_ESC_BASE + k) for k, t in enumerate((ESC, *texts))}
        self._unescape_code = {v: k for k, v in self._escape_code.items()}
        own = sorted(self.special_ids, key=lambda t: (-len(t), t))
        self._own_split = re.compile("(" + "|".join(map(re.escape, own)) + ")") if own else None
        # "<|" for Qwen: a cheap first test (a string prefix is what is meant here)
        self._quick = os.path.commonprefix(texts)  # noqa: RUF071

    def special_texts_in(self, text: str) -> list[str]:
        """The special tokens' texts (and family markers) that occur in `text`, in order."""
        if self._quick not in text:
            return []
        return self._special_re.findall(text)

    def escape(self, text: str) -> str:
        """`text` with every special token's text (and `ESC`) escaped (module docstring)."""
        if self._quick not in text and ESC not in text:
            return text
        return self._escape_re.sub(lambda m: self._escape_code[m.group()], text)

    def unescape(self, text: str) -> str:
        return _UNESCAPE_RE.sub(lambda m: self._unescape_code.get(m.group(), m.group()), text)

    def escape_value(self, value: Any) -> Any:
        """`escape` applied to every string (keys too) of a JSON-like value."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, Mapping):
            return {self.escape_value(k): self.escape_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape_value(v) for v in value]
        return value

    def _encode_escaped(self, text: str) -> list[int]:
        """Ids of a block holding escaped client text: the template's own special tokens
        as their ids, the text between them (escapes undone) as plain text."""
        pieces = self._own_split.split(text) if self._own_split is not None else [text]
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                ids.append(self.special_ids[piece])
            elif piece:
                ids.extend(self.tokenizer.encode(
                    self.unescape(piece), add_special_tokens=False, split_special_tokens=True
                ))
        return ids

    def _probe_incremental(self) -> bool:
        """Does `extend_blocks` give the full render's blocks on the probe conversations?"""
        self.incremental = True
        try:
            for conv in _PROBES:
                for tools in (None, _PROBE_TOOLS):
                    for n in range(1, len(conv)):
                        base = self.blocks(conv[:n], tools)
                        got = self.extend_blocks(base, conv, tools)
                        if got is not None and got != self.blocks(conv, tools):
                            return False
        except GatewayError:
            return False
        return True

    def encode(self, text: str) -> tuple[int, ...]:
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        ids = tuple(
            self._encode_escaped(text)
            if ESC in text
            else self.tokenizer.encode(text, add_special_tokens=False)
        )
        with self._lock:
            self._cache[text] = ids
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return ids

    def encode_array(self, text: str) -> npt.NDArray[np.int32]:
        """`encode` as a read-only int32 array (cached separately; blocks repeat a lot)."""
        with self._lock:
            hit = self._arrays.get(text)
            if hit is not None:
                self._arrays.move_to_end(text)
                return hit
        arr = np.asarray(self.encode(text), dtype=np.int32)
        arr.flags.writeable = False
        with self._lock:
            self._arrays[text] = arr
            if len(self._arrays) > self._cache_size:
                self._arrays.popitem(last=False)
        return arr

    def render(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                [self.escape_value(template_message(m)) for m in messages],
                tools=self.escape_value(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as e:  # jinja raises TemplateError and friends
            raise GatewayError(f"the chat template could not render these messages: {e}") from e
        return str(text)

    def blocks(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None
    ) -> list[Block]:
        return map_blocks(
            split_blocks(self.render(messages, tools), self.family), messages, self.family
        )

    def extend_blocks(
        self,
        base: Sequence[Block],
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None,
    ) -> list[Block] | None:
        """`blocks(messages, tools)` from `base`, the blocks of a prefix of `messages`
        rendered with the same tools, rendering only the prefix's last message block and
        the messages after it (see the module docstring). None: render the whole instead.
        The caller vouches that `base` came from `blocks` on that prefix."""
        if not self.incremental or len(base) < 3 or not base[-1].generation:
            return None
        c = base[-2].first
        if c <= 0:
            return None  # nothing before the last block worth keeping
        head = [messages[0]] if messages[0].role == "system" else []
        if not head and messages[c].role == "system":
            return None  # the short render would take it for the leading system message
        short = [*head, *messages[c:]]
        got = map_blocks(split_blocks(self.render(short, tools), self.family), short, self.family)
        if got[0].text != base[0].text:
            return None
        shift = c - len(head)
        tail = [
            b if b.first == SYNTHETIC else Block(b.text, b.role, b.first + shift, b.last + shift)
            for b in got[1:]
        ]
        return [*base[:-2], *tail]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """Text -> id of the tokenizer's special tokens (those its `encode` turns into one id
    unless `split_special_tokens`): the added tokens marked special, and the named ones."""
    out: dict[str, int] = {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for i, tok in decoder.items():
        if getattr(tok, "special", False) and tok.content:
            out[str(tok.content)] = int(i)
    for t in getattr(tokenizer, "all_special_tokens", None) or []:
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and t not in out:
            out[t] = i
    return out
