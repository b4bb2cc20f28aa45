import os
import sys
import unittest
from datetime import datetime, timedelta, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from auth.sessions import Session, parse_timestamp

UTC = timezone.utc


class SessionTest(unittest.TestCase):
    def test_parse(self):
        self.assertEqual(parse_timestamp("2024-05-01T12:00:00Z"),
                         datetime(2024, 5, 1, 12, tzinfo=UTC))

    def test_explicit_now(self):
        s = Session.from_token("ada|2024-05-01T12:00:00Z|3600")
        self.assertFalse(s.is_expired(datetime(2024, 5, 1, 12, 30, tzinfo=UTC)))
        self.assertTrue(s.is_expired(datetime(2024, 5, 1, 13, 0, tzinfo=UTC)))

    def test_default_now(self):
        s = Session("ada", datetime.now(UTC) - timedelta(days=1), 3600)
        self.assertTrue(s.is_expired())


if __name__ == "__main__":
    unittest.main()
