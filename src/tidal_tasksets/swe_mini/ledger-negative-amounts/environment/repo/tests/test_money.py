import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ledger.money import format_cents, parse_amount


class MoneyTest(unittest.TestCase):
    def test_format_positive(self):
        self.assertEqual(format_cents(123450), "1234.50")

    def test_format_negative(self):
        self.assertEqual(format_cents(-150), "-1.50")

    def test_parse(self):
        self.assertEqual(parse_amount("-3.05"), -305)
        self.assertEqual(parse_amount("1,234.5"), 123450)


if __name__ == "__main__":
    unittest.main()
