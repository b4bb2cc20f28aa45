import unittest
from decimal import Decimal

from billing.discounts import apply_discount, discount_rate


class VerifyDiscounts(unittest.TestCase):
    def test_no_discount_below_first_tier(self):
        self.assertEqual(discount_rate("99.99"), Decimal("0"))
        self.assertEqual(discount_rate(0), Decimal("0"))

    def test_first_tier(self):
        self.assertEqual(discount_rate("100"), Decimal("0.05"))
        self.assertEqual(discount_rate("499.99"), Decimal("0.05"))

    def test_second_tier(self):
        self.assertEqual(discount_rate("500"), Decimal("0.10"))
        self.assertEqual(discount_rate("750"), Decimal("0.10"))

    def test_third_tier(self):
        self.assertEqual(discount_rate("1000"), Decimal("0.15"))
        self.assertEqual(discount_rate("25000"), Decimal("0.15"))

    def test_apply_first_tier(self):
        self.assertEqual(apply_discount("120"), Decimal("114.00"))

    def test_apply_top_tier(self):
        self.assertEqual(apply_discount("1000"), Decimal("850.00"))

    def test_apply_rounds_to_cents(self):
        self.assertEqual(apply_discount("555.55"), Decimal("500.00"))

    def test_negative_total(self):
        with self.assertRaises(ValueError):
            discount_rate("-1")


if __name__ == "__main__":
    unittest.main()
