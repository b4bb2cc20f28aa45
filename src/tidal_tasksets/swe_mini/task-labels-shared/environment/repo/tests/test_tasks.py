import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tracker.tasks import Board, Task


class TaskTest(unittest.TestCase):
    def test_explicit_labels(self):
        task = Task("Refactor", ["tech-debt"])
        task.add_label("Backend ")
        self.assertEqual(task.labels, ["tech-debt", "backend"])

    def test_labels_are_per_task(self):
        board = Board()
        board.create("Fix login", "bug")
        docs = board.create("Write docs")
        self.assertEqual(docs.labels, [])


if __name__ == "__main__":
    unittest.main()
