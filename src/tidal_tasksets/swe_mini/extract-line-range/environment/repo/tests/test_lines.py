import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from textkit.lines import extract_lines, head, tail

TEXT = "one\ntwo\nthree\nfour\nfive"


class LinesTest(unittest.TestCase):
    def test_extract_middle(self):
        self.assertEqual(extract_lines(TEXT, 2, 4), ["two", "three", "four"])

    def test_extract_rejects_zero(self):
        with self.assertRaises(ValueError):
            extract_lines(TEXT, 0, 2)

    def test_head_and_tail(self):
        self.assertEqual(head(TEXT, 2), ["one", "two"])
        self.assertEqual(tail(TEXT, 2), ["four", "five"])


if __name__ == "__main__":
    unittest.main()
