import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from urltools.query import parse_query


class QueryTest(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(parse_query("a=1&b=two+words"), {"a": ["1"], "b": ["two words"]})

    def test_value_with_equals(self):
        self.assertEqual(parse_query("user=ada&token=YWJjZA=="),
                         {"user": ["ada"], "token": ["YWJjZA=="]})


if __name__ == "__main__":
    unittest.main()
