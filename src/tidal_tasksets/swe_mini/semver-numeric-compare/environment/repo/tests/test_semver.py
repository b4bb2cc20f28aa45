import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pkgver.semver import Version, latest


class SemverTest(unittest.TestCase):
    def test_prerelease_before_release(self):
        self.assertLess(Version("1.0.0-rc.1"), Version("1.0.0"))

    def test_numeric_components(self):
        self.assertGreater(Version("1.10.0"), Version("1.9.0"))

    def test_latest(self):
        self.assertEqual(latest(["1.2.0", "1.10.0", "1.9.3"]), "1.10.0")


if __name__ == "__main__":
    unittest.main()
