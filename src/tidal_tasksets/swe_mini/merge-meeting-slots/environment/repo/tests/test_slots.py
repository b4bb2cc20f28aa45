import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meetings.slots import fmt, merge_slots, overlaps


class SlotsTest(unittest.TestCase):
    def test_overlaps(self):
        self.assertTrue(overlaps((540, 600), (590, 620)))
        self.assertFalse(overlaps((540, 600), (600, 620)))

    def test_fmt(self):
        self.assertEqual(fmt(545), "09:05")

    def test_merge(self):
        self.assertEqual(merge_slots([(600, 630), (540, 600), (700, 720), (705, 710)]),
                         [(540, 630), (700, 720)])


if __name__ == "__main__":
    unittest.main()
