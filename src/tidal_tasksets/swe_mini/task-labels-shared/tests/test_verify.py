import unittest

from tracker.tasks import Board, Task


class VerifyTasks(unittest.TestCase):
    def test_explicit_labels(self):
        task = Task("Refactor", ["tech-debt"])
        task.add_label("Backend ")
        task.add_label("backend")
        self.assertEqual(task.labels, ["tech-debt", "backend"])

    def test_remove_label(self):
        task = Task("Refactor", ["a", "b"])
        task.remove_label(" A")
        self.assertEqual(task.labels, ["b"])

    def test_new_task_has_no_labels(self):
        Task("first").add_label("urgent")
        self.assertEqual(Task("second").labels, [])

    def test_tasks_do_not_share_labels(self):
        a, b = Task("a"), Task("b")
        a.add_label("x")
        b.add_label("y")
        self.assertEqual((a.labels, b.labels), (["x"], ["y"]))

    def test_board_create(self):
        board = Board()
        board.create("Fix login", "bug")
        docs = board.create("Write docs")
        self.assertEqual(docs.labels, [])

    def test_with_label(self):
        board = Board()
        board.create("Fix login", "Bug")
        board.create("Write docs", "docs")
        board.create("Crash on save", "bug", "urgent")
        self.assertEqual([t.title for t in board.with_label("bug")],
                         ["Fix login", "Crash on save"])

    def test_open_tasks(self):
        board = Board()
        done = board.create("Done already")
        board.create("Still open")
        done.complete()
        self.assertEqual([t.title for t in board.open_tasks()], ["Still open"])


if __name__ == "__main__":
    unittest.main()
