"""An undirected network of named nodes."""


class Network:
    def __init__(self):
        self._links = {}

    def add_node(self, name):
        self._links.setdefault(name, set())

    def add_link(self, a, b):
        self.add_node(a)
        self.add_node(b)
        self._links[a].add(b)
        self._links[b].add(a)

    def neighbors(self, name):
        if name not in self._links:
            raise KeyError(name)
        return sorted(self._links[name])

    def nodes(self):
        return sorted(self._links)

    def __contains__(self, name):
        return name in self._links
