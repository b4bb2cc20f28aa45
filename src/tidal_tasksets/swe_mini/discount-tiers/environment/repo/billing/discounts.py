"""Volume discounts for wholesale orders."""

from decimal import ROUND_HALF_UP, Decimal

# (minimum order total, rate): an order gets the rate of the highest tier it reaches.
TIERS = [
    (Decimal("100"), Decimal("0.05")),
    (Decimal("500"), Decimal("0.10")),
    (Decimal("1000"), Decimal("0.15")),
]

CENT = Decimal("0.01")


def discount_rate(total):
    total = Decimal(total)
    if total < 0:
        raise ValueError("an order total cannot be negative")
    for minimum, rate in TIERS:
        if total >= minimum:
            return rate
    return Decimal("0")


def apply_discount(total):
    """The order total after its volume discount, rounded to cents."""
    total = Decimal(total)
    discounted = total * (1 - discount_rate(total))
    return discounted.quantize(CENT, rounding=ROUND_HALF_UP)
