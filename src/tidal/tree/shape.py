"""An episode's shape at a glance: every call as a dot, drawn as inline SVG (no library).

The tree page (`tidal.tree.html`) lists trie nodes in detail; this is the picture
above that list. Calls run left to right in commit order (time), in lanes: the longest
line of work through a call stays in its lane, a parallel sibling, a fork or a subagent
branches into a lane below, so fan-outs, helpers and their nesting show as the branching
they were. Lines are coloured by the kind of the call's incoming edge (a compaction's
is dashed, with a bar where the context was replaced: the lane goes on); dots by the
call's role; a ring marks where a sampled (trained) path ends. Each dot's tooltip names
the call.

A lane is reused once its earlier branch has ended, so an episode of many short
branches stays a few lanes tall; hundreds of calls shrink to fit one screen width.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tidal.tree.episode import EpisodeGraph
from tidal.tree.types import Branch

LABEL_W, LANE_H, PAD, MAX_W, MIN_W = 120, 24, 14, 760, 420


@dataclass(frozen=True)
class _Dot:
    x: int  # position in commit order
    lane: int
    session: str
    call: str
    role: str
    kind: str  # incoming edge kind, "root" for none
    tokens: int
    parent: tuple[str, str] | None
    dashed: bool


def _lanes(graph: EpisodeGraph) -> tuple[list[_Dot], list[str]]:
    """Each call's lane, and each lane's label. Heavy-path layout: of a call's children
    in its own session, the one with the most calls below it stays in the lane; each
    other child (and every subagent) takes the first lane below whose span is free."""
    incoming = {(e.dst_session, e.dst_call): e for e in graph.edges}
    index = {s.session_id: i for i, s in enumerate(graph.sessions)}
    calls = sorted((sc.seq, s.session_id, sc) for s in graph.sessions for sc in s.calls)
    x_of = {(sid, sc.call_id): x for x, (_q, sid, sc) in enumerate(calls)}
    children: dict[tuple[str, str], list[tuple[str, str]]] = {}
    roots = []
    for _q, sid, sc in calls:
        e = incoming.get((sid, sc.call_id))
        if e is not None and (e.src_session, e.src_call) in x_of:
            children.setdefault((e.src_session, e.src_call), []).append((sid, sc.call_id))
        else:
            roots.append((sid, sc.call_id))
    size = dict.fromkeys(x_of, 1)
    for key in sorted(x_of, key=x_of.__getitem__, reverse=True):  # children come later
        for c in children.get(key, []):
            size[key] += size[c]

    def kind(key: tuple[str, str]) -> str:
        e = incoming.get(key)
        return e.kind if e is not None else "root"

    def chain(key: tuple[str, str]) -> list[tuple[str, str]]:
        out = [key]
        while True:
            own = [c for c in children.get(out[-1], []) if kind(c) != "subagent"]
            if not own:
                return out
            out.append(max(own, key=lambda c: (size[c], -x_of[c])))

    spans: list[list[tuple[int, int]]] = []  # per lane, the x spans it holds
    lane_of: dict[tuple[str, str], int] = {}

    def free_lane(first: int, a: int, b: int) -> int:
        lane = first
        while lane < len(spans) and any(s <= b + 1 and e >= a - 1 for s, e in spans[lane]):
            lane += 1
        if lane == len(spans):
            spans.append([])
        return lane

    def place(start: tuple[str, str], lane_from: int, a: int) -> None:
        line = chain(start)
        lane = free_lane(lane_from, a, x_of[line[-1]])
        spans[lane].append((a, x_of[line[-1]]))
        for key in line:
            lane_of[key] = lane
        for key in line:
            heavy = set(line)
            for c in children.get(key, []):
                if c not in heavy:
                    place(c, lane + 1, x_of[key])

    for r in roots:
        place(r, 0, x_of[r])
    names: list[list[str]] = [[] for _ in spans]
    for key in sorted(lane_of, key=x_of.__getitem__):
        si = index[key[0]]
        name = "main" if si == 0 else f"subagent {si}"
        if name not in names[lane_of[key]]:
            names[lane_of[key]].append(name)
    labels = [n[0] if len(n) == 1 else f"{len(n)} subagents"
              if all(x.startswith("subagent") for x in n) else f"{len(n)} sessions"
              for n in names]
    dots = []
    for x, (_q, sid, sc) in enumerate(calls):
        e = incoming.get((sid, sc.call_id))
        parent = (e.src_session, e.src_call) if e is not None else None
        dots.append(_Dot(x, lane_of[(sid, sc.call_id)], sid, sc.call_id, sc.call.role,
                         kind((sid, sc.call_id)), int(sc.call.output_ids.shape[0]), parent,
                         kind((sid, sc.call_id)) == "compaction"))
    return dots, labels


def shape_svg(graph: EpisodeGraph, branches: Sequence[Branch], *,
              role_colours: Mapping[str, str], edge_colours: Mapping[str, str],
              other_role: str = "#f3f4f6") -> str:
    """The drawing, as an `<svg>` element sized to its content (it scales down to fit)."""
    dots, labels = _lanes(graph)
    if not dots:
        return ""
    n = len(dots)
    dx = max(3.0, min(30.0, (MAX_W - LABEL_W - 2 * PAD) / max(n, 1)))
    r = max(1.6, min(6.0, dx / 3.5))
    w = max(LABEL_W + 2 * PAD + dx * max(n - 1, 1), MIN_W)
    h = PAD * 2 + LANE_H * len(labels) + 14

    def pos(d: _Dot) -> tuple[float, float]:
        return LABEL_W + PAD + d.x * dx, PAD + LANE_H * d.lane + LANE_H / 2

    at = {(d.session, d.call): d for d in dots}
    sampled = {(b.session_id, b.call_id): b for b in branches}
    out = [f'<svg class="shape" viewBox="0 0 {w:.0f} {h:.0f}" width="{w:.0f}" height="{h:.0f}"'
           f' role="img" aria-label="episode shape: {n} calls in {len(labels)} lanes">']
    for i, label in enumerate(labels):
        y = PAD + LANE_H * i + LANE_H / 2
        if i % 2:
            out.append(f'<rect x="0" y="{y - LANE_H / 2:.1f}" width="{w:.0f}" '
                       f'height="{LANE_H}" fill="#f9fafb"/>')
        out.append(f'<text x="{LABEL_W - 6}" y="{y + 4:.1f}" text-anchor="end" '
                   f'font-size="11" fill="#374151">{html.escape(label)}</text>')
    for d in dots:  # lines under dots
        if d.parent is None or d.parent not in at:
            continue
        (x0, y0), (x1, y1) = pos(at[d.parent]), pos(d)
        colour = edge_colours.get(d.kind, "#6b7280")
        dash = ' stroke-dasharray="4 3"' if d.dashed else ""
        path = f"M{x0:.1f},{y0:.1f} L{x1:.1f},{y1:.1f}" if y0 == y1 else \
            f"M{x0:.1f},{y0:.1f} L{x0:.1f},{y1 - 6 if y1 > y0 else y1 + 6:.1f} " \
            f"Q{x0:.1f},{y1:.1f} {x0 + 6:.1f},{y1:.1f} L{x1:.1f},{y1:.1f}"
        out.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        if d.dashed:  # a compaction: the context was replaced here
            out.append(f'<path d="M{x1 - r - 2.5:.1f},{y1 - 8:.1f} v16" stroke="{colour}" '
                       'stroke-width="2.5"/>')
    for d in dots:
        x, y = pos(d)
        b = sampled.get((d.session, d.call))
        tip = (f"{d.call} · {d.role} · {d.kind} · {d.tokens} output tokens"
               + (f" · sampled path ({b.role}, reward {b.reward:g}, advantage "
                  f"{b.advantage:+.3g})" if b else ""))
        if b is not None:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r + 3:.1f}" fill="none" '
                       f'stroke="#b45309" stroke-width="1.8"/>')
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" '
                   f'fill="{role_colours.get(d.role, other_role)}" stroke="#1f2937" '
                   f'stroke-width="1"><title>{html.escape(tip)}</title></circle>')
    out.append(f'<text x="{LABEL_W + PAD}" y="{h - 4:.0f}" font-size="10" fill="#6b7280">'
               f"calls in commit order &#8594; ({n} calls, {len(labels)} lanes)</text>")
    out.append("</svg>")
    return "".join(out)
