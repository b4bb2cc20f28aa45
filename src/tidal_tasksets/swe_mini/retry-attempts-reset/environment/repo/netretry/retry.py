"""Retry a flaky call with exponential backoff."""

import time


class RetryError(Exception):
    def __init__(self, attempts, last_error):
        super().__init__(f"gave up after {attempts} attempts: {last_error!r}")
        self.attempts = attempts
        self.last_error = last_error


class Retrier:
    def __init__(self, max_attempts=3, backoff=0.1, retry_on=(ConnectionError, TimeoutError),
                 sleep=time.sleep):
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.retry_on = retry_on
        self.sleep = sleep
        self.attempts = 0   # attempts made by the latest call

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs), retried on `retry_on` errors up to max_attempts times,
        sleeping backoff, 2*backoff, 4*backoff, ... between attempts."""
        while True:
            self.attempts += 1
            try:
                return fn(*args, **kwargs)
            except self.retry_on as exc:
                if self.attempts >= self.max_attempts:
                    raise RetryError(self.attempts, exc) from exc
                self.sleep(self.backoff * 2 ** (self.attempts - 1))
