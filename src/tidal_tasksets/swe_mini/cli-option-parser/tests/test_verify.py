import unittest

from minicli.args import Spec, UsageError, format_usage, parse_args

SPEC = Spec(flags=["verbose", "dry-run"], options=["output", "level"],
            aliases={"v": "verbose", "o": "output", "n": "dry-run"},
            defaults={"level": "info"})


def parse(*argv):
    return parse_args(SPEC, list(argv))


class VerifyArgs(unittest.TestCase):
    def test_spec_and_usage(self):
        with self.assertRaises(ValueError):
            Spec(flags=["a"], aliases={"b": "missing"})
        self.assertTrue(format_usage(SPEC, "tool").startswith("usage: tool [-v|--verbose]"))

    def test_defaults(self):
        self.assertEqual(parse(), ({"verbose": False, "dry-run": False, "output": None,
                                    "level": "info"}, []))

    def test_long_option_forms(self):
        opts, rest = parse("--output", "a.txt", "--level=debug")
        self.assertEqual((opts["output"], opts["level"], rest), ("a.txt", "debug", []))

    def test_equals_value_may_contain_equals(self):
        self.assertEqual(parse("--output=a=b.txt")[0]["output"], "a=b.txt")

    def test_last_value_wins(self):
        self.assertEqual(parse("--level", "warn", "-o", "x", "--level", "error")[0]["level"],
                         "error")

    def test_flags_and_aliases(self):
        opts, rest = parse("-v", "file1", "--dry-run", "-o", "out.txt", "file2")
        self.assertEqual((opts["verbose"], opts["dry-run"], opts["output"], rest),
                         (True, True, "out.txt", ["file1", "file2"]))

    def test_value_starting_with_dash(self):
        self.assertEqual(parse("--output", "-", "--level", "-3")[0],
                         {"verbose": False, "dry-run": False, "output": "-", "level": "-3"})

    def test_double_dash_and_lone_dash(self):
        opts, rest = parse("-", "--", "--verbose", "-o", "x")
        self.assertEqual((opts["verbose"], opts["output"], rest),
                         (False, None, ["-", "--verbose", "-o", "x"]))

    def test_unknown_options(self):
        for argv in (["--colour"], ["-x"], ["--colour=red"]):
            with self.assertRaises(UsageError):
                parse(*argv)

    def test_missing_value(self):
        for argv in (["--output"], ["-o"], ["a", "--level"]):
            with self.assertRaises(UsageError):
                parse(*argv)

    def test_flag_with_value(self):
        with self.assertRaises(UsageError):
            parse("--verbose=yes")


if __name__ == "__main__":
    unittest.main()
