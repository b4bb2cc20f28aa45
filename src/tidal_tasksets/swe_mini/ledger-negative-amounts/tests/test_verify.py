import unittest

from ledger.money import format_cents, parse_amount, statement


class VerifyMoney(unittest.TestCase):
    def test_format_positive(self):
        self.assertEqual(format_cents(123450), "1234.50")
        self.assertEqual(format_cents(7), "0.07")

    def test_format_zero(self):
        self.assertEqual(format_cents(0), "0.00")

    def test_format_negative(self):
        self.assertEqual(format_cents(-150), "-1.50")

    def test_format_small_negative(self):
        self.assertEqual(format_cents(-5), "-0.05")
        self.assertEqual(format_cents(-99), "-0.99")

    def test_format_negative_whole(self):
        self.assertEqual(format_cents(-100), "-1.00")

    def test_parse(self):
        self.assertEqual(parse_amount("-3.05"), -305)
        self.assertEqual(parse_amount("1,234.5"), 123450)
        self.assertEqual(parse_amount("7"), 700)

    def test_parse_rejects_junk(self):
        for text in ("", "-", "1.234", "abc", "1.2.3"):
            with self.assertRaises(ValueError):
                parse_amount(text)

    def test_round_trip(self):
        for text, normal in [("12.5", "12.50"), ("-0.5", "-0.50"), ("-1234.56", "-1234.56"),
                             ("0", "0.00")]:
            self.assertEqual(format_cents(parse_amount(text)), normal)

    def test_statement_with_refund(self):
        lines = statement([("deposit", 1000), ("refund", -1250)])
        self.assertEqual(lines[0].split(), ["deposit", "10.00", "10.00"])
        self.assertEqual(lines[1].split(), ["refund", "-12.50", "-2.50"])


if __name__ == "__main__":
    unittest.main()
