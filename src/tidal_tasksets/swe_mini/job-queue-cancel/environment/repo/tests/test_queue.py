import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobqueue.queue import JobQueue


class QueueTest(unittest.TestCase):
    def test_pending(self):
        q = JobQueue()
        a = q.submit("a", priority=5)
        b = q.submit("b", priority=1)
        self.assertEqual(q.pending(), [b, a])

    def test_pop_by_priority(self):
        q = JobQueue()
        q.submit("low", priority=5)
        urgent = q.submit("urgent", priority=1)
        self.assertEqual(q.pop(), (urgent, "urgent"))

    def test_cancel(self):
        q = JobQueue()
        a = q.submit("a")
        b = q.submit("b")
        self.assertTrue(q.cancel(a))
        self.assertEqual(q.pop(), (b, "b"))


if __name__ == "__main__":
    unittest.main()
