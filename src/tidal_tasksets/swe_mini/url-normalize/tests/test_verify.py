import unittest

from urlnorm.normalize import is_absolute, normalize_url, same_page


class VerifyNormalize(unittest.TestCase):
    def test_is_absolute(self):
        self.assertTrue(is_absolute("https://example.com/x"))
        self.assertFalse(is_absolute("/x"))
        self.assertFalse(is_absolute("example.com/x"))

    def test_example(self):
        self.assertEqual(normalize_url("HTTP://Example.COM:80/Docs/Index.html?b=2&a=1#top"),
                         "http://example.com/Docs/Index.html?a=1&b=2")

    def test_path_case_kept(self):
        self.assertEqual(normalize_url("https://EXAMPLE.org/A/b/C"), "https://example.org/A/b/C")

    def test_default_ports(self):
        self.assertEqual(normalize_url("https://example.com:443/x"), "https://example.com/x")
        self.assertEqual(normalize_url("http://example.com:443/x"), "http://example.com:443/x")

    def test_other_port_kept(self):
        self.assertEqual(normalize_url("http://Example.com:8080/"), "http://example.com:8080/")

    def test_empty_path(self):
        self.assertEqual(normalize_url("https://example.com"), "https://example.com/")
        self.assertEqual(normalize_url("https://example.com?q=1"), "https://example.com/?q=1")

    def test_fragment_removed(self):
        self.assertEqual(normalize_url("https://example.com/a#section-2"), "https://example.com/a")

    def test_query_sorted_and_blank_values_kept(self):
        self.assertEqual(normalize_url("http://x.io/s?b=&a=1&a=0"), "http://x.io/s?a=0&a=1&b=")

    def test_query_reencoded(self):
        self.assertEqual(normalize_url("http://x.io/s?q=caf%C3%A9 au lait&z=%7E"),
                         "http://x.io/s?q=caf%C3%A9+au+lait&z=~")

    def test_relative_raises(self):
        for url in ("/just/a/path", "example.com/x", ""):
            with self.assertRaises(ValueError):
                normalize_url(url)

    def test_same_page(self):
        self.assertTrue(same_page("https://Shop.example/cart?b=2&a=1#x",
                                  "https://shop.example:443/cart?a=1&b=2"))
        self.assertFalse(same_page("https://shop.example/Cart", "https://shop.example/cart"))


if __name__ == "__main__":
    unittest.main()
