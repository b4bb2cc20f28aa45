import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from timespec.durations import format_duration, parse_duration


class DurationTest(unittest.TestCase):
    def test_single_part(self):
        self.assertEqual(parse_duration("5m"), 300)

    def test_multi_digit(self):
        self.assertEqual(parse_duration("1h30m"), 5400)

    def test_format(self):
        self.assertEqual(format_duration(3725), "1h2m5s")


if __name__ == "__main__":
    unittest.main()
