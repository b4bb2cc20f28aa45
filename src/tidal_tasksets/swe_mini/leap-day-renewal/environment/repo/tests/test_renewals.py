import os
import sys
import unittest
from datetime import date

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from subscriptions.renewals import add_months, add_years


class RenewalTest(unittest.TestCase):
    def test_ordinary_date(self):
        self.assertEqual(add_years(date(2023, 3, 15), 1), date(2024, 3, 15))

    def test_leap_day(self):
        self.assertEqual(add_years(date(2024, 2, 29), 1), date(2025, 2, 28))

    def test_month_end(self):
        self.assertEqual(add_months(date(2024, 1, 31), 1), date(2024, 2, 29))


if __name__ == "__main__":
    unittest.main()
