import os
import sys
import unittest
from datetime import date
from decimal import Decimal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bankimport.importer import load_transactions


class ImporterTest(unittest.TestCase):
    def test_plain_rows(self):
        text = "date,description,amount,currency\n2024-03-01,Coffee,-3.20,eur\n"
        t = load_transactions(text)[0]
        self.assertEqual((t.date, t.description, t.amount, t.currency),
                         (date(2024, 3, 1), "Coffee", Decimal("-3.20"), "EUR"))

    def test_quoted_description(self):
        text = ('date,description,amount,currency\n'
                '2024-03-01,"ACME, Inc. invoice 42",-120.50,eur\n')
        self.assertEqual(load_transactions(text)[0].description, "ACME, Inc. invoice 42")


if __name__ == "__main__":
    unittest.main()
