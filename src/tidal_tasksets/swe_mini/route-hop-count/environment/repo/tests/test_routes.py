import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from netgraph.graph import Network
from netgraph.routes import hop_count, shortest_path


def chain():
    net = Network()
    net.add_link("a", "b")
    net.add_link("b", "c")
    net.add_link("c", "d")
    return net


class RoutesTest(unittest.TestCase):
    def test_shortest_path(self):
        self.assertEqual(shortest_path(chain(), "a", "d"), ["a", "b", "c", "d"])

    def test_hop_count_neighbours(self):
        self.assertEqual(hop_count(chain(), "a", "b"), 1)

    def test_unreachable(self):
        net = chain()
        net.add_node("island")
        self.assertIsNone(hop_count(net, "a", "island"))


if __name__ == "__main__":
    unittest.main()
