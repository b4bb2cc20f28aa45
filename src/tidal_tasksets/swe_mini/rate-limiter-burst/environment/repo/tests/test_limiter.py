import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ratelimit.limiter import SlidingWindowLimiter


class LimiterTest(unittest.TestCase):
    def test_burst_is_capped(self):
        limiter = SlidingWindowLimiter(3, 1.0)
        self.assertEqual([limiter.allow(0.0) for _ in range(5)],
                         [True, True, True, False, False])

    def test_window_slides(self):
        limiter = SlidingWindowLimiter(2, 1.0)
        limiter.allow(0.0)
        limiter.allow(0.5)
        self.assertTrue(limiter.allow(1.2))


if __name__ == "__main__":
    unittest.main()
