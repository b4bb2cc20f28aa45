import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from leaderboard.ranking import ranks, runner_up


class RankingTest(unittest.TestCase):
    def test_runner_up(self):
        self.assertEqual(runner_up([60, 90, 75]), 75)

    def test_runner_up_with_tied_winners(self):
        self.assertEqual(runner_up([90, 75, 90]), 75)

    def test_ranks(self):
        self.assertEqual(ranks({"ann": 10, "bob": 7, "cy": 10}),
                         {"ann": 1, "cy": 1, "bob": 3})


if __name__ == "__main__":
    unittest.main()
