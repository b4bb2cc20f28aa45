"""Amounts are kept as integer cents; these helpers turn them into text and back."""


def format_cents(cents):
    """Text for an amount in cents: 123450 -> '1234.50', -5 -> '-0.05'."""
    dollars = cents // 100
    rest = cents % 100
    return f"{dollars}.{rest:02d}"


def parse_amount(text):
    """Cents from text such as '12.5', '-3.05', '7' or '1,234.56'."""
    cleaned = text.strip().replace(",", "")
    negative = cleaned.startswith("-")
    if negative:
        cleaned = cleaned[1:]
    whole, _, frac = cleaned.partition(".")
    if (not (whole or frac) or (whole and not whole.isdigit())
            or (frac and not frac.isdigit()) or len(frac) > 2):
        raise ValueError(f"not an amount: {text!r}")
    cents = int(whole or "0") * 100 + int(frac.ljust(2, "0"))
    return -cents if negative else cents


def statement(entries):
    """Lines 'description  amount  balance' for (description, cents) entries."""
    lines = []
    balance = 0
    for description, cents in entries:
        balance += cents
        lines.append(f"{description:<20}{format_cents(cents):>12}{format_cents(balance):>12}")
    return lines
