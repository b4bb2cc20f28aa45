import io
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from logstats.stats import error_rate

LOG = """2024-05-01T12:00:00 INFO web: started
2024-05-01T12:00:01 ERROR db: connection lost
this line is garbage
2024-05-01T12:00:02 INFO web: request served
2024-05-01T12:00:03 WARNING web: slow request
"""


class StatsTest(unittest.TestCase):
    def test_error_rate_list(self):
        self.assertEqual(error_rate(LOG.splitlines()), 0.25)

    def test_error_rate_file(self):
        self.assertEqual(error_rate(io.StringIO(LOG)), 0.25)


if __name__ == "__main__":
    unittest.main()
