"""A shopping cart. Amounts are integer cents."""


class Cart:
    def __init__(self, prices):
        self._prices = dict(prices)   # sku -> unit price
        self._lines = {}              # sku -> quantity
        self._total = None            # cached total, None when it must be recomputed

    def add(self, sku, qty=1):
        if sku not in self._prices:
            raise KeyError(f"unknown product {sku!r}")
        if qty < 1:
            raise ValueError("quantity must be at least 1")
        self._lines[sku] = self._lines.get(sku, 0) + qty
        self._total = None

    def remove(self, sku, qty=None):
        """Remove `qty` units of `sku` (all of them when qty is None)."""
        if sku not in self._lines:
            raise KeyError(f"{sku!r} is not in the cart")
        if qty is None or qty >= self._lines[sku]:
            del self._lines[sku]
        else:
            self._lines[sku] -= qty

    def set_price(self, sku, cents):
        if sku not in self._prices:
            raise KeyError(f"unknown product {sku!r}")
        self._prices[sku] = cents

    def quantity(self, sku):
        return self._lines.get(sku, 0)

    def total(self):
        if self._total is None:
            self._total = sum(self._prices[sku] * qty for sku, qty in self._lines.items())
        return self._total

    def __len__(self):
        return sum(self._lines.values())
