import os
import sys
import unittest
from decimal import Decimal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from billing.discounts import apply_discount, discount_rate


class DiscountTest(unittest.TestCase):
    def test_small_order(self):
        self.assertEqual(discount_rate("50"), Decimal("0"))

    def test_first_tier(self):
        self.assertEqual(apply_discount("120"), Decimal("114.00"))

    def test_top_tier(self):
        self.assertEqual(apply_discount("1000"), Decimal("850.00"))


if __name__ == "__main__":
    unittest.main()
