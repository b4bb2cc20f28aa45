import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minicli.args import Spec, UsageError, format_usage, parse_args

SPEC = Spec(flags=["verbose"], options=["output"], aliases={"v": "verbose", "o": "output"})


class ArgsTest(unittest.TestCase):
    def test_usage(self):
        self.assertEqual(format_usage(SPEC, "tool"),
                         "usage: tool [-v|--verbose] [-o|--output OUTPUT] [ARGS...]")

    def test_example(self):
        self.assertEqual(parse_args(SPEC, ["-o", "x.txt", "in.csv", "--verbose"]),
                         ({"verbose": True, "output": "x.txt"}, ["in.csv"]))

    def test_unknown(self):
        with self.assertRaises(UsageError):
            parse_args(SPEC, ["--colour"])


if __name__ == "__main__":
    unittest.main()
