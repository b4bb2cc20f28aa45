import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrics.smoothing import moving_average, rolling_max


class SmoothingTest(unittest.TestCase):
    def test_moving_average(self):
        self.assertEqual(moving_average([1, 2, 3, 4], 2), [1.5, 2.5, 3.5])

    def test_window_larger_than_series(self):
        self.assertEqual(moving_average([1, 2], 3), [])

    def test_rolling_max(self):
        self.assertEqual(rolling_max([3, 1, 4, 1, 5], 2), [3, 4, 4, 5])


if __name__ == "__main__":
    unittest.main()
