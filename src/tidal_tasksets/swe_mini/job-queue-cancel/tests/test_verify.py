import unittest

from jobqueue.queue import JobQueue


class VerifyQueue(unittest.TestCase):
    def test_submit_and_pending(self):
        q = JobQueue()
        a = q.submit("a", priority=5)
        b = q.submit("b", priority=1)
        self.assertEqual((q.pending(), len(q), a in q), ([b, a], 2, True))

    def test_pop_by_priority(self):
        q = JobQueue()
        q.submit("low", priority=5)
        urgent = q.submit("urgent", priority=1)
        mid = q.submit("mid", priority=3)
        self.assertEqual([q.pop(), q.pop()], [(urgent, "urgent"), (mid, "mid")])
        self.assertEqual(len(q), 1)

    def test_fifo_among_equal_priorities(self):
        q = JobQueue()
        ids = [q.submit(n) for n in "abcde"]
        self.assertEqual([q.pop()[0] for _ in range(5)], ids)

    def test_pop_empty(self):
        with self.assertRaises(IndexError):
            JobQueue().pop()

    def test_cancel_returns_true_and_removes(self):
        q = JobQueue()
        a = q.submit("a")
        b = q.submit("b")
        self.assertTrue(q.cancel(a))
        self.assertEqual((len(q), a in q, q.pending()), (1, False, [b]))

    def test_cancelled_job_is_never_popped(self):
        q = JobQueue()
        a = q.submit("a", priority=0)
        b = q.submit("b", priority=1)
        q.cancel(a)
        self.assertEqual(q.pop(), (b, "b"))
        with self.assertRaises(IndexError):
            q.pop()

    def test_cancel_unknown_twice_or_popped(self):
        q = JobQueue()
        a = q.submit("a")
        b = q.submit("b")
        self.assertFalse(q.cancel(999))
        self.assertTrue(q.cancel(b))
        self.assertFalse(q.cancel(b))
        q.pop()
        self.assertFalse(q.cancel(a))

    def test_none_payload(self):
        q = JobQueue()
        a = q.submit(None)
        self.assertTrue(q.cancel(a))
        self.assertEqual(len(q), 0)
        b = q.submit(None)
        self.assertEqual(q.pop(), (b, None))

    def test_cancel_does_not_rebuild_heap(self):
        q = JobQueue()
        ids = [q.submit(i, priority=i % 7) for i in range(2000)]
        heap = q._heap
        for job_id in ids[::2]:
            q.cancel(job_id)
        self.assertIs(q._heap, heap)
        popped = [q.pop()[1] for _ in range(len(q))]
        self.assertEqual(popped, sorted(range(1, 2000, 2), key=lambda i: (i % 7, i)))


if __name__ == "__main__":
    unittest.main()
