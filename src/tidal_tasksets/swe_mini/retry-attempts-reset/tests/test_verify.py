import unittest

from netretry.retry import Retrier, RetryError


def flaky(failures, error=ConnectionError):
    state = {"left": failures}

    def fn(value="ok"):
        if state["left"]:
            state["left"] -= 1
            raise error("connection reset")
        return value
    return fn


class VerifyRetry(unittest.TestCase):
    def setUp(self):
        self.delays = []
        self.retrier = Retrier(max_attempts=3, backoff=0.5, sleep=self.delays.append)

    def test_retries_until_success(self):
        self.assertEqual(self.retrier.call(flaky(2)), "ok")
        self.assertEqual(self.retrier.attempts, 3)
        self.assertEqual(self.delays, [0.5, 1.0])

    def test_passes_arguments(self):
        self.assertEqual(self.retrier.call(flaky(0), value="v"), "v")
        self.assertEqual(self.retrier.attempts, 1)

    def test_gives_up(self):
        with self.assertRaises(RetryError) as ctx:
            self.retrier.call(flaky(5))
        self.assertEqual(ctx.exception.attempts, 3)

    def test_other_errors_propagate(self):
        with self.assertRaises(KeyError):
            self.retrier.call(flaky(1, error=KeyError))
        self.assertEqual(self.delays, [])

    def test_second_call_gets_all_attempts(self):
        self.retrier.call(flaky(2))
        self.assertEqual(self.retrier.call(flaky(2)), "ok")

    def test_attempts_are_per_call(self):
        self.retrier.call(flaky(2))
        self.retrier.call(flaky(0))
        self.assertEqual(self.retrier.attempts, 1)

    def test_backoff_restarts_each_call(self):
        self.retrier.call(flaky(1))
        self.retrier.call(flaky(2))
        self.assertEqual(self.delays, [0.5, 0.5, 1.0])

    def test_after_giving_up(self):
        with self.assertRaises(RetryError):
            self.retrier.call(flaky(3))
        self.assertEqual(self.retrier.call(flaky(2)), "ok")

    def test_many_calls(self):
        for _ in range(5):
            self.assertEqual(self.retrier.call(flaky(1)), "ok")


if __name__ == "__main__":
    unittest.main()
