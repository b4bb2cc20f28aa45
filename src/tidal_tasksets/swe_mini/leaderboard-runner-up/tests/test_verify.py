import unittest

from leaderboard.ranking import best_score, ranks, runner_up


class VerifyRanking(unittest.TestCase):
    def test_distinct_scores(self):
        self.assertEqual(runner_up([60, 90, 75]), 75)

    def test_tied_winners(self):
        self.assertEqual(runner_up([90, 75, 90]), 75)

    def test_many_duplicates(self):
        self.assertEqual(runner_up([5, 5, 5, 3, 3, 1]), 3)

    def test_all_equal(self):
        self.assertIsNone(runner_up([80, 80]))

    def test_empty_and_single(self):
        self.assertIsNone(runner_up([]))
        self.assertIsNone(runner_up([42]))

    def test_negative_scores(self):
        self.assertEqual(runner_up([-1, -5, -1]), -5)

    def test_does_not_reorder_input(self):
        scores = [3, 9, 1, 9]
        runner_up(scores)
        self.assertEqual(scores, [3, 9, 1, 9])

    def test_best_score(self):
        self.assertEqual(best_score([3, 9, 1]), 9)
        self.assertIsNone(best_score([]))

    def test_ranks(self):
        self.assertEqual(ranks({"ann": 10, "bob": 7, "cy": 10, "dee": 2}),
                         {"ann": 1, "cy": 1, "bob": 3, "dee": 4})


if __name__ == "__main__":
    unittest.main()
