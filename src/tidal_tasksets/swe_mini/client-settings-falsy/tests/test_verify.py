import unittest

from httpclient.settings import build_settings, from_env


class VerifySettings(unittest.TestCase):
    def test_defaults(self):
        s = build_settings()
        self.assertEqual((s.timeout, s.retries, s.verify_tls, s.user_agent, s.proxy),
                         (30.0, 3, True, "tidal-client/1.0", None))

    def test_override(self):
        s = build_settings({"timeout": 2.5, "proxy": "http://proxy:3128"})
        self.assertEqual((s.timeout, s.proxy), (2.5, "http://proxy:3128"))

    def test_none_means_default(self):
        s = build_settings({"retries": None, "verify_tls": None})
        self.assertEqual((s.retries, s.verify_tls), (3, True))

    def test_zero_retries(self):
        self.assertEqual(build_settings({"retries": 0}).retries, 0)

    def test_verify_tls_false(self):
        self.assertIs(build_settings({"verify_tls": False}).verify_tls, False)

    def test_zero_timeout(self):
        self.assertEqual(build_settings({"timeout": 0.0}).timeout, 0.0)

    def test_unknown_option(self):
        with self.assertRaises(ValueError):
            build_settings({"retry": 1})

    def test_from_env_overrides(self):
        s = from_env({"HTTPCLIENT_TIMEOUT": "5", "HTTPCLIENT_USER_AGENT": "bot/2"})
        self.assertEqual((s.timeout, s.user_agent, s.retries), (5.0, "bot/2", 3))

    def test_from_env_falsy_values(self):
        s = from_env({"HTTPCLIENT_RETRIES": "0", "HTTPCLIENT_VERIFY_TLS": "false"})
        self.assertEqual((s.retries, s.verify_tls), (0, False))


if __name__ == "__main__":
    unittest.main()
