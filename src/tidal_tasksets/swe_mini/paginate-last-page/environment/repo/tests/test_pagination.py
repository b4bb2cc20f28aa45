import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from catalog.pagination import PageError, paginate


class PaginateTest(unittest.TestCase):
    def test_first_page(self):
        page = paginate(list(range(25)), 1, per_page=10)
        self.assertEqual(page.items, list(range(10)))
        self.assertFalse(page.has_previous)

    def test_exact_multiple(self):
        page = paginate(list(range(20)), 2, per_page=10)
        self.assertEqual(page.items, list(range(10, 20)))
        self.assertFalse(page.has_next)

    def test_last_partial_page(self):
        page = paginate(list(range(25)), 3, per_page=10)
        self.assertEqual(page.items, [20, 21, 22, 23, 24])
        self.assertEqual(page.total_pages, 3)

    def test_page_zero_is_rejected(self):
        with self.assertRaises(PageError):
            paginate(list(range(5)), 0)


if __name__ == "__main__":
    unittest.main()
