import unittest

from inventory.models import Item
from inventory.reorder import needs_reorder, order_quantity, reorder_report


class VerifyReorder(unittest.TestCase):
    def test_low_stock_active(self):
        self.assertTrue(needs_reorder(Item("NUT-4", 10, 50, 100)))

    def test_at_reorder_point(self):
        self.assertTrue(needs_reorder(Item("NUT-4", 50, 50, 100)))

    def test_well_stocked(self):
        self.assertFalse(needs_reorder(Item("BOLT-10", 500, 100, 200)))

    def test_just_above_reorder_point(self):
        self.assertFalse(needs_reorder(Item("BOLT-10", 101, 100, 200)))

    def test_low_stock_discontinued(self):
        self.assertFalse(needs_reorder(Item("OLD-1", 0, 5, 10, discontinued=True)))

    def test_well_stocked_discontinued(self):
        self.assertFalse(needs_reorder(Item("OLD-2", 90, 5, 10, discontinued=True)))

    def test_order_quantity(self):
        self.assertEqual(order_quantity(Item("NUT-4", 10, 50, 100)), 140)
        self.assertEqual(order_quantity(Item("NUT-4", 50, 50, 100)), 100)

    def test_report(self):
        items = [
            Item("WASHER", 3, 20, 50),
            Item("BOLT-10", 500, 100, 200),
            Item("ANCHOR", 0, 10, 25),
            Item("OLD-1", 0, 5, 10, discontinued=True),
        ]
        self.assertEqual(reorder_report(items), [("ANCHOR", 35), ("WASHER", 67)])

    def test_empty_report(self):
        self.assertEqual(reorder_report([]), [])


if __name__ == "__main__":
    unittest.main()
