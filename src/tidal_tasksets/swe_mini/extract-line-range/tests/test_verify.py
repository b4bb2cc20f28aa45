import unittest

from textkit.lines import extract_lines, head, number_lines, tail

TEXT = "one\ntwo\nthree\nfour\nfive"


class VerifyLines(unittest.TestCase):
    def test_extract_middle(self):
        self.assertEqual(extract_lines(TEXT, 2, 4), ["two", "three", "four"])

    def test_extract_single_first_line(self):
        self.assertEqual(extract_lines(TEXT, 1, 1), ["one"])

    def test_extract_single_last_line(self):
        self.assertEqual(extract_lines(TEXT, 5, 5), ["five"])

    def test_extract_to_end_by_default(self):
        self.assertEqual(extract_lines(TEXT, 3), ["three", "four", "five"])

    def test_extract_clamps_end(self):
        self.assertEqual(extract_lines(TEXT, 4, 100), ["four", "five"])

    def test_extract_whole_text(self):
        self.assertEqual(extract_lines(TEXT, 1, 5), TEXT.split("\n"))

    def test_start_after_end_is_empty(self):
        self.assertEqual(extract_lines(TEXT, 4, 2), [])

    def test_start_below_one_raises(self):
        with self.assertRaises(ValueError):
            extract_lines(TEXT, 0, 2)

    def test_head_tail(self):
        self.assertEqual(head(TEXT, 2), ["one", "two"])
        self.assertEqual(tail(TEXT, 2), ["four", "five"])
        self.assertEqual(tail(TEXT, 0), [])

    def test_number_lines(self):
        self.assertEqual(number_lines("a\nb"), ["1  a", "2  b"])


if __name__ == "__main__":
    unittest.main()
