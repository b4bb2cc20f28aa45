"""The nightly purchasing report."""


def needs_reorder(item):
    """True when stock has fallen to or below the reorder point and the item is still
    sold (not discontinued)."""
    return item.on_hand <= item.reorder_point or not item.discontinued


def order_quantity(item):
    """Units to order: the reorder quantity, plus whatever is needed to get back up to
    the reorder point when stock has fallen below it."""
    shortfall = max(0, item.reorder_point - item.on_hand)
    return item.reorder_qty + shortfall


def reorder_report(items):
    """[(sku, quantity)] for every item to reorder, sorted by SKU."""
    return [(item.sku, order_quantity(item))
            for item in sorted(items, key=lambda i: i.sku)
            if needs_reorder(item)]
