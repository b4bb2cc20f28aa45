import unittest

from ratelimit.limiter import PerClientLimiter, SlidingWindowLimiter


class VerifyLimiter(unittest.TestCase):
    def test_burst_is_capped(self):
        limiter = SlidingWindowLimiter(3, 1.0)
        self.assertEqual([limiter.allow(0.0) for _ in range(5)],
                         [True, True, True, False, False])

    def test_limit_of_one(self):
        limiter = SlidingWindowLimiter(1, 10.0)
        self.assertTrue(limiter.allow(0.0))
        self.assertFalse(limiter.allow(5.0))

    def test_still_rejected_inside_window(self):
        limiter = SlidingWindowLimiter(3, 1.0)
        for t in (0.0, 0.1, 0.2):
            self.assertTrue(limiter.allow(t))
        self.assertFalse(limiter.allow(0.99))

    def test_allowed_again_after_window(self):
        limiter = SlidingWindowLimiter(2, 1.0)
        limiter.allow(0.0)
        limiter.allow(0.0)
        self.assertTrue(limiter.allow(1.5))

    def test_half_open_window(self):
        limiter = SlidingWindowLimiter(1, 1.0)
        self.assertTrue(limiter.allow(0.0))
        self.assertTrue(limiter.allow(1.0))

    def test_sliding_not_fixed_window(self):
        limiter = SlidingWindowLimiter(2, 1.0)
        self.assertTrue(limiter.allow(0.0))
        self.assertTrue(limiter.allow(0.6))
        self.assertFalse(limiter.allow(0.9))
        self.assertTrue(limiter.allow(1.0))
        self.assertFalse(limiter.allow(1.5))

    def test_remaining(self):
        limiter = SlidingWindowLimiter(3, 1.0)
        self.assertEqual(limiter.remaining(0.0), 3)
        limiter.allow(0.0)
        limiter.allow(0.0)
        self.assertEqual(limiter.remaining(0.5), 1)
        self.assertEqual(limiter.remaining(1.0), 3)

    def test_invalid_arguments(self):
        with self.assertRaises(ValueError):
            SlidingWindowLimiter(0, 1.0)
        with self.assertRaises(ValueError):
            SlidingWindowLimiter(1, 0)

    def test_per_client_isolation(self):
        limiter = PerClientLimiter(2, 1.0)
        self.assertTrue(limiter.allow("alice", 0.0))
        self.assertTrue(limiter.allow("alice", 0.0))
        self.assertTrue(limiter.allow("bob", 0.0))

    def test_per_client_cap(self):
        limiter = PerClientLimiter(2, 1.0)
        results = [limiter.allow("alice", 0.0) for _ in range(3)]
        self.assertEqual(results, [True, True, False])


if __name__ == "__main__":
    unittest.main()
