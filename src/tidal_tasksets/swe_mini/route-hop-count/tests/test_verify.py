import unittest

from netgraph.graph import Network
from netgraph.routes import hop_count, shortest_path, within_hops


def chain():
    net = Network()
    net.add_link("a", "b")
    net.add_link("b", "c")
    net.add_link("c", "d")
    return net


def ring_with_shortcut():
    net = Network()
    for a, b in [("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"), ("e", "a"), ("b", "e")]:
        net.add_link(a, b)
    return net


class VerifyRoutes(unittest.TestCase):
    def test_same_node_is_zero_hops(self):
        self.assertEqual(hop_count(chain(), "c", "c"), 0)

    def test_neighbours_are_one_hop(self):
        self.assertEqual(hop_count(chain(), "a", "b"), 1)
        self.assertEqual(hop_count(chain(), "c", "b"), 1)

    def test_chain_end_to_end(self):
        self.assertEqual(hop_count(chain(), "a", "d"), 3)

    def test_takes_the_shorter_route(self):
        self.assertEqual(hop_count(ring_with_shortcut(), "a", "c"), 2)
        self.assertEqual(shortest_path(ring_with_shortcut(), "a", "c"), ["a", "b", "c"])

    def test_unreachable_is_none(self):
        net = chain()
        net.add_node("island")
        self.assertIsNone(hop_count(net, "a", "island"))

    def test_unknown_node_raises(self):
        with self.assertRaises(KeyError):
            hop_count(chain(), "a", "zz")

    def test_shortest_path_chain(self):
        self.assertEqual(shortest_path(chain(), "d", "a"), ["d", "c", "b", "a"])

    def test_within_one_hop(self):
        self.assertEqual(within_hops(chain(), "b", 1), ["a", "c"])

    def test_within_two_hops(self):
        self.assertEqual(within_hops(chain(), "a", 2), ["b", "c"])

    def test_within_zero_hops(self):
        self.assertEqual(within_hops(chain(), "a", 0), [])


if __name__ == "__main__":
    unittest.main()
