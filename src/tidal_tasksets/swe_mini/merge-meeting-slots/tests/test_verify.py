import unittest

from meetings.slots import fmt, free_slots, merge_slots, overlaps


class VerifySlots(unittest.TestCase):
    def test_overlaps_and_fmt(self):
        self.assertTrue(overlaps((540, 600), (590, 620)))
        self.assertFalse(overlaps((540, 600), (600, 620)))
        self.assertEqual(fmt(545), "09:05")

    def test_merge_example(self):
        self.assertEqual(merge_slots([(600, 630), (540, 600), (700, 720), (705, 710)]),
                         [(540, 630), (700, 720)])

    def test_disjoint_slots_are_sorted(self):
        self.assertEqual(merge_slots([(800, 830), (540, 560)]), [(540, 560), (800, 830)])

    def test_chain_of_overlaps(self):
        self.assertEqual(merge_slots([(1, 5), (4, 8), (7, 10), (10, 12)]), [(1, 12)])

    def test_contained_and_duplicate(self):
        self.assertEqual(merge_slots([(100, 400), (150, 200), (100, 400)]), [(100, 400)])

    def test_empty(self):
        self.assertEqual(merge_slots([]), [])

    def test_accepts_any_iterable_and_keeps_input(self):
        slots = [(30, 40), (10, 20)]
        self.assertEqual(merge_slots(iter(slots)), [(10, 20), (30, 40)])
        merge_slots(slots)
        self.assertEqual(slots, [(30, 40), (10, 20)])

    def test_invalid_slot(self):
        with self.assertRaises(ValueError):
            merge_slots([(10, 20), (30, 30)])
        with self.assertRaises(ValueError):
            merge_slots([(50, 40)])

    def test_free_slots(self):
        busy = [(600, 660), (540, 600), (720, 780)]
        self.assertEqual(free_slots(busy, 480, 1020), [(480, 540), (660, 720), (780, 1020)])
        self.assertEqual(free_slots(busy, 480, 1020, min_length=90), [(780, 1020)])


if __name__ == "__main__":
    unittest.main()
