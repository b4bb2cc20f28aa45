import unittest

from blog.slugs import slugify, unique_slug


class VerifySlugs(unittest.TestCase):
    def test_ascii_title(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")

    def test_separator_runs(self):
        self.assertEqual(slugify("  --Python 3.11 -- released!!  "), "python-3-11-released")

    def test_accents(self):
        self.assertEqual(slugify("Crème brûlée for beginners"), "creme-brulee-for-beginners")

    def test_uppercase_accents(self):
        self.assertEqual(slugify("Ça va? ÉTÉ À PARIS"), "ca-va-ete-a-paris")

    def test_mixed_scripts(self):
        self.assertEqual(slugify("naïve café – déjà vu"), "naive-cafe-deja-vu")

    def test_truncates_at_word_boundary(self):
        self.assertEqual(slugify("one two three four", max_length=10), "one-two")
        self.assertEqual(slugify("abcdefghijkl", max_length=5), "abcde")

    def test_unique_slug_collisions(self):
        taken = {"hello-world", "hello-world-2"}
        self.assertEqual(unique_slug("Hello world", taken), "hello-world-3")

    def test_unique_slug_with_accents(self):
        self.assertEqual(unique_slug("Résumé tips", {"resume-tips"}), "resume-tips-2")

    def test_nothing_usable(self):
        self.assertEqual(unique_slug("!!! ???", set()), "post")
        self.assertEqual(unique_slug("???", {"post"}), "post-2")


if __name__ == "__main__":
    unittest.main()
