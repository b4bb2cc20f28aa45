import unittest
from datetime import date

from subscriptions.renewals import add_months, add_years, renewal_dates


class VerifyRenewals(unittest.TestCase):
    def test_ordinary_date(self):
        self.assertEqual(add_years(date(2023, 3, 15), 1), date(2024, 3, 15))
        self.assertEqual(add_years(date(2023, 3, 15), 0), date(2023, 3, 15))

    def test_leap_day_to_common_year(self):
        self.assertEqual(add_years(date(2024, 2, 29), 1), date(2025, 2, 28))

    def test_leap_day_to_leap_year(self):
        self.assertEqual(add_years(date(2024, 2, 29), 4), date(2028, 2, 29))

    def test_leap_day_to_century_year(self):
        self.assertEqual(add_years(date(2096, 2, 29), 4), date(2100, 2, 28))
        self.assertEqual(add_years(date(1996, 2, 29), 4), date(2000, 2, 29))

    def test_leap_day_backwards(self):
        self.assertEqual(add_years(date(2024, 2, 29), -1), date(2023, 2, 28))

    def test_yearly_renewals_from_leap_day(self):
        self.assertEqual(renewal_dates(date(2024, 2, 29), 4), [
            date(2025, 2, 28), date(2026, 2, 28), date(2027, 2, 28), date(2028, 2, 29)])

    def test_yearly_renewals_ordinary(self):
        self.assertEqual(renewal_dates(date(2023, 7, 1), 2),
                         [date(2024, 7, 1), date(2025, 7, 1)])

    def test_month_end_clamping(self):
        self.assertEqual(add_months(date(2024, 1, 31), 1), date(2024, 2, 29))
        self.assertEqual(add_months(date(2023, 12, 15), 2), date(2024, 2, 15))

    def test_monthly_renewals(self):
        self.assertEqual(renewal_dates(date(2024, 1, 31), 3, every="month"),
                         [date(2024, 2, 29), date(2024, 3, 31), date(2024, 4, 30)])

    def test_unknown_period(self):
        with self.assertRaises(ValueError):
            renewal_dates(date(2024, 1, 1), 1, every="week")


if __name__ == "__main__":
    unittest.main()
