import unittest

from pkgver.semver import Version, latest, satisfies


class VerifySemver(unittest.TestCase):
    def test_numeric_minor(self):
        self.assertGreater(Version("1.10.0"), Version("1.9.0"))

    def test_numeric_patch_and_major(self):
        self.assertLess(Version("2.0.9"), Version("2.0.10"))
        self.assertLess(Version("9.0.0"), Version("10.0.0"))

    def test_simple_order(self):
        self.assertLess(Version("1.2.3"), Version("1.2.4"))
        self.assertGreater(Version("2.0.0"), Version("1.99.99"))

    def test_prerelease(self):
        self.assertLess(Version("1.0.0-rc.1"), Version("1.0.0"))
        self.assertLess(Version("1.0.0-rc.2"), Version("1.0.0-rc.10"))
        self.assertLess(Version("1.0.0-alpha"), Version("1.0.0-beta"))

    def test_prefix_and_build_metadata(self):
        self.assertEqual(Version("v1.2.3"), Version("1.2.3+build.7"))
        self.assertEqual(len({Version("1.2.3"), Version("v1.2.3")}), 1)

    def test_latest(self):
        self.assertEqual(latest(["1.2.0", "1.10.0", "1.9.3"]), "1.10.0")

    def test_latest_skips_prereleases(self):
        self.assertEqual(latest(["1.0.0", "1.1.0-beta.1"]), "1.0.0")
        self.assertEqual(latest(["1.0.0", "1.1.0-beta.1"], include_prerelease=True),
                         "1.1.0-beta.1")
        self.assertIsNone(latest([]))

    def test_satisfies(self):
        self.assertTrue(satisfies("0.10.1", "0.9.0"))
        self.assertTrue(satisfies("1.2.3", "1.2.3"))
        self.assertFalse(satisfies("1.2.3", "1.12.0"))

    def test_invalid(self):
        for text in ("1.2", "1.2.3.4", "one.two.three", ""):
            with self.assertRaises(ValueError):
                Version(text)


if __name__ == "__main__":
    unittest.main()
