"""Login sessions and their expiry. All stored times are timezone-aware UTC."""

from datetime import datetime, timedelta, timezone


def parse_timestamp(text):
    """An aware UTC datetime from ISO 8601 text: '2024-05-01T12:00:00Z', one with an
    offset ('...+02:00'), or naive text, which is taken to be UTC."""
    text = text.strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    value = datetime.fromisoformat(text)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


class Session:
    def __init__(self, user, issued_at, ttl_seconds=3600):
        self.user = user
        self.issued_at = issued_at
        self.expires_at = issued_at + timedelta(seconds=ttl_seconds)

    @classmethod
    def from_token(cls, token):
        """A session from 'user|issued-at|ttl-seconds'."""
        user, issued, ttl = token.split("|")
        return cls(user, parse_timestamp(issued), int(ttl))

    def is_expired(self, now=None):
        """Whether the session has expired at `now` (default: the current time). A naive
        `now` is taken to be UTC."""
        now = now or datetime.utcnow()
        return now >= self.expires_at

    def remaining(self, now=None):
        """Time left until expiry at `now` (never negative)."""
        now = now or datetime.utcnow()
        return max(timedelta(0), self.expires_at - now)
