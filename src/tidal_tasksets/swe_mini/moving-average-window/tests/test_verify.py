import unittest

from metrics.smoothing import moving_average, rolling_max


class VerifySmoothing(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(moving_average([1, 2, 3, 4], 2), [1.5, 2.5, 3.5])

    def test_window_equal_to_length(self):
        self.assertEqual(moving_average([2, 4, 6], 3), [4.0])

    def test_window_of_one_is_identity(self):
        self.assertEqual(moving_average([5, 7, 9], 1), [5.0, 7.0, 9.0])

    def test_result_length(self):
        values = list(range(10))
        for window in range(1, 11):
            self.assertEqual(len(moving_average(values, window)), 11 - window)

    def test_window_larger_than_series(self):
        self.assertEqual(moving_average([1, 2], 3), [])

    def test_empty_series(self):
        self.assertEqual(moving_average([], 2), [])

    def test_bad_window(self):
        with self.assertRaises(ValueError):
            moving_average([1, 2, 3], 0)

    def test_rolling_max(self):
        self.assertEqual(rolling_max([3, 1, 4, 1, 5], 2), [3, 4, 4, 5])

    def test_rolling_max_full_window(self):
        self.assertEqual(rolling_max([3, 9, 2], 3), [9])


if __name__ == "__main__":
    unittest.main()
