"""A self-contained HTML page showing one episode's trees (`tidal inspect`).

Layout: one block per session, subagent sessions nested (collapsible) under the call
that spawned them. Inside a session, trie nodes are rows: a chain of nodes stays in one
column; at a branch point the smaller branches open as nested collapsible blocks and the
largest one continues in the same column (heavy-path layout, so a long main line does
not indent). Each row is coloured by the role of the call that wrote it, its left border
by the kind of that call's incoming edge (an inferred compaction reads "compaction
(inferred)"); it shows the node's kind (P: prompt tokens, O: model output), the call
id and the token count; sampled paths end with a star and
their reward and advantage. Clicking a row shows its text: output nodes show the call's
`output_text` and `raw_tool_calls`; prompt nodes show token ids, or text when a `decode`
callable is given (there is no tokenizer in tidal.tree).

Deliberately simplified: prompt token lists are cut to the first `MAX_PROMPT_TOKENS`
tokens in the page; no external scripts or styles, so the file opens anywhere.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from typing import Any

from tidal.tree.episode import EpisodeGraph
from tidal.tree.process import EpisodeReport
from tidal.tree.shape import shape_svg
from tidal.tree.trie import CallPlace, SessionTrie
from tidal.tree.types import Branch

MAX_PROMPT_TOKENS = 1000
ROLE_COLOURS = {
    "main": "#dbeafe",
    "main_summary": "#e9d5ff",
    "subagent": "#dcfce7",
    "subagent_summary": "#fef9c3",
}
OTHER_ROLE_COLOUR = "#f3f4f6"
EDGE_COLOURS = {
    "root": "#111827",
    "continuation": "#2563eb",
    "parallel": "#ea580c",
    "subagent": "#16a34a",
    "compaction": "#9333ea",
    "retry": "#dc2626",
    "fork": "#6b7280",
}

_CSS = """
body{font:14px system-ui,sans-serif;margin:0;display:flex;height:100vh}
#tree{flex:3;overflow:auto;padding:12px}#panel{flex:2;overflow:auto;padding:12px;
border-left:1px solid #ccc;background:#fafafa}pre{white-space:pre-wrap;word-break:break-all}
.row{margin:2px 0;padding:2px 6px;border-left:6px solid #000;cursor:pointer;
font-family:monospace;font-size:12px;border-radius:3px}.row:hover{outline:1px solid #333}
details{margin-left:18px;border-left:1px dashed #bbb;padding-left:6px}
summary{cursor:pointer;color:#374151;font-size:12px}.model{font-weight:bold}
.star{color:#b45309}.legend span{display:inline-block;margin:2px 6px 2px 0;padding:1px 6px;
border-radius:3px;font-size:12px}.sess{border:1px solid #ddd;padding:6px;margin:6px 0}
table{border-collapse:collapse}td{padding:1px 8px;font-size:12px}
.shape{margin:8px 0;overflow-x:auto}.shape svg{max-width:100%;height:auto}
"""

_JS = """
const NODES = JSON.parse(document.getElementById('nodes').textContent);
function show(k){const n=NODES[k];const p=document.getElementById('panel');
p.innerHTML='';const h=document.createElement('h3');h.textContent=n.title;p.appendChild(h);
for(const [label,body] of n.parts){const b=document.createElement('b');b.textContent=label;
p.appendChild(b);const pre=document.createElement('pre');pre.textContent=body;p.appendChild(pre);}}
document.querySelectorAll('.row').forEach(r=>r.addEventListener('click',()=>show(r.dataset.k)));
"""


def _esc(s: object) -> str:
    return html.escape(str(s), quote=True)


class _Page:
    """Accumulates the page body and the per-node texts while walking the episode."""

    def __init__(
        self,
        graph: EpisodeGraph,
        branches: Sequence[Branch],
        decode: Callable[[Sequence[int]], str] | None,
    ) -> None:
        self.graph = graph
        self.decode = decode
        self.out: list[str] = []
        self.nodes: dict[str, dict[str, Any]] = {}
        self.kind_of: dict[tuple[str, str], str] = {
            (e.dst_session, e.dst_call): e.kind for e in graph.edges
        }
        self.inferred: set[tuple[str, str]] = {
            (e.dst_session, e.dst_call) for e in graph.edges if e.inferred
        }
        self.sampled: dict[tuple[str, str], Branch] = {
            (b.session_id, b.call_id): b for b in branches
        }
        self.ends: dict[tuple[int, int], list[CallPlace]] = {}
        for si, t in enumerate(graph.tries):
            for p in t.places:
                self.ends.setdefault((si, p.context_end), []).append(p)
        self.spawned: dict[tuple[str, str], list[int]] = {}
        for i, s in enumerate(graph.sessions[1:], start=1):
            link = s.parent_link
            if link is not None and link[1] is not None:
                self.spawned.setdefault((link[0], link[1]), []).append(i)

    def session(self, si: int) -> None:
        trie = self.graph.tries[si]
        sess = self.graph.sessions[si]
        oc = sess.outcome
        status = (
            f"{oc.status.value}, reward {oc.reward:g}, partial score {oc.partial_score:g}"
            if oc else "no outcome"
        )
        self.out.append(
            f'<div class="sess"><b>session {_esc(sess.session_id)}</b> '
            f"({len(trie.calls)} calls, {len(trie.nodes)} nodes, {trie.unique_tokens} tokens, "
            f"{_esc(status)})"
        )
        size = [0] * len(trie.nodes)
        for n in reversed(trie.nodes):
            size[n.index] += len(n)
            if n.parent >= 0:
                size[n.parent] += size[n.index]
        for r in trie.roots:
            self.lane(si, trie, r, size)
        self.out.append("</div>")

    def lane(self, si: int, trie: SessionTrie, node: int, size: list[int]) -> None:
        while True:
            self.row(si, trie, node)
            kids = list(trie.nodes[node].children)
            if not kids:
                return
            heavy = max(kids, key=lambda k: (size[k], -k))
            for k in kids:
                if k == heavy:
                    continue
                self.out.append(
                    f"<details open><summary>branch: {size[k]} tokens, from call "
                    f"{_esc(trie.calls[trie.nodes[k].call].call_id)}</summary>"
                )
                self.lane(si, trie, k, size)
                self.out.append("</details>")
            node = heavy

    def row(self, si: int, trie: SessionTrie, ni: int) -> None:
        n = trie.nodes[ni]
        sc = trie.calls[n.call]
        call = sc.call
        sid = trie.session_id
        kind = self.kind_of.get((sid, call.call_id), "root")
        label = f"{kind} (inferred)" if (sid, call.call_id) in self.inferred else kind
        key = f"{si}:{ni}"
        colour = ROLE_COLOURS.get(call.role, OTHER_ROLE_COLOUR)
        tag = "O" if n.model else "P"
        ends = self.ends.get((si, ni), [])
        star = ""
        for p in ends:
            b = self.sampled.get((sid, p.call_id))
            if b is not None:
                star += (f' <span class="star">&#9733; {_esc(b.role)} reward {b.reward:g} '
                         f"adv {b.advantage:+.3g}</span>")
        self.out.append(
            f'<div class="row{" model" if n.model else ""}" data-k="{key}" '
            f'style="background:{colour};border-left-color:{EDGE_COLOURS.get(kind, "#000")}">'
            f"{tag} {_esc(call.call_id)} &middot; {_esc(call.role)} &middot; {_esc(label)} "
            f"&middot; {len(n)} tok @ {n.depth}{star}</div>"
        )
        parts: list[tuple[str, str]] = []
        if n.model:
            start = n.depth - trie.places[n.call].prompt_len
            parts.append((f"output tokens [{start}:{start + len(n)}] of the call; output_text",
                          call.output_text))
            if call.raw_tool_calls:
                parts.append(("raw_tool_calls", call.raw_tool_calls))
        ids = n.token_ids[:MAX_PROMPT_TOKENS].tolist()
        cut = "" if len(n) <= MAX_PROMPT_TOKENS else f" (first {MAX_PROMPT_TOKENS} of {len(n)})"
        if self.decode is not None:
            parts.append((f"text{cut}", self.decode(ids)))
        else:
            parts.append((f"token ids{cut}", " ".join(map(str, ids))))
        parts.append(("call", json.dumps({
            "session": sid, "call": call.call_id, "role": call.role, "edge": label,
            "policy_version": call.policy_version, "finish_reason": call.finish_reason,
            "seq": sc.seq, "ends_here": [p.call_id for p in ends],
        }, indent=1)))
        self.nodes[key] = {"title": f"{tag} node {ni} of {sid}", "parts": parts}
        for p in ends:
            for child in self.spawned.get((sid, p.call_id), []):
                self.out.append(
                    f"<details open><summary>subagent session "
                    f"{_esc(self.graph.sessions[child].session_id)} spawned by "
                    f"{_esc(p.call_id)}</summary>"
                )
                self.session(child)
                self.out.append("</details>")


def render_episode_html(
    graph: EpisodeGraph,
    report: EpisodeReport,
    branches: Sequence[Branch] = (),
    *,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> str:
    """The whole page for one episode, as a string."""
    page = _Page(graph, branches, decode)
    page.session(0)
    legend = "".join(
        f'<span style="background:{c}">{_esc(r)}</span>' for r, c in ROLE_COLOURS.items()
    ) + " &nbsp; " + "".join(
        f'<span style="border-left:6px solid {c};background:#fff">{_esc(k)}</span>'
        for k, c in EDGE_COLOURS.items()
    )
    stats = "".join(
        f"<tr><td>{_esc(k)}</td><td>{_esc(json.dumps(v))}</td></tr>"
        for k, v in report.to_json().items()
    )
    shape = shape_svg(graph, branches, role_colours=ROLE_COLOURS, edge_colours=EDGE_COLOURS,
                      other_role=OTHER_ROLE_COLOUR)
    data = json.dumps(page.nodes).replace("</", "<\\/")
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>episode {_esc(graph.episode_id)}</title><style>{_CSS}</style></head><body>"
        f"<div id='tree'><h2>episode {_esc(graph.episode_id)}</h2>"
        f"<div class='legend'>roles: {legend}</div>"
        f"<div class='shape'>{shape}<div class='legend'>ring: where a sampled path ends; "
        "dashed: a compaction (the context was replaced)</div></div>"
        f"<details><summary>episode figures</summary><table>{stats}</table></details>"
        f"{''.join(page.out)}</div>"
        "<div id='panel'><p>Click a node to see its text.</p></div>"
        f"<script type='application/json' id='nodes'>{data}</script>"
        f"<script>{_JS}</script></body></html>"
    )
