import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from netretry.retry import Retrier


def flaky(failures):
    state = {"left": failures}

    def fn():
        if state["left"]:
            state["left"] -= 1
            raise ConnectionError("connection reset")
        return "ok"
    return fn


class RetryTest(unittest.TestCase):
    def test_retries_until_success(self):
        r = Retrier(max_attempts=3, sleep=lambda s: None)
        self.assertEqual(r.call(flaky(2)), "ok")

    def test_second_call_gets_all_attempts(self):
        r = Retrier(max_attempts=3, sleep=lambda s: None)
        r.call(flaky(2))
        self.assertEqual(r.call(flaky(2)), "ok")


if __name__ == "__main__":
    unittest.main()
