import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shop.cart import Cart


class CartTest(unittest.TestCase):
    def test_total(self):
        cart = Cart({"tea": 450, "mug": 1200})
        cart.add("tea", 2)
        cart.add("mug")
        self.assertEqual(cart.total(), 2100)

    def test_total_after_remove(self):
        cart = Cart({"tea": 450, "mug": 1200})
        cart.add("tea", 2)
        cart.add("mug")
        cart.total()
        cart.remove("mug")
        self.assertEqual(cart.total(), 900)


if __name__ == "__main__":
    unittest.main()
