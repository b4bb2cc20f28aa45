import unittest

from catalog.pagination import PageError, page_count, paginate


class VerifyPagination(unittest.TestCase):
    def test_page_count_partial(self):
        self.assertEqual(page_count(25, 10), 3)
        self.assertEqual(page_count(11, 10), 2)

    def test_page_count_exact_multiple(self):
        self.assertEqual(page_count(20, 10), 2)
        self.assertEqual(page_count(10, 10), 1)

    def test_page_count_small_and_empty(self):
        self.assertEqual(page_count(0, 10), 1)
        self.assertEqual(page_count(1, 10), 1)

    def test_page_count_rejects_bad_per_page(self):
        with self.assertRaises(ValueError):
            page_count(10, 0)

    def test_last_partial_page_items(self):
        page = paginate(list(range(25)), 3, per_page=10)
        self.assertEqual(page.items, [20, 21, 22, 23, 24])
        self.assertEqual(page.total_pages, 3)
        self.assertFalse(page.has_next)
        self.assertTrue(page.has_previous)

    def test_middle_page_has_next(self):
        page = paginate(list(range(25)), 2, per_page=10)
        self.assertEqual(page.items, list(range(10, 20)))
        self.assertTrue(page.has_next)

    def test_single_item_last_page(self):
        page = paginate(list("abcdefg"), 3, per_page=3)
        self.assertEqual(page.items, ["g"])

    def test_empty_listing_has_one_page(self):
        page = paginate([], 1)
        self.assertEqual(page.items, [])
        self.assertEqual(page.total_pages, 1)
        self.assertFalse(page.has_next)

    def test_beyond_last_page_raises(self):
        with self.assertRaises(PageError):
            paginate(list(range(25)), 4, per_page=10)
        with self.assertRaises(PageError):
            paginate(list(range(20)), 3, per_page=10)

    def test_page_zero_raises(self):
        with self.assertRaises(PageError):
            paginate(list(range(5)), 0)


if __name__ == "__main__":
    unittest.main()
