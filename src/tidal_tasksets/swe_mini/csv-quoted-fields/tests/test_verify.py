import unittest
from datetime import date
from decimal import Decimal

from bankimport.importer import Transaction, load_transactions, totals_by_currency

HEADER = "date,description,amount,currency\n"


class VerifyImporter(unittest.TestCase):
    def test_plain_rows(self):
        text = HEADER + "2024-03-01,Coffee,-3.20,eur\n2024-03-02,Salary,2500.00,EUR\n"
        self.assertEqual(load_transactions(text), [
            Transaction(date(2024, 3, 1), "Coffee", Decimal("-3.20"), "EUR"),
            Transaction(date(2024, 3, 2), "Salary", Decimal("2500.00"), "EUR"),
        ])

    def test_blank_lines_and_empty_input(self):
        text = HEADER + "\n2024-03-01,Coffee,-3.20,eur\n\n"
        self.assertEqual(len(load_transactions(text)), 1)
        self.assertEqual(load_transactions(""), [])

    def test_header_case_and_order(self):
        text = "Amount,Currency,Date,Description\n-3.20,usd,2024-03-01,Coffee\n"
        t = load_transactions(text)[0]
        self.assertEqual((t.amount, t.currency, t.description),
                         (Decimal("-3.20"), "USD", "Coffee"))

    def test_quoted_field_with_comma(self):
        text = HEADER + '2024-03-01,"ACME, Inc. invoice 42",-120.50,eur\n'
        t = load_transactions(text)[0]
        self.assertEqual((t.description, t.amount), ("ACME, Inc. invoice 42", Decimal("-120.50")))

    def test_escaped_quotes(self):
        text = HEADER + '2024-03-04,"Book ""Dune"", 2nd hand",-8.00,EUR\n'
        self.assertEqual(load_transactions(text)[0].description, 'Book "Dune", 2nd hand')

    def test_quoted_plain_field(self):
        text = HEADER + '2024-03-05,"Rent",-900.00,"eur"\n'
        t = load_transactions(text)[0]
        self.assertEqual((t.description, t.currency), ("Rent", "EUR"))

    def test_totals(self):
        text = (HEADER + '2024-03-01,"Shop, online",-20.00,eur\n'
                '2024-03-02,Salary,100.00,EUR\n2024-03-03,Taxi,-5.50,usd\n')
        self.assertEqual(totals_by_currency(load_transactions(text)),
                         {"EUR": Decimal("80.00"), "USD": Decimal("-5.50")})


if __name__ == "__main__":
    unittest.main()
