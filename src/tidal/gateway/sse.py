"""Server-sent events shared by the APIs' stream encoders (server.py, responses.py,
anthropic.py): the event framing and how a finished text is cut into deltas.

Streams replay a finished generation (the engine protocol returns whole generations), so
the deltas are cut from the recorded text, one per sampled token where the tokens' texts
line up with it.
"""

from __future__ import annotations

import json
from typing import Any


def sse(obj: Any, event: str | None = None) -> bytes:
    """One event: `data: {json}` (OpenAI chat), with `event: NAME` before it when given
    (the Responses and Anthropic streams)."""
    data = json.dumps(obj, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


def text_pieces(text: str, token_texts: tuple[str, ...]) -> list[str]:
    """`text` cut where the sampled tokens' texts cut it (the text may be only part of the
    output: after a thinking block, before a tool call); in ~16 even pieces when the token
    texts do not hold it (tokens that decode only together, as some UTF-8 does)."""
    if not text:
        return []
    joined = "".join(token_texts)
    start = joined.find(text)
    if start < 0:
        step = max(1, len(text) // 16)
        return [text[i : i + step] for i in range(0, len(text), step)]
    out, pos, end = [], 0, start + len(text)
    for t in token_texts:
        a, b = max(pos, start), min(pos + len(t), end)
        if a < b:
            out.append(joined[a:b])
        pos += len(t)
    return out
