import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from confdoc.pointer import join_pointer, resolve, split_pointer

DOC = {"database": {"replicas": [{"host": "db1"}, {"host": "db2"}]}}


class PointerTest(unittest.TestCase):
    def test_join(self):
        self.assertEqual(join_pointer(["a/b", "c~d"]), "/a~1b/c~0d")

    def test_split(self):
        self.assertEqual(split_pointer("/a~1b/c~0d"), ["a/b", "c~d"])

    def test_resolve(self):
        self.assertEqual(resolve(DOC, "/database/replicas/1/host"), "db2")


if __name__ == "__main__":
    unittest.main()
