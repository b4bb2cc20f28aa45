import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from buildgraph.deps import CycleError, build_order, parse_deps


class DepsTest(unittest.TestCase):
    def test_parse(self):
        self.assertEqual(parse_deps("app: lib utils\nlib: utils\n# done\n"),
                         {"app": {"lib", "utils"}, "lib": {"utils"}})

    def test_chain(self):
        self.assertEqual(build_order({"app": {"lib"}, "lib": {"core"}}), ["core", "lib", "app"])

    def test_cycle(self):
        with self.assertRaises(CycleError):
            build_order({"a": {"b"}, "b": {"a"}})


if __name__ == "__main__":
    unittest.main()
