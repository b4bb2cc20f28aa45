import copy
import unittest

from matrix.ops import add, identity, multiply, power, shape, transpose


class VerifyMatrix(unittest.TestCase):
    def test_existing_helpers(self):
        self.assertEqual(shape([[1, 2, 3], [4, 5, 6]]), (2, 3))
        self.assertEqual(transpose([[1, 2, 3], [4, 5, 6]]), [[1, 4], [2, 5], [3, 6]])
        self.assertEqual(add([[1, 2]], [[3, 4]]), [[4, 6]])

    def test_power_zero_is_identity(self):
        self.assertEqual(power([[2, 0], [0, 2]], 0), identity(2))

    def test_multiply_square(self):
        self.assertEqual(multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]]), [[19, 22], [43, 50]])

    def test_multiply_rectangular(self):
        a = [[1, 2, 3], [4, 5, 6]]
        b = [[7, 8], [9, 10], [11, 12]]
        self.assertEqual(multiply(a, b), [[58, 64], [139, 154]])
        self.assertEqual(multiply(b, a), [[39, 54, 69], [49, 68, 87], [59, 82, 105]])

    def test_row_times_column(self):
        self.assertEqual(multiply([[1, 2, 3]], [[4], [5], [6]]), [[32]])
        self.assertEqual(multiply([[2], [3]], [[4, 5]]), [[8, 10], [12, 15]])

    def test_identity(self):
        m = [[3, -1], [0.5, 7]]
        self.assertEqual(multiply(identity(2), m), m)
        self.assertEqual(multiply(m, identity(2)), m)

    def test_mismatched_shapes(self):
        with self.assertRaises(ValueError):
            multiply([[1, 2]], [[1, 2]])
        with self.assertRaises(ValueError):
            multiply([[1, 2], [3, 4]], [[1, 2, 3]])

    def test_empty_or_ragged(self):
        with self.assertRaises(ValueError):
            multiply([], [[1]])
        with self.assertRaises(ValueError):
            multiply([[1, 2], [3]], [[1], [2]])

    def test_inputs_unchanged_and_result_fresh(self):
        a, b = [[1, 2], [3, 4]], [[1, 0], [0, 1]]
        a0, b0 = copy.deepcopy(a), copy.deepcopy(b)
        result = multiply(a, b)
        self.assertEqual((a, b), (a0, b0))
        result[0][0] = 99
        self.assertEqual((a, b), (a0, b0))
        self.assertIsInstance(multiply([[1]], [[2]])[0][0], int)

    def test_power(self):
        self.assertEqual(power([[1, 1], [1, 0]], 10), [[89, 55], [55, 34]])


if __name__ == "__main__":
    unittest.main()
