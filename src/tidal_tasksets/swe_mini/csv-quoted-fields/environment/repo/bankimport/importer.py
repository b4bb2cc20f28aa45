"""Transactions from the bank's CSV export.

The first line is a header naming the columns date, description, amount and currency
(any order, any case). Dates are ISO (2024-03-01), amounts are like -120.50.
"""

from dataclasses import dataclass
from datetime import date
from decimal import Decimal


@dataclass(frozen=True)
class Transaction:
    date: date
    description: str
    amount: Decimal
    currency: str


def parse_rows(text):
    """The data rows as dicts keyed by lower-case header names; blank lines skipped."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = [name.strip().lower() for name in lines[0].split(",")]
    return [dict(zip(header, line.split(","))) for line in lines[1:]]


def load_transactions(text):
    transactions = []
    for row in parse_rows(text):
        transactions.append(Transaction(
            date=date.fromisoformat(row["date"].strip()),
            description=row["description"].strip(),
            amount=Decimal(row["amount"].strip()),
            currency=row["currency"].strip().upper(),
        ))
    return transactions


def totals_by_currency(transactions):
    totals = {}
    for t in transactions:
        totals[t.currency] = totals.get(t.currency, Decimal("0")) + t.amount
    return totals
