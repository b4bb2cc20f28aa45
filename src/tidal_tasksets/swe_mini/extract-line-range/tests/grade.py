"""Grade /app against the hidden tests in test_verify.py (next to this file).

reward = passed / total over the verifier's test cases: a failure, an error or a test
that runs past PER_TEST_S seconds counts as not passed. When the tests cannot be loaded
at all (typically: the agent's package no longer imports), the reward is 0.0. The reward
goes to /logs/verifier/reward.txt, which holds 0.0 from the start so that a crash or a
kill still leaves a reward behind.
"""

import importlib.util
import os
import signal
import sys
import traceback
import unittest

APP = "/app"
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "test_verify.py")
REWARD = "/logs/verifier/reward.txt"
PER_TEST_S = 3


def write_reward(value):
    os.makedirs(os.path.dirname(REWARD), exist_ok=True)
    with open(REWARD, "w") as f:
        f.write(f"{value:.6f}\n")


class TestTimeout(BaseException):
    """Raised in a test that runs too long (a BaseException, so `except Exception` in the
    code under test cannot swallow it)."""


def _on_alarm(signum, frame):
    raise TestTimeout(f"test ran longer than {PER_TEST_S} s")


class Result(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passed = set()

    def startTest(self, test):
        super().startTest(test)
        signal.alarm(PER_TEST_S)

    def stopTest(self, test):
        signal.alarm(0)
        super().stopTest(test)

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed.add(test.id())


def main():
    write_reward(0.0)
    sys.path.insert(0, APP)
    try:
        os.chdir(APP)
    except OSError:
        pass
    try:
        spec = importlib.util.spec_from_file_location("swe_mini_verify", TESTS)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        print("could not load the verifier tests (does the package still import?): reward 0.0")
        return
    total = suite.countTestCases()
    signal.signal(signal.SIGALRM, _on_alarm)
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=2, resultclass=Result)
    try:
        result = runner.run(suite)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        print("the test run itself crashed: reward 0.0")
        return
    passed = len(result.passed)
    reward = passed / total if total else 0.0
    write_reward(reward)
    print(f"passed {passed} of {total} verifier tests: reward {reward:.6f}")


if __name__ == "__main__":
    main()
