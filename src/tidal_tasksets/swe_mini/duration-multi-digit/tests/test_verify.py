import unittest

from timespec.durations import format_duration, parse_duration


class VerifyDurations(unittest.TestCase):
    def test_single_digit_parts(self):
        self.assertEqual(parse_duration("5m"), 300)
        self.assertEqual(parse_duration("2d"), 172800)
        self.assertEqual(parse_duration("1d 2h"), 93600)

    def test_multi_digit_seconds(self):
        self.assertEqual(parse_duration("90s"), 90)

    def test_multi_digit_parts(self):
        self.assertEqual(parse_duration("1h30m"), 5400)
        self.assertEqual(parse_duration("12h 45m"), 45900)

    def test_large_numbers(self):
        self.assertEqual(parse_duration("100d"), 8640000)

    def test_case_and_spaces(self):
        self.assertEqual(parse_duration(" 1H 15M "), 4500)

    def test_bare_number(self):
        self.assertEqual(parse_duration("45"), 45)

    def test_rejects_bad_text(self):
        for text in ("", "   ", "10x", "h", "1h5", "5m!"):
            with self.assertRaises(ValueError):
                parse_duration(text)

    def test_round_trip(self):
        for seconds in (1, 59, 61, 5400, 86399, 93784, 200000):
            self.assertEqual(parse_duration(format_duration(seconds)), seconds)

    def test_format(self):
        self.assertEqual(format_duration(3725), "1h2m5s")
        self.assertEqual(format_duration(0), "0s")


if __name__ == "__main__":
    unittest.main()
