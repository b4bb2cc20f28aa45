"""Sliding-window rate limiter: at most `limit` requests in any `period` seconds."""

from collections import deque


class SlidingWindowLimiter:
    def __init__(self, limit, period):
        if limit < 1 or period <= 0:
            raise ValueError("limit must be at least 1 and period positive")
        self.limit = limit
        self.period = period
        self._hits = deque()

    def _expire(self, now):
        # A request at time t counts against requests in [t, t + period).
        while self._hits and self._hits[0] <= now - self.period:
            self._hits.popleft()

    def allow(self, now):
        """Record a request at `now` (seconds) and say whether it is allowed.

        Rejected requests are not recorded.
        """
        self._expire(now)
        if len(self._hits) > self.limit:
            return False
        self._hits.append(now)
        return True

    def remaining(self, now):
        """How many more requests would be allowed at `now`."""
        self._expire(now)
        return max(0, self.limit - len(self._hits))


class PerClientLimiter:
    """One sliding window per client key."""

    def __init__(self, limit, period):
        self.limit = limit
        self.period = period
        self._clients = {}

    def allow(self, client, now):
        limiter = self._clients.get(client)
        if limiter is None:
            limiter = self._clients[client] = SlidingWindowLimiter(self.limit, self.period)
        return limiter.allow(now)
