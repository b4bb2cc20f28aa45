import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from matrix.ops import multiply, transpose


class OpsTest(unittest.TestCase):
    def test_transpose(self):
        self.assertEqual(transpose([[1, 2, 3], [4, 5, 6]]), [[1, 4], [2, 5], [3, 6]])

    def test_multiply_square(self):
        self.assertEqual(multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]]), [[19, 22], [43, 50]])

    def test_multiply_mismatch(self):
        with self.assertRaises(ValueError):
            multiply([[1, 2]], [[1, 2]])


if __name__ == "__main__":
    unittest.main()
