import unittest

from textfmt import center, fill, indent, wrap


class VerifyWrap(unittest.TestCase):
    def test_existing_helpers(self):
        self.assertEqual(center("ab", 5), " ab  ")
        self.assertEqual(indent(["a", "", "b"], "> "), ["> a", "", "> b"])

    def test_example(self):
        self.assertEqual(wrap("The quick brown fox jumps", 10), ["The quick", "brown fox", "jumps"])

    def test_exact_fit(self):
        self.assertEqual(wrap("aaa bbb ccc", 7), ["aaa bbb", "ccc"])
        self.assertEqual(wrap("aaa bbb", 7), ["aaa bbb"])

    def test_long_word_on_its_own_line(self):
        self.assertEqual(wrap("a extraordinarily b c", 5), ["a", "extraordinarily", "b c"])

    def test_whitespace_is_collapsed(self):
        self.assertEqual(wrap("  one\ttwo\n\nthree   four ", 9), ["one two", "three", "four"])

    def test_empty(self):
        self.assertEqual(wrap("", 10), [])
        self.assertEqual(wrap(" \n\t ", 10), [])

    def test_width_one(self):
        self.assertEqual(wrap("a b cd", 1), ["a", "b", "cd"])

    def test_bad_width(self):
        with self.assertRaises(ValueError):
            wrap("text", 0)

    def test_lines_never_exceed_width(self):
        text = " ".join(["lorem", "ipsum", "dolor", "sit", "amet", "consectetur"] * 5)
        for width in range(11, 40):
            lines = wrap(text, width)
            self.assertTrue(all(len(line) <= width for line in lines))
            self.assertEqual(" ".join(lines), text)
            for first, second in zip(lines, lines[1:]):
                self.assertGreater(len(first) + 1 + len(second.split()[0]), width)

    def test_fill(self):
        self.assertEqual(fill("one two three", 7), "one two\nthree")


if __name__ == "__main__":
    unittest.main()
