import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inventory.models import Item
from inventory.reorder import needs_reorder, order_quantity


class ReorderTest(unittest.TestCase):
    def test_low_stock_is_reordered(self):
        self.assertTrue(needs_reorder(Item("NUT-4", 10, 50, 100)))

    def test_well_stocked_is_not_reordered(self):
        self.assertFalse(needs_reorder(Item("BOLT-10", 500, 100, 200)))

    def test_order_quantity(self):
        self.assertEqual(order_quantity(Item("NUT-4", 10, 50, 100)), 140)


if __name__ == "__main__":
    unittest.main()
