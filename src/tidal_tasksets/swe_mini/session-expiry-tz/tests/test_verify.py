import unittest
from datetime import datetime, timedelta, timezone

from auth.sessions import Session, parse_timestamp

UTC = timezone.utc


class VerifySessions(unittest.TestCase):
    def test_parse_z_and_offset(self):
        self.assertEqual(parse_timestamp("2024-05-01T12:00:00Z"),
                         datetime(2024, 5, 1, 12, tzinfo=UTC))
        self.assertEqual(parse_timestamp("2024-05-01T14:00:00+02:00"),
                         datetime(2024, 5, 1, 12, tzinfo=UTC))

    def test_explicit_aware_now(self):
        s = Session.from_token("ada|2024-05-01T12:00:00Z|3600")
        self.assertFalse(s.is_expired(datetime(2024, 5, 1, 12, 59, 59, tzinfo=UTC)))
        self.assertTrue(s.is_expired(datetime(2024, 5, 1, 13, 0, tzinfo=UTC)))

    def test_explicit_now_other_offset(self):
        s = Session.from_token("ada|2024-05-01T12:00:00Z|3600")
        paris = timezone(timedelta(hours=2))
        self.assertFalse(s.is_expired(datetime(2024, 5, 1, 14, 30, tzinfo=paris)))

    def test_default_now_old_session(self):
        s = Session("ada", datetime.now(UTC) - timedelta(days=1), 3600)
        self.assertTrue(s.is_expired())

    def test_default_now_fresh_session(self):
        s = Session("ada", datetime.now(UTC), 3600)
        self.assertFalse(s.is_expired())

    def test_naive_now_means_utc(self):
        s = Session.from_token("ada|2024-05-01T12:00:00Z|3600")
        self.assertFalse(s.is_expired(datetime(2024, 5, 1, 12, 30)))
        self.assertTrue(s.is_expired(datetime(2024, 5, 1, 13, 30)))

    def test_remaining_explicit(self):
        s = Session.from_token("ada|2024-05-01T12:00:00Z|3600")
        self.assertEqual(s.remaining(datetime(2024, 5, 1, 12, 45, tzinfo=UTC)),
                         timedelta(minutes=15))
        self.assertEqual(s.remaining(datetime(2024, 5, 2, tzinfo=UTC)), timedelta(0))

    def test_remaining_default_now(self):
        s = Session("ada", datetime.now(UTC) - timedelta(days=1), 3600)
        self.assertEqual(s.remaining(), timedelta(0))
        fresh = Session("bob", datetime.now(UTC), 3600)
        self.assertGreater(fresh.remaining(), timedelta(minutes=59))

    def test_remaining_naive_now(self):
        s = Session.from_token("ada|2024-05-01T12:00:00Z|3600")
        self.assertEqual(s.remaining(datetime(2024, 5, 1, 12, 50)), timedelta(minutes=10))


if __name__ == "__main__":
    unittest.main()
