import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from urlnorm.normalize import is_absolute, normalize_url


class NormalizeTest(unittest.TestCase):
    def test_is_absolute(self):
        self.assertTrue(is_absolute("https://example.com/x"))
        self.assertFalse(is_absolute("/x"))

    def test_example(self):
        self.assertEqual(normalize_url("HTTP://Example.COM:80/Docs/Index.html?b=2&a=1#top"),
                         "http://example.com/Docs/Index.html?a=1&b=2")


if __name__ == "__main__":
    unittest.main()
