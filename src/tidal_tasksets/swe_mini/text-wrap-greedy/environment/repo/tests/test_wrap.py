import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from textfmt import center, wrap


class WrapTest(unittest.TestCase):
    def test_center(self):
        self.assertEqual(center("ab", 5), " ab  ")

    def test_wrap(self):
        self.assertEqual(wrap("The quick brown fox jumps", 10), ["The quick", "brown fox", "jumps"])


if __name__ == "__main__":
    unittest.main()
