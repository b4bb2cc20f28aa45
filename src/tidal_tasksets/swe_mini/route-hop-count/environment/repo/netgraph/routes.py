"""Route queries over a `Network`: breadth-first search."""

from collections import deque


def shortest_path(net, src, dst):
    """The nodes of a shortest route from src to dst, both ends included; None when dst
    cannot be reached. Unknown nodes raise KeyError."""
    for node in (src, dst):
        if node not in net:
            raise KeyError(node)
    parents = {src: None}
    queue = deque([src])
    while queue:
        node = queue.popleft()
        if node == dst:
            break
        for nxt in net.neighbors(node):
            if nxt not in parents:
                parents[nxt] = node
                queue.append(nxt)
    if dst not in parents:
        return None
    path = [dst]
    while parents[path[-1]] is not None:
        path.append(parents[path[-1]])
    return path[::-1]


def hop_count(net, src, dst):
    """Number of links on a shortest route from src to dst (0 from a node to itself);
    None when dst cannot be reached."""
    path = shortest_path(net, src, dst)
    if path is None:
        return None
    return len(path)


def within_hops(net, src, max_hops):
    """Nodes other than src that are at most `max_hops` links away, sorted."""
    found = []
    for node in net.nodes():
        if node == src:
            continue
        hops = hop_count(net, src, node)
        if hops is not None and hops <= max_hops:
            found.append(node)
    return found
