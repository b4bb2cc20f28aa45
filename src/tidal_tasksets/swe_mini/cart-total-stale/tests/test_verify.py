import unittest

from shop.cart import Cart


def cart():
    c = Cart({"tea": 450, "mug": 1200, "pot": 3000})
    c.add("tea", 2)
    c.add("mug")
    return c


class VerifyCart(unittest.TestCase):
    def test_total(self):
        self.assertEqual(cart().total(), 2100)

    def test_empty_cart(self):
        self.assertEqual(Cart({"tea": 450}).total(), 0)

    def test_add_after_total(self):
        c = cart()
        c.total()
        c.add("pot")
        self.assertEqual(c.total(), 5100)

    def test_remove_after_total(self):
        c = cart()
        c.total()
        c.remove("mug")
        self.assertEqual(c.total(), 900)

    def test_partial_remove_after_total(self):
        c = cart()
        c.total()
        c.remove("tea", 1)
        self.assertEqual((c.total(), c.quantity("tea")), (1650, 1))

    def test_price_change_after_total(self):
        c = cart()
        c.total()
        c.set_price("tea", 500)
        self.assertEqual(c.total(), 2200)

    def test_remove_everything(self):
        c = cart()
        c.total()
        c.remove("tea")
        c.remove("mug")
        self.assertEqual((c.total(), len(c)), (0, 0))

    def test_len_and_quantity(self):
        c = cart()
        self.assertEqual((len(c), c.quantity("tea"), c.quantity("pot")), (3, 2, 0))

    def test_errors(self):
        c = cart()
        with self.assertRaises(KeyError):
            c.add("spoon")
        with self.assertRaises(KeyError):
            c.remove("pot")
        with self.assertRaises(ValueError):
            c.add("tea", 0)


if __name__ == "__main__":
    unittest.main()
