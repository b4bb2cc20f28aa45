import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from blog.slugs import slugify, unique_slug


class SlugTest(unittest.TestCase):
    def test_ascii_title(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")

    def test_accents(self):
        self.assertEqual(slugify("Crème brûlée for beginners"), "creme-brulee-for-beginners")

    def test_unique(self):
        self.assertEqual(unique_slug("Hello world", {"hello-world"}), "hello-world-2")


if __name__ == "__main__":
    unittest.main()
