import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from httpclient.settings import DEFAULTS, build_settings


class SettingsTest(unittest.TestCase):
    def test_defaults(self):
        self.assertEqual(build_settings().retries, DEFAULTS["retries"])

    def test_override(self):
        self.assertEqual(build_settings({"timeout": 2.5}).timeout, 2.5)

    def test_zero_retries(self):
        self.assertEqual(build_settings({"retries": 0}).retries, 0)


if __name__ == "__main__":
    unittest.main()
